"""The LoRA tool keeps what a user saved (an --output that is a file, or that holds an earlier
fine-tuning, is refused before any work), takes an FPRM training run's folder as --model, and fits its default
block to a LoopFormer's context."""

import json
import re

import pytest

from support.hub_helpers import CORPUS, fprm_task_rows, make_fprm, save_checkpoint

from looped_training.finetune_lora import main as finetune_main


def test_an_output_that_is_a_file_is_refused_before_loading_anything(tmp_path, capsys):
    # a raw FileExistsError, after the training
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        finetune_main(
            [
                "--model",
                str(tmp_path / "no-such-model"),
                "--train_files",
                str(tmp_path / "no.txt"),
                "--output",
                str(taken),
            ]
        )
    assert exit_info.value.code == 2
    assert re.search(r"error: --output .*taken is a file, not a folder", capsys.readouterr().err)
    assert taken.read_text() == "keep me"


def test_a_rerun_into_an_earlier_fine_tunings_output_is_refused_and_keeps_it(tmp_path, capsys):
    # a rerun without --merge replaced adapter/ and left the old merged/ beside it, as if it were the new one's
    save_checkpoint(tmp_path / "base", seed=0, max_position_embeddings=64)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(CORPUS * 4))
    argv = [
        "--model",
        str(tmp_path / "base"),
        "--train_files",
        str(text),
        "--output",
        str(tmp_path / "out"),
        "--batch_size",
        "2",
        "--max_steps",
        "1",
    ]
    finetune_main([*argv, "--merge"])  # no --block_size: the model's context of 64, not 128
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        finetune_main(argv)
    assert exit_info.value.code == 2
    assert re.search(
        r"error: --output .*out already holds adapter/ and merged/ of an earlier fine-tuning.*give a "
        r"new --output",
        capsys.readouterr().err,
    )
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before


def test_fprm_lora_takes_a_training_runs_folder(tmp_path):
    # "Unrecognized model": the FPRM trainer saves its model in run/model/
    make_fprm(seed=0).save_pretrained(tmp_path / "run" / "model")
    (tmp_path / "run" / "results.json").write_text("{}")
    data = tmp_path / "task.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in fprm_task_rows()))
    summary = finetune_main(
        [
            "--model",
            str(tmp_path / "run"),
            "--task_data",
            str(data),
            "--output",
            str(tmp_path / "out"),
            "--batch_size",
            "8",
            "--max_steps",
            "1",
            "--max_loops",
            "3",
        ]
    )
    assert summary["steps"] == 1 and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_on_a_repo_in_the_authors_layout_trains_with_its_defaults(tmp_path):
    # AutoConfig said a 1024-token context (their GitHub default) for a 64-token model: --block_size 128 stopped
    # the run at step 0 (issue 55). The defaults now come from the model that loads.
    from support.hub_helpers import make_tokenizer
    from support.reference_oracle import BLOCK, write_authors_repo

    write_authors_repo(tmp_path / "repo", stated=(), n_head=32, tokenizer=make_tokenizer())
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(CORPUS * 8))
    summary = finetune_main(
        [
            "--model",
            str(tmp_path / "repo"),
            "--train_files",
            str(text),
            "--output",
            str(tmp_path / "out"),
            "--batch_size",
            "2",
            "--max_steps",
            "1",
        ]
    )
    assert summary["steps"] == 1 and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert BLOCK < 128
