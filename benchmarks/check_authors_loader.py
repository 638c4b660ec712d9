"""Their own loader against ours, on the same folder in their Hub layout (a check run by hand: it needs their code).

The folder is written by their code: their `GPT` (models/<type>.py of a clone of github.com/armenjeddi/loopformer)
inside a minimal transformers wrapper (`self.gpt = GPT(...)`, remote code, the head tied to `transformer.wte`),
saved with `save_pretrained`, so the weights are named `gpt.transformer.…` and the tied head is stored once, as on
the Hub. Random weights (every parameter drawn, the adaLN modulation included, so that t, Δ and the trajectory
change the logits). Then, per model type and trajectory:

- theirs: their `GPT.from_pretrained(folder)` (path (B): AutoConfig/AutoModelForCausalLM with trust_remote_code,
  prefixes stripped, the tie restored, a strict load into their GPT), in a process that does not import this package;
- ours: `AutoModelForCausalLM.from_pretrained(folder)` after `import loopformer_hf` (no remote code), in another;

and prints max |logit difference| over all positions (fp32). Each model type is written twice: with the wrapper's
defaults those of their GPTConfig (config.json states the sizes), and as published, with the repo's own sizes and
trajectory as the wrapper's defaults, so that save_pretrained writes a config.json that states none of them. Their code is copied into the temporary folder as the
wrapper's remote code, never into this project, and nothing is fetched:

    git clone https://github.com/armenjeddi/loopformer /tmp/authors_loopformer
    python -m benchmarks.check_authors_loader --authors_repo /tmp/authors_loopformer
"""

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

# (model type on the Hub, their model file, trajectories: step sizes for LoopFormer, loop counts for the others)
CASES = [
    ("loopformer", "loopformer", [[0.25] * 4, [0.5, 0.25, 0.25], [0.5, 0.5]]),
    ("base_loop", "base_loop", [4, 3, 2]),
    ("base_loop_ee", "base_loop", [4, 3, 2]),
]
SHAPE = dict(
    block_size=64, vocab_size=101, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False, intermediate_dim=192
)

WRAPPER_CONFIG = """
from transformers import PretrainedConfig


class AuthorsConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, {defaults}, **kwargs):
        self.block_size, self.vocab_size, self.n_layer, self.n_head = block_size, vocab_size, n_layer, n_head
        self.n_embd, self.dropout, self.bias, self.intermediate_dim = n_embd, dropout, bias, intermediate_dim
        self.steps = steps
        super().__init__(**kwargs)
"""
WRAPPER_MODEL = """
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .authors_gpt import GPT, GPTConfig
from .configuration_authors import AuthorsConfig


class AuthorsForCausalLM(PreTrainedModel):
    config_class = AuthorsConfig
    _tied_weights_keys = {"gpt.lm_head.weight": "gpt.transformer.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(GPTConfig(model_type=config.model_type, block_size=config.block_size,
                                 vocab_size=config.vocab_size, n_layer=config.n_layer, n_head=config.n_head,
                                 n_embd=config.n_embd, dropout=config.dropout, bias=config.bias,
                                 intermediate_dim=config.intermediate_dim))
        self.post_init()

    def _init_weights(self, module):
        pass  # their GPT initialises itself

    def forward(self, input_ids, **kwargs):
        _, _, x = self.gpt(input_ids, steps=self.config.steps)
        return CausalLMOutput(logits=self.gpt.lm_head(x))
"""

# Both sides write {trajectory: logits} with torch.save; `{repo}` etc. are filled in below.
THEIRS = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("authors_model", {model_file!r})
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
gpt = module.GPT.from_pretrained({repo!r})
ids = torch.load({ids!r})
out = {{}}
with torch.no_grad():
    for steps in {trajectories!r}:
        _, _, x = gpt(ids, steps=steps)
        out[str(steps)] = gpt.lm_head(x).float()
torch.save(out, {out!r})
"""
OURS = """
import torch
import loopformer_hf
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({repo!r})
assert type(model).__module__.startswith("loopformer_hf"), type(model)
ids = torch.load({ids!r})
out = {{}}
with torch.no_grad():
    for steps in {trajectories!r}:
        schedule = steps if isinstance(steps, list) else [1 / steps] * steps
        out[str(steps)] = model(ids, step_schedule=schedule).logits.float()
torch.save(out, {out!r})
"""


# the wrapper's defaults: their GPTConfig's (the sizes then come from config.json), or, as published, the repo's own
# sizes and trajectory (their transformers 4.57 wrote only what differs from them: a config.json without a size)
GITHUB_DEFAULTS = dict(
    block_size=1024,
    vocab_size=50304,
    n_layer=3,
    n_head=32,
    n_embd=2048,
    dropout=0.0,
    bias=False,
    intermediate_dim=None,
    steps=None,
)


def write_their_repo(authors_repo, model_type, model_file, folder, seed=0, published=False):
    """The Hub layout, written by their GPT inside the wrapper (their code copied in as its remote code)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(folder)
    shutil.copyfile(os.path.join(authors_repo, "models", f"{model_file}.py"), os.path.join(folder, "authors_gpt.py"))
    steps = [0.25] * 4 if model_type == "loopformer" else 4
    defaults = dict(SHAPE, steps=steps) if published else GITHUB_DEFAULTS
    with open(os.path.join(folder, "configuration_authors.py"), "w") as handle:
        handle.write(
            WRAPPER_CONFIG.format(model_type=model_type, defaults=", ".join(f"{k}={v!r}" for k, v in defaults.items()))
        )
    with open(os.path.join(folder, "modeling_authors.py"), "w") as handle:
        handle.write(WRAPPER_MODEL)
    config = dict(
        SHAPE,
        model_type=model_type,
        steps=steps,
        tie_word_embeddings=True,
        auto_map={
            "AutoConfig": "configuration_authors.AuthorsConfig",
            "AutoModelForCausalLM": "modeling_authors.AuthorsForCausalLM",
        },
    )
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    if published:  # transformers 4.57 (theirs) saves only what differs from the class defaults; 5.x saves them all.
        # tie_word_embeddings stays: 4.57's default (True) left it out, this transformers' wrapper load needs it
        with open(os.path.join(folder, "config.json")) as handle:
            saved = json.load(handle)
        with open(os.path.join(folder, "config.json"), "w") as handle:
            json.dump(
                {
                    k: saved[k]
                    for k in (
                        "architectures",
                        "auto_map",
                        "dtype",
                        "model_type",
                        "transformers_version",
                        "tie_word_embeddings",
                    )
                    if k in saved
                },
                handle,
            )
    return model


def run(code, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.check_authors_loader", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--authors_repo", required=True, help="a clone of github.com/armenjeddi/loopformer")
    args = parser.parse_args(argv)
    import torch
    from safetensors import safe_open

    rows = []
    with tempfile.TemporaryDirectory() as work:
        ids = os.path.join(work, "ids.pt")
        torch.save(torch.randint(0, SHAPE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0)), ids)
        for (model_type, model_file, trajectories), published in itertools.product(CASES, (False, True)):
            repo = os.path.join(work, model_type + ("_published" if published else ""))
            write_their_repo(os.path.abspath(args.authors_repo), model_type, model_file, repo, published=published)
            with open(os.path.join(repo, "config.json")) as handle:
                stated = sorted(json.load(handle))
            with safe_open(os.path.join(repo, "model.safetensors"), "pt") as handle:
                names = sorted(handle.keys())
            outs = {side: os.path.join(work, f"{model_type}_{side}.pt") for side in ("theirs", "ours")}
            fill = dict(repo=repo, ids=ids, trajectories=trajectories)
            model_path = os.path.join(os.path.abspath(args.authors_repo), "models", f"{model_file}.py")
            run(textwrap.dedent(THEIRS.format(model_file=model_path, out=outs["theirs"], **fill)))
            run(textwrap.dedent(OURS.format(out=outs["ours"], **fill)))
            theirs, ours = torch.load(outs["theirs"]), torch.load(outs["ours"])
            for key in theirs:
                diff = (theirs[key] - ours[key]).abs().max().item()
                rows.append((model_type, "no sizes" if published else "sizes", key, diff))
            print(
                f"{model_type}: {len(names)} tensors saved, e.g. {names[0]}; head stored: "
                f"{any(n.endswith('lm_head.weight') for n in names)}; config.json keys: {stated}",
                flush=True,
            )
    print(
        "| model type | config.json states | trajectory | max abs logit difference, their GPT.from_pretrained vs "
        "ours |"
    )
    print("|---|---|---|---|")
    for model_type, stated, key, diff in rows:
        print(f"| {model_type} | {stated} | {key} | {diff:.2e} |")
    return 0 if all(row[-1] < 1e-4 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
