"""Issue 13, "Faults not met": command-line faults that ended silently or in a raw traceback, each reproduced here."""

import pytest
import torch

from loopformer_hf.convert_reference import main as convert_main


def test_convert_reference_refuses_an_existing_file_as_output(tmp_path, capsys):
    # save_pretrained only logs an error for a file path, so the converter printed "saved" and wrote nothing
    target = tmp_path / "taken.bin"
    target.write_bytes(b"keep me")
    missing_ckpt = tmp_path / "never-read.pt"  # the check must come before any work, so the checkpoint is not needed
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--checkpoint", str(missing_ckpt), "--output", str(target), "--n-layer", "1", "--n-loops", "2",
                      "--n-embd", "8", "--n-head", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(target) in err and "not a folder" in err and "saved" not in err
    assert target.read_bytes() == b"keep me"
