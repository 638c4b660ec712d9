"""The paper's comparison of FPRM with TRM, from our own runs, with the same block stack (width, heads, SwiGLU and
layers; FPRM adds its conv and α logits, TRM its learned prefix row, H_init/L_init and Q-head), trained by the same
command (`python -m looped_training.fprm.train`) on the same data and seeds, TRM as the authors run it (their
config/arch/trm.yaml: RoPE, 16 prefix rows of the model's width, causal attention on state tracking, H 3 x L 6, 16 ACT
steps; presets *-cpu-trm):

(a) Sudoku (4x4, 4..12 blanks): FPRM's iterations to halt rise with the blanks, while TRM's stay flat at its
    maximum (halt_max_steps ACT steps of the block stack);
(b) length extrapolation in state tracking: trained on lengths <= L, tested on 2L..4L (the per-prefix accuracy at
    positions k = 2L..4L). The paper's size runs S5 (L 32); the CPU size runs S3 (L 16, the s3-evidence recipe),
    since S5 does not learn in a CPU budget (benchmarks/writeups/fprm.md).

    nice python -m benchmarks.fprm_vs_trm --jobs 4             # CPU-sized: 2 seeds, 8 runs (a TRM S3 run: ~95 min)
    python -m benchmarks.fprm_vs_trm --size paper --jobs 1    # the paper's size (presets sudoku / sudoku-trm, s5 /
                                                              # s5-trm: d 512, 9x9 Sudoku, S5 at 32 -> 128), GPU

Each run is a `looped_training.fprm.train` command (printed, one thread each, `--jobs` in parallel). The verdicts
are computed from the runs' results.json files, for every seed and over all of them, printed and written to
benchmarks/results/fprm_vs_trm.json, with the plot benchmarks/writeups/plots/fprm_vs_trm.png and the report
benchmarks/writeups/fprm_vs_trm.md. `--reuse` re-analyses finished runs in `--output_dir`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "fprm_vs_trm.json")
PLOT = os.path.join(ROOT, "benchmarks", "writeups", "plots", "fprm_vs_trm.png")
REPORT = os.path.join(ROOT, "benchmarks", "writeups", "fprm_vs_trm.md")

# (a): FPRM's mean iterations per blanks bin rise (Spearman over the bins, and the hardest bin against the easiest);
# TRM spends its maximum on every bin
RISE = {"spearman_rho": 0.8, "relative_rise": 0.1}
# (b): FPRM keeps >= 0.9 of its in-distribution accuracy at 2L..4L, and beats TRM there by >= 0.05
EXTRAPOLATION = {"kept_fraction": 0.9, "margin_over_trm": 0.05}
LEARNED = 0.9  # in-distribution per-position accuracy at which a model counts as having learned the task

# TRM as the authors run it (their config/arch/trm.yaml and cfg_pretrain_state_tracking.yaml), on a preset of
# FPRM's (the S3 recipe, which has no TRM preset): these values of preset s5-cpu-trm, which holds theirs (rope, 16
# prefix rows of the model's width, post-norm blocks without conv or α, H 3 x L 6, 16 ACT steps, the Q-halt loss,
# weight decay 0.1 and the SignSGD prefix rows at lr 1e-2, weight decay 0.1), with the model's width as
# puzzle_emb_ndim. The rest is the FPRM recipe's, as for FPRM: the data, width, batch, steps and learning rate (their
# TRM and FPRM state-tracking files both train at lr 1e-4), and causal attention (the task's, their arch.causal).
TRM_PRESET = "s5-cpu-trm"
TRM_KEYS = (
    "variant",
    "position_embedding_type",
    "num_prefix_tokens",
    "norm_type",
    "norm_placement",
    "residual_scaling",
    "conv_type",
    "H_cycles",
    "L_cycles",
    "n_backwards_L",
    "halt_max_steps",
    "halt_exploration_prob",
    "q_loss_coefficient",
    "weight_decay",
    "puzzle_emb_optimizer",
    "puzzle_emb_lr",
    "puzzle_emb_weight_decay",
)


def trm_flags(hidden_size):
    """The flags that make TRM, as the authors run it, out of an FPRM state-tracking preset of width `hidden_size`."""
    import yaml
    from looped_training.configs import config_path

    with open(config_path("fprm", TRM_PRESET)) as f:
        preset = yaml.safe_load(f)
    values = {key: preset[key] for key in TRM_KEYS} | {"puzzle_emb_ndim": hidden_size}
    return " ".join(f"--{key} {value}" for key, value in values.items())


TRM_FLAGS = trm_flags(64)  # the width of preset s3-evidence

SIZES = {
    # CPU: 4x4 Sudoku, d 64, 500 optimizer steps; state tracking on S3 (the s3-evidence recipe: trained at <= 16,
    # tested to 64, 3000 steps; S5 does not learn in a CPU budget, benchmarks/writeups/fprm.md). Runs end by their
    # step count, so that seeds sharing the CPU get the same training; the time budget is only a safety cap.
    "cpu": {
        "sudoku": (
            "--preset sudoku-cpu",
            "--preset sudoku-cpu-trm",
            "--sudoku_size 4 --hidden_size 64 --puzzle_emb_ndim 64 --num_train 6000 --num_test 300 "
            "--compare_cap false --eval_batch_size 300 --max_steps 500 --time_budget_minutes 90",
        ),
        "state": (
            "--preset s3-evidence",
            "--preset s3-evidence " + TRM_FLAGS,
            "--compare_cap false --time_budget_minutes 150",
        ),
        "group": "S3",
        "train_length": 16,
    },
    "paper": {
        "sudoku": ("--preset sudoku", "--preset sudoku-trm", "--compare_cap false"),
        "state": ("--preset s5", "--preset s5-trm", "--compare_cap false"),
        "group": "S5",
        "train_length": 32,
    },
    # the test's size: a few steps, to run the machinery (tests/lab/test_fprm_vs_trm.py)
    "tiny": {
        "sudoku": (
            "--preset sudoku-cpu",
            "--preset sudoku-cpu-trm",
            "--sudoku_size 4 --hidden_size 16 --num_attention_heads 2 --intermediate_size 32 --puzzle_emb_ndim 16 "
            "--num_train 64 --num_test 24 --per_device_train_batch_size 16 --max_steps 2 --eval_max_loops 12 "
            "--max_segments 2 --halt_max_steps 2 --compare_cap false",
        ),
        "state": (
            "--preset s5-cpu",
            "--preset s5-cpu-trm",
            "--train_length 4 --test_length 16 --hidden_size 16 --num_attention_heads 2 --intermediate_size 32 "
            "--num_train 64 --num_test 16 --per_device_train_batch_size 16 --max_steps 2 --eval_max_loops 12 "
            "--max_segments 2 --halt_max_steps 2 --compare_cap false",
        ),
        "group": "S5",
        "train_length": 4,
    },
}


def spearman(x, y):
    """Spearman's ρ (average ranks for ties); 0 when either side is constant."""
    import numpy as np

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort()
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties share their mean rank
            r[v == value] = r[v == value].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def max_iterations(model_dir):
    """TRM's iterations per evaluation (block-stack applications): halt_max_steps × per ACT step."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    per_step = (c["H_cycles"] - 1) * (c["L_cycles"] + 1) + (c.get("n_backwards_L") or c["L_cycles"]) + 1
    return c["halt_max_steps"] * per_step


def sudoku_verdict(fprm, trm, trm_max):
    """(a) for one seed, from the two runs' results.json: FPRM's iterations per blanks bin rise, TRM's equal its
    maximum on every bin."""
    rows = fprm["iterations_vs_num_blanks"]
    blanks = [r["mean_value"] for r in rows]
    iters = [r["mean_iterations"] for r in rows]
    rho = spearman(blanks, iters)
    rise = iters[-1] / iters[0] - 1 if iters[0] > 0 else 0.0
    trm_rows = trm["iterations_vs_num_blanks"]
    flat = all(abs(r["mean_iterations"] - trm_max) < 1e-9 for r in trm_rows)
    holds = rho >= RISE["spearman_rho"] and rise >= RISE["relative_rise"] and flat
    return {
        "fprm_blanks": blanks,
        "fprm_iterations": iters,
        "fprm_spearman_rho": rho,
        "fprm_relative_rise": rise,
        "trm_iterations": [r["mean_iterations"] for r in trm_rows],
        "trm_maximum": trm_max,
        "trm_flat_at_maximum": flat,
        "fprm_exact_accuracy": fprm["halting"]["exact_accuracy"],
        "trm_exact_accuracy": trm["halting"]["exact_accuracy"],
        "holds": bool(holds),
    }


def extrapolation_verdict(fprm, trm, train_length):
    """(b) for one seed: per-prefix accuracy in distribution (k <= L) and at k = 2L..4L, FPRM against TRM."""
    L = train_length

    def window(acc, lo, hi):
        part = acc[lo - 1 : hi]
        return sum(part) / len(part)

    out = {}
    for name, r in (("fprm", fprm), ("trm", trm)):
        acc = r["per_prefix_accuracy"]
        hi = min(4 * L, len(acc))
        out[f"{name}_in_distribution"] = window(acc, 1, L)
        out[f"{name}_extrapolation"] = window(acc, 2 * L, hi)
    kept = out["fprm_extrapolation"] >= EXTRAPOLATION["kept_fraction"] * out["fprm_in_distribution"]
    margin = out["fprm_extrapolation"] - out["trm_extrapolation"]
    out.update(
        # said beside the verdict: a TRM that did not learn the task in distribution fails at 2L..4L for that reason
        trm_learned_in_distribution=bool(out["trm_in_distribution"] >= LEARNED),
        margin_over_trm=margin,
        window=[2 * L, min(4 * L, len(fprm["per_prefix_accuracy"]))],
        holds=bool(kept and margin >= EXTRAPOLATION["margin_over_trm"]),
    )
    return out


def run_commands(size, seeds, output_dir, minutes):
    """{(task, variant, seed): (command, run folder)}."""
    spec = SIZES[size]
    runs = {}
    for seed in seeds:
        for task in ("sudoku", "state"):
            fprm_flags, trm_flags, extra = spec[task]
            for variant, flags in (("fprm", fprm_flags), ("trm", trm_flags)):
                folder = os.path.join(output_dir, f"{task}-{variant}-seed{seed}")
                cmd = [sys.executable, "-m", "looped_training.fprm.train", *flags.split(), *extra.split()]
                cmd += ["--seed", str(seed), "--output_dir", folder, "--overwrite_output_dir", "true"]
                if minutes is not None:
                    cmd += ["--time_budget_minutes", str(minutes)]
                if size != "paper":
                    cmd += ["--torch_threads", "1"]
                runs[(task, variant, seed)] = (cmd, folder)
    return runs


def train_all(runs, jobs, reuse):
    """Train the runs, `jobs` at a time, the longest first (state tracking before Sudoku, TRM before FPRM), each
    writing its output to `<its folder>.log`."""

    def one(item):
        (task, variant, seed), (cmd, folder) = item
        if reuse and os.path.exists(os.path.join(folder, "results.json")):
            return
        print(f"{time.strftime('%H:%M:%S')} $ " + " ".join(cmd[1:]), flush=True)
        start = time.perf_counter()
        os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
        with open(f"{folder}.log", "w") as log:
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RuntimeError(f"{task} {variant} seed {seed} failed: see {folder}.log")
        print(f"  {task} {variant} seed {seed}: {time.perf_counter() - start:.0f}s", flush=True)

    longest_first = sorted(runs.items(), key=lambda item: (item[0][0] != "state", item[0][1] != "trm", item[0][2]))
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, longest_first))


def analyse(runs, seeds, train_length, group):
    def load(key):
        with open(os.path.join(runs[key][1], "results.json")) as f:
            return json.load(f)

    per_seed = {}
    for seed in seeds:
        s_f, s_t = load(("sudoku", "fprm", seed)), load(("sudoku", "trm", seed))
        e_f, e_t = load(("state", "fprm", seed)), load(("state", "trm", seed))
        trm_max = max_iterations(os.path.join(runs[("sudoku", "trm", seed)][1], "model"))
        per_seed[str(seed)] = {
            "sudoku": sudoku_verdict(s_f, s_t, trm_max),
            "state": extrapolation_verdict(e_f, e_t, train_length),
            "parameters": {
                "sudoku": {"fprm": s_f["parameters"], "trm": s_t["parameters"]},
                "state": {"fprm": e_f["parameters"], "trm": e_t["parameters"]},
            },
            "train_steps": {
                "sudoku": {"fprm": s_f["train_steps"], "trm": s_t["train_steps"]},
                "state": {"fprm": e_f["train_steps"], "trm": e_t["train_steps"]},
            },
            "per_prefix_accuracy": {"fprm": e_f["per_prefix_accuracy"], "trm": e_t["per_prefix_accuracy"]},
        }
    verdicts = {
        task: "holds" if all(per_seed[str(s)][task]["holds"] for s in seeds) else "does not hold"
        for task in ("sudoku", "state")
    }
    return {
        "seeds": list(seeds),
        "group": group,
        "train_length": train_length,
        "per_seed": per_seed,
        "verdicts": verdicts,
    }


def plot(result, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    L = result["train_length"]
    for seed, r in result["per_seed"].items():
        s = r["sudoku"]
        a.plot(s["fprm_blanks"], s["fprm_iterations"], "o-", color="C0", label=f"FPRM seed {seed}")
        a.plot(s["fprm_blanks"], s["trm_iterations"], "s--", color="C3", label=f"TRM seed {seed}")
        for name, color in (("fprm", "C0"), ("trm", "C3")):
            acc = r["per_prefix_accuracy"][name]
            b.plot(range(1, len(acc) + 1), acc, color=color, alpha=0.8, label=f"{name.upper()} seed {seed}")
    a.set(xlabel="blanks (bin mean)", ylabel="iterations to halt (block-stack applications)", title="(a) Sudoku")
    b.axvspan(2 * L, 4 * L, color="grey", alpha=0.15, label=f"test window {2 * L}..{4 * L}")
    b.axvline(L, color="grey", linestyle="--")
    b.set(
        xlabel="prefix length k",
        ylabel="accuracy at position k",
        ylim=(0, 1.02),
        title=f"(b) {result['group']}, trained k <= {L}",
    )
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(result, command):
    lines = [
        "# FPRM against TRM, from our own runs",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}; seeds {result['seeds']}).",
        "",
        f"(a) Sudoku, FPRM's iterations rise with the blanks while TRM stays flat at its maximum: "
        f"**{result['verdicts']['sudoku']}**. (b) {result['group']}, trained on lengths <= {result['train_length']}, FPRM "
        f"extrapolates to {2 * result['train_length']}..{4 * result['train_length']} (keeps >= "
        f"{EXTRAPOLATION['kept_fraction']} of its in-distribution accuracy, beats TRM by >= "
        f"{EXTRAPOLATION['margin_over_trm']}): **{result['verdicts']['state']}**; beside it, whether TRM learned "
        f"{result['group']} in distribution (per-position accuracy over 1..L >= {LEARNED}): "
        + ", ".join(
            f"seed {seed} {'yes' if r['state']['trm_learned_in_distribution'] else 'no'} "
            f"({r['state']['trm_in_distribution']:.3f})"
            for seed, r in result["per_seed"].items()
        )
        + ".",
        "",
        f"The runs: `python -m looped_training.fprm.train` with {' / '.join(f'`{f}`' for f in SIZES[result['size']]['sudoku'][:2])}"
        f" (Sudoku) and {' / '.join(f'`{f}`' for f in SIZES[result['size']]['state'][:2])} (state tracking), then "
        f"`{SIZES[result['size']]['sudoku'][2]}` and `{SIZES[result['size']]['state'][2]}` and the seed: TRM as the "
        "authors run it (their config/arch/trm.yaml), FPRM as its preset.",
        "",
        "| seed | params FPRM / TRM | Sudoku exact FPRM / TRM | FPRM iterations by blanks bin | ρ | TRM iterations |"
        f" {result['group']} in-dist FPRM / TRM | {result['group']} at 2L..4L FPRM / TRM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, r in result["per_seed"].items():
        s, e, p = r["sudoku"], r["state"], r["parameters"]["sudoku"]
        lines.append(
            f"| {seed} | {p['fprm']:,} / {p['trm']:,} | {s['fprm_exact_accuracy']:.3f} / {s['trm_exact_accuracy']:.3f}"
            f" | {', '.join(f'{v:.1f}' for v in s['fprm_iterations'])} | {s['fprm_spearman_rho']:.2f} | "
            f"{', '.join(f'{v:.0f}' for v in s['trm_iterations'])} | {e['fprm_in_distribution']:.3f} / "
            f"{e['trm_in_distribution']:.3f} | {e['fprm_extrapolation']:.3f} / {e['trm_extrapolation']:.3f} |"
        )
    unlearned = [seed for seed, r in result["per_seed"].items() if not r["state"]["trm_learned_in_distribution"]]
    if unlearned:
        lines += [
            "",
            f"TRM did not learn {result['group']} in distribution (per-position accuracy over 1..L below {LEARNED}) "
            f"for seed(s) {', '.join(unlearned)}: there (b) compares a model that extrapolates with one that did not "
            "learn the task, not with one that learned it and failed to extrapolate.",
        ]
    lines += ["", "![FPRM against TRM](plots/fprm_vs_trm.png)", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="a training time budget per run, on top of the size's step counts (default: the size's safety cap)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--output_dir", default="outputs/fprm-vs-trm")
    p.add_argument("--reuse", action="store_true", help="keep finished runs in --output_dir")
    p.add_argument("--no_write", action="store_true", help="print the verdicts only (always so for --size tiny)")
    args = p.parse_args(argv)
    if len(set(args.seeds)) < 1 or args.jobs < 1:
        p.error(f"--seeds needs at least one seed and --jobs >= 1, got {args.seeds} and {args.jobs}.")
    minutes = args.minutes
    runs = run_commands(args.size, args.seeds, args.output_dir, minutes)
    train_all(runs, args.jobs, args.reuse)
    result = analyse(runs, args.seeds, SIZES[args.size]["train_length"], SIZES[args.size]["group"])
    command = "python -m benchmarks.fprm_vs_trm " + " ".join(argv if argv is not None else sys.argv[1:])
    result.update(size=args.size, command=command.strip(), minutes_per_run=minutes)
    for task, verdict in result["verdicts"].items():
        print(f"{task}: {verdict}")
    if not args.no_write and args.size != "tiny":
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, PLOT)
        with open(REPORT, "w") as f:
            f.write(report(result, result["command"]))
        print(f"wrote {RESULTS}, {PLOT} and {REPORT}")
    return result


if __name__ == "__main__":
    main()
