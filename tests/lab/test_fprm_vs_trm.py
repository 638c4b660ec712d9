"""benchmarks/fprm_vs_trm.py: its verdicts are computed from the runs' results (each holds where it should, and fails
where it should), and the command analyses finished runs end to end (`--reuse`) without training again."""

import json

from benchmarks import fprm_vs_trm as bench


def sudoku_results(iterations, exact=0.9):
    rows = [{"mean_value": b, "mean_iterations": i} for b, i in zip((4, 6, 8, 10, 12), iterations)]
    return {"iterations_vs_num_blanks": rows, "halting": {"exact_accuracy": exact}}


def s5_results(in_distribution, extrapolated, length=16, train_length=4):
    acc = [in_distribution] * (2 * train_length - 1) + [extrapolated] * (length - 2 * train_length + 1)
    return {"per_prefix_accuracy": acc}


def test_sudoku_verdict():
    rising, flat = sudoku_results([10, 14, 20, 28, 40]), sudoku_results([72] * 5)
    assert bench.sudoku_verdict(rising, flat, 72)["holds"]
    assert not bench.sudoku_verdict(sudoku_results([20] * 5), flat, 72)["holds"]  # FPRM flat too
    assert not bench.sudoku_verdict(sudoku_results([40, 28, 20, 14, 10]), flat, 72)["holds"]  # falling
    below = sudoku_results([72, 72, 60, 72, 72])  # TRM short of its maximum somewhere
    verdict = bench.sudoku_verdict(rising, below, 72)
    assert not verdict["holds"] and not verdict["trm_flat_at_maximum"]
    assert bench.spearman([1, 2, 3], [2, 2, 2]) == 0.0 and bench.spearman([1, 2, 3], [1, 5, 9]) == 1.0


def test_extrapolation_verdict():
    L = 4
    assert bench.extrapolation_verdict(s5_results(1.0, 0.95), s5_results(1.0, 0.5), L)["holds"]
    assert not bench.extrapolation_verdict(s5_results(1.0, 0.6), s5_results(1.0, 0.3), L)["holds"]  # forgets
    assert not bench.extrapolation_verdict(s5_results(1.0, 0.95), s5_results(1.0, 0.93), L)["holds"]  # no margin
    verdict = bench.extrapolation_verdict(s5_results(0.8, 0.4), s5_results(0.8, 0.2), L)
    assert verdict["window"] == [8, 16] and abs(verdict["fprm_extrapolation"] - 0.4) < 1e-9
    # whether TRM learned the task in distribution is said beside the verdict
    assert bench.extrapolation_verdict(s5_results(1.0, 0.95), s5_results(1.0, 0.5), L)["trm_learned_in_distribution"]
    assert not bench.extrapolation_verdict(s5_results(1.0, 0.95), s5_results(0.2, 0.2), L)[
        "trm_learned_in_distribution"
    ]


def fake_run(folder, results, config=None):
    (folder / "model").mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"parameters": 1000, "train_steps": 5, **results}))
    (folder / "model" / "config.json").write_text(json.dumps(config or {}))


def test_command_analyses_finished_runs(tmp_path, capsys):
    trm_config = {"H_cycles": 2, "L_cycles": 2, "n_backwards_L": 2, "halt_max_steps": 2}  # 2 x 6 = 12
    for seed in (0, 1):
        fprm_iters = [5, 6, 8, 9, 12] if seed == 0 else [8, 8, 8, 8, 8]  # seed 1: FPRM does not adapt
        fake_run(tmp_path / f"sudoku-fprm-seed{seed}", sudoku_results(fprm_iters))
        fake_run(tmp_path / f"sudoku-trm-seed{seed}", sudoku_results([12] * 5), trm_config)
        fake_run(tmp_path / f"state-fprm-seed{seed}", s5_results(1.0, 0.95))
        fake_run(tmp_path / f"state-trm-seed{seed}", s5_results(1.0 if seed == 0 else 0.2, 0.2))
    result = bench.main(["--size", "tiny", "--reuse", "--output_dir", str(tmp_path)])
    assert result["per_seed"]["0"]["sudoku"]["holds"] and not result["per_seed"]["1"]["sudoku"]["holds"]
    assert result["verdicts"] == {"sudoku": "does not hold", "state": "holds"}  # every seed must hold
    assert result["per_seed"]["0"]["sudoku"]["trm_maximum"] == 12
    out = capsys.readouterr().out
    assert "sudoku: does not hold" in out and "state: holds" in out
    report = bench.report(result, result["command"])
    assert "**does not hold**" in report and "**holds**" in report
    assert "TRM did not learn S5 in distribution" in report and "for seed(s) 1:" in report
    assert bench.plot(result, str(tmp_path / "plot.png")) and (tmp_path / "plot.png").stat().st_size > 0
    # the runs it would train: FPRM and TRM presets of each task, for each seed, with the seed and folder
    runs = bench.run_commands("cpu", [0, 1], "out", 3.0)
    assert len(runs) == 8
    cmd = runs[("state", "trm", 1)][0]  # CPU: S3 on the s3-evidence recipe, made TRM by its flags
    assert cmd[cmd.index("--preset") + 1] == "s3-evidence" and cmd[cmd.index("--seed") + 1] == "1"
    assert cmd[cmd.index("--variant") + 1] == "trm" and "--variant" not in runs[("state", "fprm", 1)][0]
    # runs end by their step count, equal for both models and every seed
    for (task, _, _), (cmd, _) in runs.items():
        if task == "sudoku":
            assert cmd[cmd.index("--max_steps") + 1] == "500"


def test_trm_runs_are_trm_as_the_authors_run_it():
    """Both TRM runs of the CPU comparison, as `fprm.train` parses them: their arch/trm.yaml (RoPE, 16 prefix rows of
    the model's width, H 3 x L 6, 16 ACT steps, post-norm blocks without conv or α) and, on state tracking, causal
    attention (the task's) and their TRM optimizer values, with the FPRM recipe's width, batch, steps and lr."""
    from looped_training.fprm.tasks import build_task
    from looped_training.fprm.train import parse_args, variant_config

    runs = bench.run_commands("cpu", [0], "out", None)
    for task in ("sudoku", "state"):
        model, data, _, train = parse_args(runs[(task, "trm", 0)][0][3:])
        fprm_train = parse_args(runs[(task, "fprm", 0)][0][3:])[3]
        config = variant_config(model)
        assert config["recursion"] == "trm" and (config["H_cycles"], config["L_cycles"], config["n_backwards_L"]) == (
            3,
            6,
            6,
        )
        assert (config["halt_max_steps"], config["halt_exploration_prob"], config["conv_type"]) == (16, 0.1, "none")
        assert (config["position_embedding_type"], config["num_prefix_tokens"]) == ("rope", 16)
        assert model.puzzle_emb_ndim == model.hidden_size == 64
        assert (model.norm_type, model.residual_scaling) == ("post", "none")
        assert (train.puzzle_emb_optimizer, train.q_loss_coefficient) == ("signsgd", 0.5)
        for same in ("max_steps", "per_device_train_batch_size", "learning_rate", "seed"):
            assert getattr(train, same) == getattr(fprm_train, same), same
    # state tracking: causal attention, the task's (their arch.causal), and their TRM file's weight decays
    assert data.task == "s3" and build_task(data, 0)[1]["causal"] is True
    assert (train.weight_decay, train.puzzle_emb_lr, train.puzzle_emb_weight_decay) == (0.1, 0.01, 0.1)


def test_runs_train_longest_first_each_with_its_log(tmp_path, capsys):
    import sys

    runs = {
        (task, variant, 0): ([sys.executable, "-c", f"print('{task} {variant}')"], str(tmp_path / f"{task}-{variant}"))
        for task in ("sudoku", "state")
        for variant in ("fprm", "trm")
    }
    bench.train_all(runs, 1, reuse=False)
    started = [line.split("print(")[1] for line in capsys.readouterr().out.splitlines() if "$ " in line]
    assert started == ["'state trm')", "'state fprm')", "'sudoku trm')", "'sudoku fprm')"]
    assert (tmp_path / "state-trm.log").read_text() == "state trm\n"
