"""The bad-input registry: each row is an input a user may give (to a model, its config or a command line) and
the error it must raise. tests/test_bad_inputs.py runs every row; this module renders the rows as
docs/bad_inputs.md, and a test fails when that file differs from what it would render:

    python -m tests.bad_input_table            # rewrite docs/bad_inputs.md
"""

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "bad_inputs.md"


@dataclass
class Case:
    area: str  # the model, config or command the input goes to
    given: str  # the input, as a user writes it
    run: Callable  # run(tmp: Path) must raise `error`
    error: type
    message: str  # regex the message must match (searched)


# ---- tiny models, built once -------------------------------------------------------------------------------------

def loopformer_config(**overrides):
    from loopformer_hf import LoopFormerConfig

    kwargs = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                  num_loops=4, max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LoopFormerConfig(**{**kwargs, **overrides})


def fprm_config(**overrides):
    from fprm_hf import FPRMConfig

    kwargs = dict(vocab_size=7, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                  grid_size=4, conv_type="2d", num_prefix_tokens=2, max_loops=4)
    return FPRMConfig(**{**kwargs, **overrides})


@lru_cache(maxsize=None)
def loopformer():
    from loopformer_hf import LoopFormerForCausalLM

    torch.manual_seed(0)
    return LoopFormerForCausalLM(loopformer_config()).eval()


@lru_cache(maxsize=None)
def fprm():
    from fprm_hf import FPRMForReasoning

    torch.manual_seed(0)
    return FPRMForReasoning(fprm_config()).eval()


IDS = torch.tensor([[3, 4, 5]])
GRID = torch.zeros(1, 16, dtype=torch.long)


def padded_mask():
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


def cli(module):
    """run(tmp) of a command line: its `main(argv)` called in-process; `{tmp}` in an argument is the case's folder.
    A nonzero status that `main` returns is raised as SystemExit, as `python -m` (`sys.exit(main())`) does."""
    def make(*argv):
        def run(tmp):
            import importlib

            main = importlib.import_module(module).main
            status = main([a.replace("{tmp}", str(tmp)) for a in argv])
            if isinstance(status, int) and status:
                raise SystemExit(status)
        return run
    return make


def file_in(tmp, name, content=b"x"):
    path = Path(tmp) / name
    path.write_bytes(content)
    return path


def locked(tmp):
    """An output_dir whose training.lock names a run on another host (taken as alive: its pid says nothing here), as
    a running run's does; fixed values keep the table the same on every machine."""
    from looped_training.checkpoints import LOCK_FILE

    folder = Path(tmp) / "run"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": 4321, "host": "another-host"}))
    return folder


LF, FP = "LoopFormer", "FPRM"
TRAIN = cli("looped_training.loopformer.train")
EVALUATE = cli("looped_training.loopformer.evaluate")
REPORT = cli("looped_training.loopformer.report")
FPRM_TRAIN = cli("looped_training.fprm.train")
PUBLISH = cli("looped_training.publish")
LORA = cli("looped_training.finetune_lora")
LF_CONVERT = cli("loopformer_hf.convert_reference")
FP_CONVERT = cli("fprm_hf.convert_reference")

CASES = [
    # LoopFormer configuration (the same check runs for config.json, from_pretrained kwargs and attribute sets)
    Case(f"{LF} config", "default_loop_budget=-3", lambda t: loopformer_config(default_loop_budget=-3), ValueError,
         r"default_loop_budget.*got -3"),
    Case(f"{LF} config", "halt_kv_fill='bogus'", lambda t: loopformer_config(halt_kv_fill="bogus"), ValueError,
         r"halt_kv_fill.*got 'bogus'"),
    Case(f"{LF} config", "tie_word_embeddings='no'", lambda t: loopformer_config(tie_word_embeddings="no"),
         ValueError, r"tie_word_embeddings.*True or False, got 'no'"),
    Case(f"{LF} config", "attention_bias='no'", lambda t: loopformer_config(attention_bias="no"), ValueError,
         r"attention_bias.*True or False, got 'no'"),
    Case(f"{LF} config", "num_loops=0", lambda t: loopformer_config(num_loops=0), ValueError, r"num_loops.*got 0"),
    Case(f"{LF} config", "hidden_size=30, num_attention_heads=4",
         lambda t: loopformer_config(hidden_size=30), ValueError, r"divisible by `num_attention_heads`"),
    Case(f"{LF} config", "config.max_loop_budget_factor = 0 (attribute set)",
         lambda t: setattr(loopformer_config(), "max_loop_budget_factor", 0), ValueError,
         r"max_loop_budget_factor.*got 0"),
    # LoopFormer forward / generate
    Case(f"{LF} forward", "loop_budget=10**6", lambda t: loopformer()(IDS, loop_budget=10**6), ValueError,
         r"exceeds the largest loop budget.*max_loop_budget=32"),
    Case(f"{LF} forward", "loop_budget=2.5", lambda t: loopformer()(IDS, loop_budget=2.5), ValueError,
         r"loop_budget.*integer >= 1, got 2\.5"),
    Case(f"{LF} forward", "step_schedule=[0.5, 0.4]", lambda t: loopformer()(IDS, step_schedule=[0.5, 0.4]),
         ValueError, r"must sum to 1"),
    Case(f"{LF} forward", "step_schedule='bogus'", lambda t: loopformer()(IDS, step_schedule="bogus"), ValueError,
         r"step_schedule.*got 'bogus'"),
    Case(f"{LF} forward", "halt_eps=0", lambda t: loopformer()(IDS, halt_eps=0), ValueError,
         r"halt_eps.*positive finite float, got 0"),
    Case(f"{LF} forward", "input_ids of shape (1, 0)", lambda t: loopformer()(torch.zeros(1, 0, dtype=torch.long)),
         ValueError, r"input_ids.*at least one token"),
    Case(f"{LF} generate", "halt_eps=0.1, prefill_chunk_size=2",
         lambda t: loopformer().generate(IDS, max_new_tokens=1, halt_eps=0.1, prefill_chunk_size=2), ValueError,
         r"halt_eps.*chunked prefill"),
    Case(f"{LF} forward", "4-D int 0/1 attention_mask", lambda t: loopformer()(
        IDS, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.long).tril()), ValueError,
         r"4-D `attention_mask` must be bool .* or float .*got torch.int64"),
    Case(f"{LF} forward", "4-D attention_mask of the wrong size", lambda t: loopformer()(
        IDS, attention_mask=torch.ones(1, 1, 3, 4, dtype=torch.bool)), ValueError,
         r"must have shape \(batch=1 or 1, 1, q_len=3, kv_len=3\), got \(1, 1, 3, 4\)"),
    Case(f"{LF} forward", "attention_mask=[[1, 2, 1]]", lambda t: loopformer()(
        IDS, attention_mask=torch.tensor([[1, 2, 1]])), ValueError, r"only 0 \(padding\) and 1 .*got \[2\]"),
    Case(f"{LF} forward", "position_ids of the wrong length", lambda t: loopformer()(
        IDS, position_ids=torch.arange(2)[None]), ValueError, r"position_ids.*new tokens=3.*got Tensor \(1, 2\)"),
    Case(f"{LF} forward", "position_ids=[[-1, 0, 1]]", lambda t: loopformer()(
        IDS, position_ids=torch.tensor([[-1, 0, 1]])), ValueError, r"position_ids.*>= 0, got -1"),
    Case(f"{LF} forward", "float position_ids", lambda t: loopformer()(IDS, position_ids=torch.arange(3.0)[None]),
         ValueError, r"position_ids.*integer tensor.*torch.float32"),
    Case(f"{LF} forward", "float input_ids", lambda t: loopformer()(IDS.float()), ValueError,
         r"input_ids.*integer tensor.*got torch.float32"),
    Case(f"{LF} forward", "inputs_embeds of width 16 (hidden_size 32)", lambda t: loopformer()(
        inputs_embeds=torch.zeros(1, 3, 16)), ValueError, r"inputs_embeds.*hidden_size=32.*\(1, 3, 16\)"),
    Case(f"{LF} forward", "float64 inputs_embeds", lambda t: loopformer()(
        inputs_embeds=torch.zeros(1, 3, 32, dtype=torch.float64)), ValueError,
         r"inputs_embeds.*torch.float32 tensor.*got torch.float64"),
    Case(f"{LF} forward", "a cache of 2 sequences for 1", lambda t: loopformer()(
        IDS[:, :1], cache=loopformer()(IDS.expand(2, 3), use_cache=True).cache), ValueError,
         r"cache holds 2 sequences; this call gives 1"),
    # FPRM configuration
    Case(f"{FP} config", "causal='no'", lambda t: fprm_config(causal="no"), ValueError,
         r"`causal` must be True or False, got 'no'"),
    Case(f"{FP} config", "tie_word_embeddings='no'", lambda t: fprm_config(tie_word_embeddings="no"), ValueError,
         r"`tie_word_embeddings` must be True or False, got 'no'"),
    Case(f"{FP} config", "norm_type='bogus'", lambda t: fprm_config(norm_type="bogus"), ValueError,
         r"`norm_type` must be one of .* got 'bogus'"),
    Case(f"{FP} config", "conv_type='2d', grid_size=None", lambda t: fprm_config(grid_size=None), ValueError,
         r"conv_type='2d'.*needs `grid_size`"),
    Case(f"{FP} config", "alpha1=1.0", lambda t: fprm_config(alpha1=1.0), ValueError,
         r"`alpha1` must lie strictly between 0 and 1"),
    Case(f"{FP} config", "config.fixed_init = 1 (attribute set)", lambda t: setattr(fprm_config(), "fixed_init", 1),
         ValueError, r"`fixed_init` must be True or False, got 1"),
    # FPRM forward
    Case(f"{FP} forward", "solver_state of another input of the same shape", lambda t: fprm()(
        GRID + 1, solver_state=fprm()(GRID, max_loops=1).solver_state), ValueError,
         r"solver_state` was computed on other inputs than these \(rows \[0\] differ\)"),
    Case(f"{FP} forward", "bf16 solver_state into an fp32 model", lambda t: fprm()(GRID, solver_state=replace(
        fprm()(GRID, max_loops=1).solver_state, hidden=fprm()(GRID, max_loops=1).solver_state.hidden.bfloat16())),
         ValueError, r"solver_state.hidden` is torch.bfloat16, this model computes in torch.float32"),
    Case(f"{FP} forward", "halting='no'", lambda t: fprm()(GRID, halting="no"), ValueError,
         r"`halting` must be True or False, got 'no'"),
    Case(f"{FP} forward", "attention_mask with padding", lambda t: fprm()(GRID, attention_mask=padded_mask()),
         ValueError, r"cannot honour a padded `attention_mask`"),
    Case(f"{FP} forward", "9 tokens for a 4x4 grid", lambda t: fprm()(torch.zeros(1, 9, dtype=torch.long)),
         ValueError, r"reads 4x4 grids, i\.e\. 16 tokens per sample; got 9"),
    Case(f"{FP} forward", "a token id >= vocab_size", lambda t: fprm()(GRID + 7), ValueError,
         r"`input_ids` must lie in \[0, 6\]"),
    Case(f"{FP} forward", "max_loops=0", lambda t: fprm()(GRID, max_loops=0), ValueError,
         r"`max_loops` must be an integer >= 1, got 0"),
    Case(f"{FP} forward", "eta=1.5", lambda t: fprm()(GRID, eta=1.5), ValueError,
         r"`eta` must be a number in \(0, 1\], got 1\.5"),
    Case(f"{FP} forward", "labels with a token id >= vocab_size", lambda t: fprm()(GRID, labels=GRID + 7), ValueError,
         r"`labels` must lie in \[0, 6\] \(vocab_size=7\) or be -100"),
    Case(f"{FP} forward", "float labels", lambda t: fprm()(GRID, labels=GRID.float()), ValueError,
         r"`labels` must be an integer tensor of the shape of `input_ids`"),
    Case(f"{FP} forward", "output_attentions=True", lambda t: fprm()(GRID, output_attentions=True), ValueError,
         r"`output_attentions` must be None or False, got True"),
    # command lines (each refuses before any work)
    Case("loopformer.train", "--variant bogus", TRAIN("--output_dir", "{tmp}/run", "--variant", "bogus"),
         ValueError, r"`variant` must be one of .* got 'bogus'"),
    Case("loopformer.train", "--chat_template MISSING_FILE",
         TRAIN("--output_dir", "{tmp}/run", "--chat_template", "{tmp}/missing.jinja"), ValueError,
         r"--chat_template .* is not a file"),
    Case("loopformer.train", "--config file.txt", TRAIN("--config", "{tmp}/file.txt"), ValueError,
         r"config file must end in one of"),
    Case("loopformer.evaluate", "--generate_budgets 0", EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out",
                                                                 "--generate_budgets", "0"), ValueError,
         r"--generate_budgets \[0\].*>= 1"),
    Case("loopformer.evaluate", "--schedules bogus", EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out",
                                                              "--schedules", "bogus"), ValueError,
         r"--schedules \['bogus'\] unknown"),
    Case("loopformer.evaluate", "--names with a count other than the checkpoints'",
         EVALUATE("{tmp}/a", "{tmp}/b", "--output_dir", "{tmp}/out", "--names", "x"), ValueError,
         r"--names gives 1 names for 2 checkpoints"),
    Case("loopformer.evaluate", "--device cudax", EVALUATE("{tmp}/ckpt", "--output_dir", "{tmp}/out",
                                                           "--device", "cudax"), ValueError,
         r"--device 'cudax' is not usable here"),
    Case("loopformer.report", "--tasks bogus", REPORT("--tasks", "bogus", "--runs_dir", "{tmp}/runs", "--docs_dir",
                                                      "{tmp}/docs"), ValueError, r"--tasks \['bogus'\] unknown"),
    Case("loopformer.report", "--no_train with no finished runs",
         REPORT("--no_train", "--tasks", "synthetic", "--runs_dir", "{tmp}/runs", "--docs_dir", "{tmp}/docs"),
         ValueError, r"--no_train: no finished run"),
    Case("loopformer.train", "--output_dir FILE", lambda t: TRAIN("--output_dir", str(file_in(t, "taken")))(t),
         ValueError, r"--output_dir .*taken' is a file, not a folder"),
    Case("loopformer.train", "--output_dir of a running run", lambda t: TRAIN("--output_dir", str(locked(t)))(t),
         ValueError, r"is being written by another run \(process \d+ on "),
    Case("fprm.train", "--output_dir of a running run", lambda t: FPRM_TRAIN("--output_dir", str(locked(t)))(t),
         ValueError, r"is being written by another run \(process \d+ on "),
    Case("fprm.train", "--preset bogus", FPRM_TRAIN("--preset", "bogus"), ValueError,
         r"`--preset` must be one of .* got 'bogus'"),
    Case("fprm.train", "--task bogus", FPRM_TRAIN("--task", "bogus", "--output_dir", "{tmp}/run"), ValueError,
         r"`--task` must be one of .* got 'bogus'"),
    Case("publish", "--repo_id without an owner", PUBLISH("--checkpoint", "{tmp}", "--repo_id", "name"), SystemExit,
         r"--repo_id must be 'owner/name', got 'name'"),
    Case("publish", "--checkpoint a folder with no config.json", PUBLISH("--checkpoint", "{tmp}", "--repo_id", "o/n"),
         SystemExit, r"--checkpoint .* is not a saved model folder"),
    Case("finetune_lora", "--model a folder with no model", LORA("--model", "{tmp}", "--output", "{tmp}/out"),
         ValueError, r"Unrecognized model in .*config\.json"),
    Case("loopformer_hf.convert_reference", "--output an existing file",
         lambda t: LF_CONVERT("--checkpoint", "{tmp}/ref.pt", "--output", str(file_in(t, "taken")), "--n-layer",
                              "1", "--n-loops", "2", "--n-embd", "8", "--n-head", "2")(t),
         SystemExit, r"exists and is not a folder"),
    Case("loopformer_hf.convert_reference", "--checkpoint MISSING_FILE",
         LF_CONVERT("--checkpoint", "{tmp}/missing.pt", "--output", "{tmp}/out", "--n-layer", "1", "--n-loops", "2",
                    "--n-embd", "8", "--n-head", "2"), SystemExit, r"does not exist or is not a file"),
    Case("fprm_hf.convert_reference", "--checkpoint MISSING_FILE",
         lambda t: FP_CONVERT("--checkpoint", "{tmp}/missing.pt", "--config", str(file_in(t, "arch.yaml", b"{}")),
                              "--output", "{tmp}/out")(t), SystemExit, r"--checkpoint .*missing\.pt.* is not a file"),
]


# ---- running a case and rendering the table ------------------------------------------------------------------------

def raise_of(case, tmp):
    """The exception `case.run(tmp)` raises (None if it returns) and its message; a command line's argparse error
    (SystemExit) is read from what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            case.run(Path(tmp))
    except BaseException as e:  # SystemExit included: argparse errors
        if isinstance(e, SystemExit):
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return e, lines[-1] if lines else str(e.code)
        return e, str(e)
    return None, None


def clean(message, tmp):
    message = message.replace(os.path.realpath(tmp), "<tmp>").replace(str(tmp), "<tmp>")
    message = " ".join(message.split())
    if len(message) > 220:
        message = message[:217] + "..."
    return message.replace("|", "\\|")


def render():
    rows = ["# Bad inputs and the errors they raise", "",
            "Generated from the registry in tests/bad_input_table.py (`python -m tests.bad_input_table`); "
            "tests/test_bad_inputs.py runs every row and fails when this file is out of date. Messages are "
            "shortened to 220 characters; `<tmp>` stands for the folder a case ran in.", "",
            "| where | input | error | message |", "|---|---|---|---|"]
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            error, message = raise_of(case, tmp)
            name = "(none)" if error is None else type(error).__name__
            if isinstance(error, SystemExit):
                name = f"SystemExit({error.code})"
            rows.append(f"| {case.area} | `{case.given}` | {name} | {clean(message or '', tmp)} |")
    return "\n".join(rows) + "\n"


def main():
    DOC.write_text(render())
    print("wrote", DOC)


if __name__ == "__main__":
    main()
