"""Run a training entry point and kill its process in the middle of writing one file of one checkpoint: the file is
written, cut to half its size, and the process ends at once (`os._exit`, no clean-up, status 137 as after SIGKILL).
Every log entry goes to LOG (one JSON line each) as it is made, so the test can read the curve the killed run had.

    python tests/support/kill_during_save.py checkpoint-6/model.safetensors LOG looped_training.loopformer.train ARGS...

The writers are the three a Trainer checkpoint goes through: `safetensors` for the weights, `torch.save` for the
optimizer, scheduler and RNG states, `TrainerState.save_to_json` for trainer_state.json (the last file).

    python tests/support/kill_during_save.py final:config.json LOG looped_training.fprm.train ARGS...

kills the run with a real SIGKILL when it starts writing the config.json of its final model (any config.json outside
a checkpoint-N folder), right after creating the file: the moment of a kill during the final `save_model`.

    python tests/support/kill_during_save.py sigint:evaluation LOG looped_training.fprm.train ARGS...

sends the process a real SIGINT (Ctrl-C) when FPRM's final evaluation starts its solver, after the final save and
before results.json; the command ends as on the command line (`run_command`: one line, status 130).
"""

import importlib
import json
import os
import signal
import sys

import torch
import transformers
from transformers import PretrainedConfig, modeling_utils, trainer_callback

KILLED = 137


def main():
    target, log_file, module, *argv = sys.argv[1:]
    if target == "sigint:evaluation":
        return interrupt_evaluation(module, argv)
    if target.startswith("final:"):
        kill_at_final_save(target.removeprefix("final:"))
        target = "(none)"
    target_parts = target.split("/")

    def killing(original):
        def write(obj, path, *args, **kwargs):
            result = original(obj, path, *args, **kwargs)
            if os.path.normpath(str(path)).split(os.sep)[-len(target_parts) :] == target_parts:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
                os._exit(KILLED)
            return result

        return write

    torch.save = killing(torch.save)
    modeling_utils.safe_save_file = killing(modeling_utils.safe_save_file)
    trainer_callback.TrainerState.save_to_json = killing(trainer_callback.TrainerState.save_to_json)

    original_log = transformers.Trainer.log

    def log(self, logs, *args, **kwargs):
        original_log(self, logs, *args, **kwargs)
        with open(log_file, "a") as f:
            f.write(json.dumps(self.state.log_history[-1]) + "\n")

    transformers.Trainer.log = log
    importlib.import_module(module).main(argv)


def kill_at_final_save(name):
    original = PretrainedConfig.to_json_file

    def write(self, path, *args, **kwargs):
        parts = os.path.normpath(str(path)).split(os.sep)
        if parts[-1] == name and not parts[-2].startswith("checkpoint-"):
            open(path, "w").close()  # created, nothing written yet
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, path, *args, **kwargs)

    PretrainedConfig.to_json_file = write


def interrupt_evaluation(module, argv):
    from looped_training.arguments import run_command
    from looped_training.fprm import evaluate

    original = evaluate.run_solver

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at the next instruction
        return original(*args, **kwargs)

    evaluate.run_solver = interrupted
    run_command(lambda: importlib.import_module(module).main(argv), f"python -m {module}")


if __name__ == "__main__":
    main()
