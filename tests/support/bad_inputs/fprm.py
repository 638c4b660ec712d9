"""The bad-input registry's FPRM rows: its config, forward, `iter_solve`, TRM's trainer, loading (its own saves and
the authors' folders) and its converter; with the tiny models and folders they run on."""

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from support.bad_inputs.shared import FP, Case, cli, command, field_error, refused_setting


def fprm_config(**overrides):
    from support.tiny_models import tiny_fprm_config

    return tiny_fprm_config(**{"num_hidden_layers": 1, "max_loops": 4, **overrides})


@lru_cache(maxsize=None)
def trm():
    from fprm_hf import FPRMForReasoning

    torch.manual_seed(0)
    return FPRMForReasoning(fprm_config(recursion="trm", H_cycles=1, L_cycles=1, halt_max_steps=1)).eval()


def trm_trainer(model, tmp):
    from looped_training.fprm.arguments import FPRMTrainingArguments
    from looped_training.fprm.trainer_trm import TRMTrainer

    args = FPRMTrainingArguments(output_dir=str(tmp), use_cpu=True, report_to="none", save_strategy="no")
    return TRMTrainer(model=model, args=args)


@lru_cache(maxsize=None)
def fprm(**overrides):
    from fprm_hf import FPRMForReasoning

    torch.manual_seed(0)
    return FPRMForReasoning(fprm_config(**overrides)).eval()


GRID = torch.zeros(1, 16, dtype=torch.long)


def fprm_iter_solve(batch_size, mode, **overrides):
    """`iter_solve` (fprm_hf/batching_fprm.py) of a tiny FPRM on one puzzle; its checks run at the call."""
    from fprm_hf.batching_fprm import iter_solve

    return iter_solve(fprm(**overrides), GRID, batch_size, mode)


def padded_mask():
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


def pickle_as_safetensors(tmp):
    """A saved FPRM folder whose model.safetensors is really a pickle (torch.save), as a renamed file or a
    malicious upload would be."""
    folder = Path(tmp) / "model"
    fprm().save_pretrained(folder)
    torch.save({"weight": torch.zeros(2)}, folder / "model.safetensors")
    return folder


FP_CONVERT = cli("fprm_hf.convert_authors")
FP_CONVERT_CMD = command("fprm_hf.convert_authors")


def saved_fprm(tmp, **overrides):
    """A saved FPRM folder (`overrides`: grid_size=9, vocab_size=11 reads Sudoku, as `published` wants)."""
    folder = Path(tmp) / "model"
    fprm(**overrides).save_pretrained(folder)
    return folder


def sudoku_fprm(tmp):
    return saved_fprm(tmp, grid_size=9, vocab_size=11)


def published_root(tmp):
    """The root of a stand-in of the authors' repo, holding the task folder sudoku/ (tests/support/fprm_reference_oracle.py)."""
    from support.fprm_reference_oracle import write_published_folder

    root = Path(tmp) / "fprm"
    write_published_folder(root / "sudoku", "sudoku", steps=(10,), hidden_size=64, num_heads=4, puzzle_emb_ndim=64)
    return root


def pickled_step_file(tmp):
    """An authors' task folder whose step file needs pickle (an object only pickle rebuilds)."""
    import argparse

    folder = Path(tmp) / "sudoku"
    folder.mkdir()
    torch.save({"model": argparse.Namespace(x=1)}, folder / "step_10")
    return folder


CASES = [
    # FPRM configuration
    *(
        refused_setting(f"{FP} config", fprm_config, field, value, message)
        for field, value, message in (
            *(
                (flag, value, field_error(flag, rf"expected bool, got {type(value).__name__} \(value: {value!r}\)"))
                for flag, value in (
                    ("causal", "no"),
                    ("outer_only", "no"),
                    ("fixed_init", 1),
                    ("tie_word_embeddings", "no"),
                    ("attention_bias", "no"),
                    ("mlp_bias", "false"),
                )
            ),
            ("norm_type", "bogus", field_error("norm_type", r"expected one of \('pre', 'post', 'peri'\), got bogus")),
            (
                "residual_scaling",
                "bogus",
                field_error("residual_scaling", r"one of .*'input_independent'.* got bogus"),
            ),
            ("residual_scaling", "outer_only", field_error("residual_scaling", r"one of .* got outer_only")),
            ("halt_eps", 0, r"`halt_eps` must be a positive finite number .* got 0"),
            ("halt_eps", -1, r"`halt_eps` must be a positive finite number .* got -1"),
            ("max_loops", 0, r"`max_loops` must be an integer >= 1, got 0"),
            ("alpha1", 1.0, field_error("alpha1", r"must lie strictly between 0 and 1, got 1\.0")),
            (
                "grid_size",
                [3, 3, 3],
                field_error("grid_size", r"None, a positive int or \[height, width\], got \[3, 3, 3\]"),
            ),
            ("grid_size", None, r"conv_type='2d'.*needs `grid_size`"),
            ("conv_kernel_size", 2, r"2-D conv needs an odd `conv_kernel_size`.*got 2"),
            ("num_attention_heads", 3, r"`hidden_size` \(32\) must be divisible by `num_attention_heads` \(3\)"),
            ("initializer_range", float("inf"), field_error("initializer_range", "a positive finite number, got inf")),
            ("initial_state_seed", 2**70, field_error("initial_state_seed", r"an integer in \[-2\*\*63, 2\*\*64\)")),
            ("rope_parameters", "yarn", field_error("rope_parameters", r"expected dict, got str \(value: 'yarn'\)")),
            ("rope_parameters", {"rope_type": "nope"}, r"rope_type.*must be one of \('default', 'linear'.*got 'nope'"),
            ("rope_parameters", {"partial_rotary_factor": 0.0}, r"partial_rotary_factor.*\(0, 1\], got 0\.0"),
            ("recursion", "hrm", field_error("recursion", r"expected one of \('fixed_point', 'trm'\), got hrm")),
            ("H_cycles", 0, field_error("H_cycles", r"0")),
            ("halt_exploration_prob", 1.5, field_error("halt_exploration_prob", r"probability in \[0, 1\], got 1\.5")),
        )
    ),
    Case(
        f"{FP} config",
        "rope_parameters={'rope_type': 'linear'} (no factor)",
        lambda t: fprm_config(rope_parameters={"rope_type": "linear"}),
        StrictDataclassError,
        r"rope_parameters.*Missing required keys .*'factor'",
    ),
    Case(
        f"{FP} config",
        "position_embedding_type='learned', rope_parameters={'rope_theta': 500.0}",
        lambda t: fprm_config(position_embedding_type="learned", rope_parameters={"rope_theta": 500.0}),
        StrictDataclassError,
        r"rope_parameters.*apply to position_embedding_type='rope'.*'learned'",
    ),
    *(
        Case(
            f"{FP} config",
            f"{field}={value!r} (a save of an earlier version)",
            lambda t, kw={field: value}: fprm_config(**kw),
            ValueError,
            rf"`{field}={value!r}`: this config.json was saved by an earlier version .* at commit {commit}",
        )
        for field, value, commit in (
            ("conv_placement", "injection", "7688b05"),
            ("final_norm", True, "7688b05"),
            ("norm_position", "post", "ffb16f3"),
        )
    ),
    # FPRM forward
    Case(
        f"{FP} forward",
        "solver_state of another input of the same shape",
        lambda t: fprm()(GRID + 1, solver_state=fprm()(GRID, max_loops=1).solver_state),
        ValueError,
        r"solver_state` was computed on other inputs than these \(rows \[0\] differ\)",
    ),
    Case(
        f"{FP} forward",
        "bf16 solver_state into an fp32 model",
        lambda t: fprm()(
            GRID,
            solver_state=replace(
                fprm()(GRID, max_loops=1).solver_state, hidden=fprm()(GRID, max_loops=1).solver_state.hidden.bfloat16()
            ),
        ),
        ValueError,
        r"solver_state.hidden` is torch.bfloat16, this model computes in torch.float32",
    ),
    *(
        Case(
            f"{FP} forward",
            f"{flag}='no'",
            lambda t, kw={flag: "no"}: fprm()(GRID, **kw),
            ValueError,
            rf"`{flag}` must be True or False, got 'no' \(str\)",
        )
        for flag in ("halting", "output_residual_trace", "output_hidden_states")
    ),
    *(
        Case(
            f"{FP} forward",
            ", ".join(f"{k}={v!r}" for k, v in kw.items()),
            lambda t, kw=kw: fprm()(GRID, **kw),
            ValueError,
            message,
        )
        for kw, message in (
            (dict(halt_eps=0.0), r"`halt_eps` must be a positive finite number .* got 0\.0"),
            (dict(halt_eps=-1e-3), r"`halt_eps` must be a positive finite number .* got -0\.001"),
            (dict(halt_eps=float("nan")), r"`halt_eps` must be a positive finite number .* got nan"),
            (dict(max_loops=2.5), r"`max_loops` must be an integer >= 1, got 2\.5"),
            (dict(gamma=0), r"`gamma` must be a number in \(0, 1\], got 0"),
            (dict(patience=0), r"`patience` must be an integer >= 1, got 0"),
            (dict(generator=123), r"`generator` must be a torch\.Generator or None, got int"),
            (dict(solver_state="nope"), r"`solver_state` must be the FPRMSolverState"),
        )
    ),
    Case(
        f"{FP} forward",
        "a TRM model (recursion='trm') given an FPRM solver_state",
        lambda t: trm()(GRID, solver_state=fprm()(GRID, max_loops=1).solver_state),
        ValueError,
        r"`solver_state` of a TRM model \(recursion='trm'\) must be the TRMState of a previous call",
    ),
    Case(
        "TRMTrainer",
        "a model with recursion='fixed_point'",
        lambda t: trm_trainer(fprm(), t),
        ValueError,
        r"TRMTrainer trains a model with recursion='trm', got recursion='fixed_point': use FPRMTrainer",
    ),
    Case(
        f"{FP} forward",
        "attention_mask with padding",
        lambda t: fprm()(GRID, attention_mask=padded_mask()),
        ValueError,
        r"cannot honour a padded `attention_mask`",
    ),
    Case(
        f"{FP} forward",
        "9 tokens for a 4x4 grid",
        lambda t: fprm()(torch.zeros(1, 9, dtype=torch.long)),
        ValueError,
        r"reads 4x4 grids, i\.e\. 16 tokens per sample; got 9",
    ),
    Case(
        f"{FP} forward",
        "a token id >= vocab_size",
        lambda t: fprm()(GRID + 7),
        ValueError,
        r"`input_ids` must lie in \[0, 6\] \(vocab_size=7\), got values in \[7, 7\]",
    ),
    Case(f"{FP} forward", "a token id -1", lambda t: fprm()(GRID - 1), ValueError, r"got values in \[-1, "),
    Case(
        f"{FP} forward",
        "bool input_ids",
        lambda t: fprm()(GRID.bool()),
        ValueError,
        r"`input_ids` must be an integer tensor.*torch\.bool",
    ),
    Case(
        f"{FP} forward",
        "puzzle_identifiers=[0, 5] (num_puzzle_identifiers=2)",
        lambda t: fprm(num_puzzle_identifiers=2)(GRID.expand(2, 16), puzzle_identifiers=torch.tensor([0, 5])),
        ValueError,
        r"`puzzle_identifiers` must lie in \[0, 1\].*got values in \[0, 5\]",
    ),
    Case(
        f"{FP} forward",
        "float puzzle_identifiers",
        lambda t: fprm()(GRID, puzzle_identifiers=torch.zeros(1)),
        ValueError,
        r"`puzzle_identifiers` must be an integer tensor.*float32",
    ),
    Case(
        f"{FP} forward",
        "max_loops=0",
        lambda t: fprm()(GRID, max_loops=0),
        ValueError,
        r"`max_loops` must be an integer >= 1, got 0",
    ),
    Case(
        f"{FP} iter_solve",
        "batch_size=0",
        lambda t: fprm_iter_solve(0, "continuous"),
        ValueError,
        r"`batch_size` must be an integer >= 1, got 0",
    ),
    Case(
        f"{FP} iter_solve",
        "mode='rows'",
        lambda t: fprm_iter_solve(4, "rows"),
        ValueError,
        r"`mode` must be one of \('batch', 'sample', 'continuous'\) .*got 'rows'",
    ),
    Case(
        f"{FP} iter_solve",
        "mode='continuous' of a TRM model",
        lambda t: fprm_iter_solve(4, "continuous", recursion="trm"),
        ValueError,
        r"mode='continuous' refills the rows a fixed point has halted; a TRM model .* pass mode='batch'",
    ),
    Case(
        f"{FP} forward",
        "eta=1.5",
        lambda t: fprm()(GRID, eta=1.5),
        ValueError,
        r"`eta` must be a number in \(0, 1\], got 1\.5",
    ),
    Case(
        f"{FP} forward",
        "labels with a token id >= vocab_size",
        lambda t: fprm()(GRID, labels=GRID + 7),
        ValueError,
        r"`labels` must lie in \[0, 6\] \(vocab_size=7\) or be -100 \(ignored\), got \[7\]",
    ),
    Case(
        f"{FP} forward",
        "labels=-5 everywhere",
        lambda t: fprm()(GRID, labels=GRID - 5),
        ValueError,
        r"`labels` must lie in .*got \[-5\]",
    ),
    Case(
        f"{FP} forward",
        "labels of shape (1, 15)",
        lambda t: fprm()(GRID, labels=GRID[:, :15]),
        ValueError,
        r"`labels` must be an integer tensor of the shape of `input_ids` \(1, 16\), got Tensor \(1, 15\)",
    ),
    Case(
        f"{FP} forward",
        "labels as a list",
        lambda t: fprm()(GRID, labels=[[0] * 16]),
        ValueError,
        r"`labels` must be an integer tensor.*got list",
    ),
    Case(
        f"{FP} forward",
        "float labels",
        lambda t: fprm()(GRID, labels=GRID.float()),
        ValueError,
        r"`labels` must be an integer tensor of the shape of `input_ids`",
    ),
    Case(
        f"{FP} forward",
        "output_attentions=True",
        lambda t: fprm()(GRID, output_attentions=True),
        ValueError,
        r"`output_attentions` must be None or False, got True",
    ),
    # FPRM loading
    Case(
        f"{FP} from_pretrained",
        "a folder whose model.safetensors is a pickle",
        lambda t: fprm().from_pretrained(pickle_as_safetensors(t)),
        OSError,
        r"model/model\.safetensors' is not a safetensors file \(safetensors: .*\)\. Nothing was loaded",
    ),
]


WEAK_ROWS = [
    # FPRM's and LoopFormer's loading and knobs (bug 3, weak rows)
    Case(
        f"{FP} from_pretrained",
        "step=6510 on a saved model (not an authors' folder)",
        lambda t: fprm().from_pretrained(saved_fprm(t), step=6510),
        ValueError,
        r"step=6510 picks one of the authors' step_N files, and .*model holds none",
    ),
    Case(
        f"{FP} from_pretrained",
        "the authors' repo's root, no subfolder",
        lambda t: fprm().from_pretrained(published_root(t)),
        ValueError,
        r"fprm is the root of an authors' FPRM repo: give subfolder= one of its task folders \['sudoku'\]",
    ),
    Case(
        f"{FP} from_pretrained",
        "a step file that needs pickle",
        lambda t: fprm().from_pretrained(pickled_step_file(t)),
        ValueError,
        r"step_10: refused, it needs pickle .*: Unsupported global: GLOBAL argparse\.Namespace was not an allowed "
        r"global by default\.$",
    ),
]
