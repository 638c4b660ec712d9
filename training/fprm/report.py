"""The FPRM evaluation's results read for people: the printed report and the PNG plots (training loss, iterations
to halt against difficulty, length generalisation). Both `python -m looped_training.fprm.train` and `python -m
looped_training.fprm.evaluate` end with them."""

import os


def print_report(results, train_seconds):
    h = results["halting"]
    name = "TRM" if results.get("recursion") == "trm" else "FPRM"
    print(f"\n== {name} evaluation (trained {train_seconds / 60:.1f} min) ==")
    print(
        f"halting  (halt_eps):  cell acc {h['cell_accuracy']:.4f}  exact acc {h['exact_accuracy']:.4f}  "
        f"mean iterations {h['mean_iterations']:.1f}  converged {h['converged_fraction']:.2%}  {h['seconds']:.1f}s"
        f"  ({h.get('batching', 'sample')} batching)"
    )
    if "always_cap" in results:
        c, r = results["always_cap"], results["halting_vs_cap"]
        print(
            f"always the cap:       cell acc {c['cell_accuracy']:.4f}  exact acc {c['exact_accuracy']:.4f}  "
            f"mean iterations {c['mean_iterations']:.1f}  {c['seconds']:.1f}s"
        )
        print(f"halting / cap: iterations {r['iteration_ratio']:.3f}  wall-clock {r['wall_clock_ratio']:.3f}")
    for key, rows in results.items():
        if key.startswith("iterations_vs_") and rows:
            print(f"{key}:")
            for row in rows:
                label = row["length"] if "length" in row else f"[{row['low']:g}, {row['high']:g})"
                extra = f"  exact {row['exact_accuracy']:.3f}  n={row['count']}" if "count" in row else ""
                print(f"  {label!s:>14}  mean iterations {row['mean_iterations']:.1f}{extra}")
    if "accuracy_vs_iterations" in results:
        c = results["accuracy_vs_iterations"]
        gamma = f", γ = {c['gamma']:g}" if c.get("gamma") is not None else ""
        print(f"halting off (τ = {c['halt_eps']:g}{gamma}):")
        for j, n in enumerate(c["iterations"]):
            print(
                f"  {n:>5} iterations  cell acc {c['cell_accuracy'][j]:.4f}  exact acc {c['exact_accuracy'][j]:.4f}  "
                f"converged {c['converged_fraction'][j]:.2%}  median residual {c['median_residual'][j]:.3g}"
            )
    if "length_generalisation" in results:
        lg = results["length_generalisation"]
        shown = [k for k in (2, 8, 16, 32, 64, 96, 128) if k <= len(lg["ks"])]
        print(
            "length generalisation (accuracy over positions 1..k / sequence accuracy at k): "
            + "  ".join(f"k={k}: {lg['accuracy'][k - 1]:.3f}/{lg['sequence_accuracy'][k - 1]:.3f}" for k in shown)
        )
    if "accuracy_at_length" in results:
        print(
            f"per-prefix accuracy (trained on lengths <= {results.get('max_train_length')}): "
            + "  ".join(f"k={k}: {v:.4f}" for k, v in results["accuracy_at_length"].items())
        )
    if "arc_pass_at_2" in results:
        a = results["arc_pass_at_2"]
        print(f"ARC pass@2 (vote over augmentations): {a['score']:.3f} on {a['test_inputs']} test inputs")


def write_plots(results, log_history, output_dir):
    try:
        import matplotlib
    except ImportError:
        print(
            "matplotlib is not installed: no plots (pip install matplotlib, or `pip install '.[train]'` in a checkout)"
        )
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    losses = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    if losses:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(*zip(*losses))
        ax.set(xlabel="segment (optimizer step)", ylabel="training loss", title="FPRM training")
        paths.append(_save(fig, output_dir, "training_loss.png"))
    for key, rows in results.items():
        if key.startswith("iterations_vs_") and rows:
            x = [r.get("length", r.get("mean_value")) for r in rows]
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.plot(x, [r["mean_iterations"] for r in rows], marker="o")
            ax.set(
                xlabel=key.replace("iterations_vs_", ""),
                ylabel="mean iterations to halt",
                title=f"Iterations to halt vs {key.replace('iterations_vs_', '')}",
            )
            paths.append(_save(fig, output_dir, f"{key}.png"))
    if "length_generalisation" in results:
        lg = results["length_generalisation"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(lg["ks"], lg["accuracy"], label="accuracy over positions 1..k")
        ax.plot(lg["ks"], lg["sequence_accuracy"], label="sequence accuracy at k")
        ax.axvline(results["max_train_length"], color="grey", linestyle="--", label="longest training length")
        ax.set(xlabel="k", ylabel="accuracy", ylim=(0, 1.02), title="Length generalisation (authors' metric)")
        ax.legend()
        paths.append(_save(fig, output_dir, "length_generalisation.png"))
    if "per_prefix_accuracy" in results:
        acc = results["per_prefix_accuracy"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(range(1, len(acc) + 1), acc)
        ax.axvline(results["max_train_length"], color="grey", linestyle="--", label="longest training length")
        ax.set(xlabel="prefix length k", ylabel="accuracy", ylim=(0, 1.02), title="Length generalisation")
        ax.legend()
        paths.append(_save(fig, output_dir, "per_prefix_accuracy.png"))
    return paths


def _save(fig, output_dir, name):
    path = os.path.join(output_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
