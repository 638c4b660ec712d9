"""The authors' checkpoints (Hub `fixed-point-reasoners/fprm`), loaded as published.

    FPRMForReasoning.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku")              # newest step
    FPRMForReasoning.from_pretrained("fixed-point-reasoners/fprm", subfolder="maze", step=6510)
    FPRMConfig.from_pretrained("fixed-point-reasoners/fprm", subfolder="sudoku")                    # the same config

What is known of the files (the repo's file list, a third-party loader of them, and their GitHub code
nilskiKonjIzDunava/fprm; the Hub cannot be reached from where this was written): each task folder (`sudoku/`, `maze/`)
holds 12 files `step_6510` ... `step_78120` (no extension), each `torch.save(model.state_dict())` of their compiled
training model (`pretrain.py`): keys `_orig_mod.model.inner.*`, fp32, the EMA copy. `sudoku/` also holds
`all_config.yaml` (`yaml.dump(PretrainConfig.model_dump())`; its `arch:` carries the fields their Hydra configs set)
and the model source `pretrain.py` copies beside a run; `maze/` holds the step files only. No config.json anywhere.

So every value comes from the files, in this order (`settings.resolve_settings`, the one derivation behind
`from_pretrained`, `FPRMConfig.from_pretrained` and `python -m fprm_hf.convert_authors`):

1. the tensors' shapes: vocabulary, width, blocks, SwiGLU width, conv type and kernel, conv bias, residual scaling,
   puzzle-embedding rows and width, learned positions, fixed z0, the Q-head;
2. the folder's `all_config.yaml` (`arch:`), or for a folder without one, their published experiment config of the
   folder's task, named as the source (`EXPERIMENTS`: config/arch/fprm.yaml under config/cfg_pretrain_<task>.yaml);
3. the defaults of their config classes (models/config.py `ReasoningModelConfig`,
   models/fixed_point_reasoning/fprm_config.py `FPRMConfig`);
4. the task sizes (tokens, grid) from the data path the config names (their dataset builders' sizes).

A value a later source states that the weights contradict is a `ValueError` naming both; one nothing determines is a
`ValueError` naming it. Where each value came from is logged and kept in `config.authors_checkpoint["sources"]`.
Step files are read with `torch.load(weights_only=True)` (a file that needs pickle is refused); the copied `.py`
files are never imported, read or run.
"""

import os
import re
import zipfile

import torch
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import cached_file, logging

from .layout import GITHUB, build_config, fixed_alphas_of, map_reference_state_dict, recursion_of, unknown_settings
from .settings import PublishedCheckpointError, resolve_settings, weight_settings

logger = logging.get_logger(__name__)

PUBLISHED_REPO = "fixed-point-reasoners/fprm"
CONFIG_YAML = "all_config.yaml"
STEP_FILE = re.compile(r"^step_(\d+)$")
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
# kwargs of `PreTrainedConfig.from_pretrained` that only locate the file (its `_get_config_dict` drops them too)
LOCATING_KWARGS = HUB_KWARGS + ("trust_remote_code", "_from_pipeline", "_from_auto", "step")

# Their Hydra configs as one run merges them (config/arch/fprm.yaml, then the task file's `arch:` section), for a
# folder that states no all_config.yaml. Only the fields that decide what the forward computes and the task's data.
_ARCH = dict(
    L_layers=2,
    hidden_size=512,
    num_heads=8,
    expansion=4,
    puzzle_emb_ndim=512,
    puzzle_emb_len=16,
    pos_encodings="rope",
    forward_dtype="bfloat16",
    mlp_t=False,
    fp_thresh=0.1,
    stepsize=1.0,
    stepsize_decay_train=0.9,
    stepsize_decay_eval=0.99,
    decay_patience=5,
    eps=1e-8,
    init_std=6.0,
    additive_noise_std=0.0,
    fixed_init=False,
    residual_scale="input-independent",
    alpha_1_init=0.75,
    alpha_2_init=0.25,
    outer_only=False,
    norm_type="pre-norm",
    normalize_input_injection=False,
    softmax_temp=1.0,
    n_decode_steps=0,
    max_iter_eval=1000,
)
EXPERIMENTS = {
    "sudoku": {
        "source": f"{GITHUB} config/arch/fprm.yaml + config/cfg_pretrain_sudoku.yaml",
        "data_paths": ["data/sudoku-extreme-1k-aug-1000"],
        "arch": dict(
            _ARCH, norm_placement="none", conv_type="conv2d", conv_kernel_size=3, conv_bias=False, max_iter=12
        ),
    },
    "maze": {
        "source": f"{GITHUB} config/arch/fprm.yaml + config/cfg_pretrain_maze.yaml",
        "data_paths": ["data/maze-30x30-hard-1k-noaug"],
        "arch": dict(
            _ARCH, norm_placement="output", conv_type="conv1d", conv_kernel_size=4, conv_bias=False, max_iter=24
        ),
    },
}
# ---- the folder ------------------------------------------------------------------------------------------------------


def _hub_kwargs(kwargs):
    return {key: kwargs[key] for key in HUB_KWARGS if kwargs.get(key) not in (None, "")}


def _where(path, hub_kwargs):
    sub = hub_kwargs.get("subfolder")
    return f"{os.fspath(path)}/{sub}" if sub else os.fspath(path)


def list_folder(path, hub_kwargs):
    """The file names directly in the folder (a local folder, or a Hub repo's `subfolder`), or None when the Hub
    cannot be asked (offline)."""
    sub = hub_kwargs.get("subfolder") or ""
    local = os.path.join(os.fspath(path), sub)
    if os.path.isdir(local):
        return sorted(os.listdir(local))
    if os.path.isdir(os.fspath(path)):  # a local folder without that subfolder
        return []
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(os.fspath(path), revision=hub_kwargs.get("revision"), token=hub_kwargs.get("token"))
    except Exception:  # offline, unknown repo: the caller decides with what it has
        return None
    prefix = f"{sub.strip('/')}/" if sub else ""
    return sorted(
        s.rfilename[len(prefix) :]
        for s in info.siblings
        if s.rfilename.startswith(prefix) and "/" not in s.rfilename[len(prefix) :]
    )


def task_folders(path, hub_kwargs):
    """The folders directly under `path` (a repo's root) that hold step_N files, as `sudoku/` and `maze/` of the
    published repo: [] for another folder, None when the Hub cannot be asked."""
    local = os.fspath(path)
    if os.path.isdir(local):
        return sorted(
            name
            for name in os.listdir(local)
            if os.path.isdir(os.path.join(local, name)) and steps_in(os.listdir(os.path.join(local, name)))
        )
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(local, revision=hub_kwargs.get("revision"), token=hub_kwargs.get("token"))
    except Exception:  # offline, unknown repo: nothing to suggest
        return None
    return sorted({s.rfilename.split("/")[0] for s in info.siblings if re.fullmatch(r"[^/]+/step_\d+", s.rfilename)})


def refuse_root_or_step(path, hub_kwargs, step):
    """For a folder that is not an authors' task folder: the root of an authors' repo (or a `subfolder` it lacks)
    named with its task folders, and `step` (which picks one of their step_N files) refused."""
    try:
        has_config = _resolve(path, "config.json", hub_kwargs) is not None
    except Exception:  # not there, offline: transformers' own loading says why
        has_config = True
    root = {k: v for k, v in hub_kwargs.items() if k != "subfolder"}
    if not has_config and (tasks := task_folders(path, root)):
        sub = hub_kwargs.get("subfolder")
        given = f"has no task folder {sub!r}" if sub else "is the root of an authors' FPRM repo"
        raise PublishedCheckpointError(
            f"{os.fspath(path)} {given}: give subfolder= one of its task folders {tasks} "
            f"(python -m looped_training.fprm.evaluate_authors: --subfolder)."
        )
    if step is not None:
        raise PublishedCheckpointError(
            f"step={step!r} picks one of the authors' step_N files, and {_where(path, hub_kwargs)} holds none (a saved "
            f"model holds one set of weights): leave step out."
        )


def steps_in(names):
    return sorted(int(m[1]) for name in names if (m := STEP_FILE.match(name)))


def _resolve(path, filename, hub_kwargs):
    return cached_file(os.fspath(path), filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)


def is_authors_layout(path, hub_kwargs):
    """A folder with no config.json and their step files (or their all_config.yaml). Never raises: a path that
    cannot be read is not theirs, and transformers' own loading then says why."""
    if not isinstance(path, (str, os.PathLike)) or os.path.isfile(os.fspath(path)):
        return False
    try:
        if _resolve(path, "config.json", hub_kwargs) is not None:
            return False
        names = list_folder(path, hub_kwargs)
        if names is None:  # offline: the cache may still hold the YAML
            return _resolve(path, CONFIG_YAML, hub_kwargs) is not None
    except Exception:  # an unknown repo, no network: not an authors' folder we can read
        return False
    return bool(steps_in(names)) or CONFIG_YAML in names


def choose_step(path, hub_kwargs, step=None):
    """The step file to read: `step`, else the newest in the folder."""
    names = list_folder(path, hub_kwargs)
    steps = None if names is None else steps_in(names)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PublishedCheckpointError(f"`step` must be a non-negative integer (a step_N file), got {step!r}.")
        if steps is not None and step not in steps:
            raise PublishedCheckpointError(
                f"{_where(path, hub_kwargs)} has no step_{step}; its steps: {steps or 'none'}."
            )
        return step
    if not steps:
        raise PublishedCheckpointError(
            f"{_where(path, hub_kwargs)} holds no step_N files"
            + (
                " (the Hub could not be listed: pass step=N to read one from the cache)"
                if names is None
                else f" (its files: {names[:8]})"
            )
            + "."
        )
    return steps[-1]


def read_step_file(path, hub_kwargs, step):
    """The state dict of `step_{step}`, read with `weights_only=True` (memory-mapped): no object is unpickled."""
    name = f"step_{step}"
    try:
        resolved = _resolve(path, name, hub_kwargs)
    except OSError as error:
        raise PublishedCheckpointError(f"{_where(path, hub_kwargs)}/{name}: {str(error).splitlines()[0]}") from None
    if resolved is None:
        raise PublishedCheckpointError(f"{_where(path, hub_kwargs)} has no {name}.")
    try:
        # memory-mapped where it can be: torch's legacy (non-zip) format, a valid step file too, cannot
        state = torch.load(resolved, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(resolved))
    except Exception as error:  # the unpickler or the zip reader says what it refused
        needs_pickle = "weights_only" in str(error) or "Unsupported global" in str(error)
        raise PublishedCheckpointError(
            f"{resolved}: "
            + (
                "refused, it needs pickle to load (only tensors are read from a step file): "
                if needs_pickle
                else "not a readable torch state dict (truncated or damaged?): "
            )
            + _reason(error)
        ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise PublishedCheckpointError(
            f"{resolved}: does not hold a state dict (str -> tensor), got {type(state).__name__}."
        )
    return state


def _reason(error):
    """The sentence of torch.load's error that says what it refused (for a pickle, the unpickler's "Unsupported
    global: ..."), without the terminal's escape codes."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    refused = next((line for line in lines if "Unsupported global" in line), None)
    if refused is not None:
        refused = refused.split("WeightsUnpickler error: ", 1)[-1]
        return refused.split(". ", 1)[0].rstrip(".") + "."
    return lines[0] if lines else type(error).__name__


def read_arch(path, hub_kwargs):
    """(arch fields, data paths, source) of the folder's all_config.yaml, or (None, None, None) without one."""
    import yaml

    resolved = _resolve(path, CONFIG_YAML, hub_kwargs)
    if resolved is None:
        return None, None, None
    try:
        with open(resolved, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)  # plain YAML only: no Python object is built
    except yaml.YAMLError as error:
        raise PublishedCheckpointError(f"{resolved}: not readable YAML ({str(error).splitlines()[0]}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("arch"), dict):
        raise PublishedCheckpointError(
            f"{resolved}: expected their pretrain config with an `arch:` mapping, got "
            f"{type(data).__name__}" + (f" with keys {sorted(data)[:10]}" if isinstance(data, dict) else "") + "."
        )
    paths = data.get("data_paths") or ([data["data_path"]] if data.get("data_path") else [])
    return dict(data["arch"]), list(paths), f"{CONFIG_YAML} arch"


def task_of(path, hub_kwargs):
    """The folder's task from its name (`sudoku`, `maze`), or None."""
    name = os.path.basename(os.path.normpath(os.path.join(os.fspath(path), hub_kwargs.get("subfolder") or "")))
    return name if name in EXPERIMENTS else None


# ---- an authors' folder -------------------------------------------------------------------------------------------


def authors_checkpoint_config(path, hub_kwargs, step=None, reference=None):
    """(FPRMConfig, state dict, step) of an authors' folder: the derivation over its files."""
    step = choose_step(path, hub_kwargs, step)
    reference = read_step_file(path, hub_kwargs, step) if reference is None else reference
    arch, data_paths, arch_source = read_arch(path, hub_kwargs)
    task = task_of(path, hub_kwargs)
    if arch is None and task is not None:
        experiment = EXPERIMENTS[task]
        arch, data_paths, arch_source = dict(experiment["arch"]), experiment["data_paths"], experiment["source"]
        logger.warning_once(
            f"{_where(path, hub_kwargs)} states no {CONFIG_YAML}: its settings are their published {task} "
            f"experiment's ({arch_source}), the weights deciding every size they show."
        )
    where = f"{_where(path, hub_kwargs)}/step_{step}"
    settings, grid, sources = resolve_settings(reference, arch, arch_source, data_paths, where)
    unknown = unknown_settings(settings)
    if unknown:
        logger.warning_once(
            f"{where}: {arch_source} sets {unknown}, which their FPRMConfig does not define (pydantic "
            f"ignores them, and so does this loader)."
        )
        settings = {k: v for k, v in settings.items() if k not in unknown}
    _, has_q_head = weight_settings(reference)
    config = build_config(
        settings, fixed_alphas_of(reference), use_q_head=has_q_head, grid=grid, recursion=recursion_of(reference)
    )
    config.dtype = str(next(iter(reference.values())).dtype).removeprefix("torch.")  # as stored (their fp32 EMA)
    sub = hub_kwargs.get("subfolder")
    config.authors_checkpoint = {
        "repo": os.fspath(path),
        "subfolder": sub or None,
        "step": step,
        "file": f"{sub}/step_{step}" if sub else f"step_{step}",
        "sources": sources,
    }
    logger.info(f"{where}: " + "; ".join(f"{k} from {v}" for k, v in sorted(sources.items())))
    return config, reference, step


# ---- entry points ------------------------------------------------------------------------------------------------


def authors_checkpoint_config_dict(path, kwargs):
    """(config dict, the kwargs that are not Hub options) of an authors' folder, as `get_config_dict` returns them
    (`FPRMConfig.config_loaders`), or None when `path` is not one."""
    hub_kwargs = _hub_kwargs(kwargs)
    if not is_authors_layout(path, hub_kwargs):
        return None
    config, _, _ = authors_checkpoint_config(path, hub_kwargs, kwargs.get("step"))
    config._name_or_path = os.fspath(path)  # as on the model `from_pretrained_authors` loads
    return config.to_dict(), {k: v for k, v in kwargs.items() if k not in LOCATING_KWARGS}


def from_pretrained_authors(cls, path, model_args, kwargs):
    """`cls.from_pretrained(path, ...)` for an authors' folder, or None when `path` is not one. transformers'
    `from_pretrained` then builds the model from the mapped state dict (dtype, device_map, the loading report)."""
    hub_kwargs = _hub_kwargs(kwargs)
    if not is_authors_layout(path, hub_kwargs):
        if isinstance(path, (str, os.PathLike)):
            refuse_root_or_step(path, hub_kwargs, kwargs.get("step"))
        return None
    from ..configuration_fprm import FPRMConfig
    from ..modeling_fprm import FPRMForReasoning

    if model_args:
        raise ValueError(f"positional model arguments {model_args!r} are not accepted for an authors' folder.")
    kwargs = {
        k: v
        for k, v in kwargs.items()
        if k not in HUB_KWARGS + ("trust_remote_code", "code_revision", "_from_auto", "adapter_kwargs")
    }
    step, config = kwargs.pop("step", None), kwargs.pop("config", None)
    if config is not None and not isinstance(config, FPRMConfig):
        raise ValueError(f"`config` must be an FPRMConfig for {PUBLISHED_REPO}'s layout, got {type(config).__name__}.")
    given_step = (getattr(config, "authors_checkpoint", None) or {}).get("step")
    if step is not None and given_step is not None and step != given_step:
        raise ValueError(f"step={step} was asked for, the config given was derived for step {given_step}.")
    derived, reference, step = authors_checkpoint_config(path, hub_kwargs, step if step is not None else given_step)
    if config is None:
        config = derived
    config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if hasattr(config, k) and k not in ("dtype",)}
    for key, value in config_kwargs.items():  # as transformers sets from_pretrained's config kwargs
        setattr(config, key, value)
    if config_kwargs:
        config.validate()
    state_dict, dropped = map_reference_state_dict(reference, config)
    logger.info(
        f"{_where(path, hub_kwargs)}/step_{step}: dropped {dropped[:4]}{' ...' if len(dropped) > 4 else ''} "
        f"(all-ones DropConnect masks and rotary caches, not used by the forward)"
    )
    loading = cls if issubclass(cls, FPRMForReasoning) else FPRMForReasoning
    # transformers' own `from_pretrained`, with `loading` as the class (past the hook that routed here)
    loaded = PreTrainedModel.from_pretrained.__func__(loading, None, config=config, state_dict=state_dict, **kwargs)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
    model.name_or_path = model.config._name_or_path = os.fspath(path)
    if loading is not cls:  # FPRMModel (AutoModel): the base model of the loaded reasoner
        model = model.model
    return (model, info) if info is not None else model


__all__ = [
    "PUBLISHED_REPO",
    "EXPERIMENTS",
    "resolve_settings",
    "authors_checkpoint_config",
    "is_authors_layout",
    "authors_checkpoint_config_dict",
    "from_pretrained_authors",
    "PublishedCheckpointError",
]
