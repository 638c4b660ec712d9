"""Publish a trained checkpoint to the Hugging Face Hub (or any Hub-compatible endpoint), in one commit:

    python -m looped_training.publish --checkpoint runs/loopformer-tiny --repo_id org/loopformer-tiny \
        [--token hf_...] [--private] [--eval_json runs/eval.json] [--dataset org/data] [--license apache-2.0]

The weights, `config.json` with `auto_map`, the modeling code, the tokenizer and the card of
`looped_training.model_cards` are staged in `--stage_dir` (outside the checkpoint, which is only read; `--dry_run`
stops there) or a temporary folder, then `HfApi.upload_folder` replaces an older push's top-level weight files and
keeps every other file. Exit status 2: bad input, one line naming the flag or the file; 1: the Hub refused or could
not be reached.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from looped_training.model_cards import kind_of, model_card


# Weight files an older push may have left (another shard count, a .bin checkpoint), deleted by upload_folder unless
# uploaded again. No `*`, which crosses `/`: files in folders (an ONNX export, an adapter, checkpoints) are the user's.
_SHARD = "-" + "[0-9]" * 5 + "-of-" + "[0-9]" * 5  # transformers' shard names
STALE_WEIGHT_FILES = [
    f"model{_SHARD}.safetensors",
    f"pytorch_model{_SHARD}.bin",
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PublishError(RuntimeError):
    """The Hub refused or could not be reached; the message says why and what to do. Nothing local was changed."""


def _has_tokenizer(folder):
    return any((Path(folder) / name).exists() for name in TOKENIZER_FILES)


def stage(checkpoint, repo_id, out_dir, *, tokenizer=None, **card_fields):
    """Write everything the repo should hold into `out_dir` (empty or absent, outside the checkpoint); returns the
    model type and the files. They go to a temporary folder beside `out_dir` that becomes `out_dir` only once all are
    there: a failure leaves `out_dir` as it was, so the same command can be rerun."""
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)  # HFValidationError is a ValueError
    if "/" not in repo_id:
        raise ValueError(f"--repo_id must be 'owner/name', got {repo_id!r}.")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"--checkpoint {checkpoint} is not a saved model folder (no config.json there).")
    if out_dir.resolve().is_relative_to(checkpoint.resolve()):
        raise ValueError(
            f"--stage_dir {out_dir} is inside --checkpoint {checkpoint}, which publishing only reads: "
            f"give a folder outside it."
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--stage_dir {out_dir} is not an empty folder; give an empty or new folder.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # removed on a failure; renamed to out_dir on success, so its cleanup finds nothing (errors ignored)
    with tempfile.TemporaryDirectory(
        prefix=f".{out_dir.name}.partial-", dir=out_dir.parent, ignore_cleanup_errors=True
    ) as partial:
        model_type = _stage_files(checkpoint, repo_id, Path(partial), tokenizer, card_fields)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        Path(partial).rename(out_dir)
    return {"model_type": model_type, "files": sorted(p.name for p in out_dir.iterdir())}


def _stage_files(checkpoint, repo_id, out_dir, tokenizer, card_fields):
    import transformers
    from transformers import AutoTokenizer

    # imported here, not above: checkpoints pulls in transformers' Trainer utilities (seconds)
    from looped_training.checkpoints import CheckpointError, check_checkpoint, first_line, load_model

    check_checkpoint(checkpoint)  # config.json parses, every safetensors file is complete
    kind = kind_of(json.loads((checkpoint / "config.json").read_text()).get("model_type"))
    model = load_model(getattr(transformers, kind["auto_class"]), checkpoint)
    model.save_pretrained(out_dir)  # weights, config with auto_map, modeling code, generation config
    source, tokenizer = tokenizer or (checkpoint if _has_tokenizer(checkpoint) else None), None
    if source is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as err:  # tokenizers and transformers raise several types for a broken file
            raise CheckpointError(
                f"The tokenizer in {source} could not be loaded ({type(err).__name__}: {first_line(err)})."
            ) from None
        tokenizer.save_pretrained(out_dir)
    elif kind["needs_tokenizer"]:
        raise ValueError(
            f"No tokenizer in {checkpoint} (looked for {', '.join(TOKENIZER_FILES)}); pass --tokenizer PATH."
        )
    model_card(model, repo_id, checkpoint, tokenizer=tokenizer, **card_fields).save(out_dir / "README.md")
    return model.config.model_type


def push_to_hub_with_card(
    model,
    repo_id,
    *,
    commit_message=None,
    commit_description=None,
    private=None,
    token=None,
    revision=None,
    create_pr=False,
    max_shard_size="50GB",
    tags=None,
):
    """`push_to_hub_with_card(model, "org/name")`: transformers' `model.push_to_hub` (create the repo, save the
    model, upload in one commit) with this package's card where the repo has none yet; a card already there is kept,
    tags added. The models' own `push_to_hub` is transformers' (its generic card): the card is this function's. The folder the model was loaded from, if
    any, gives the record, the tokenizer and the evaluation."""
    from huggingface_hub import HfApi, ModelCard
    from huggingface_hub.errors import EntryNotFoundError
    from transformers import AutoTokenizer

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    try:
        card = ModelCard.load(repo_id, token=token)
        card.data.tags = sorted(set(card.data.tags or []) | set(tags or []))
    except EntryNotFoundError:
        folder = Path(model.name_or_path) if model.name_or_path and Path(model.name_or_path).is_dir() else None
        tokenizer = AutoTokenizer.from_pretrained(folder) if folder is not None and _has_tokenizer(folder) else None
        card = model_card(model, repo_id, folder, tokenizer=tokenizer, tags=tags)
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        card.save(Path(tmp, "README.md"))
        return api.upload_folder(
            folder_path=tmp,
            repo_id=repo_id,
            commit_message=commit_message or "Upload model",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def _explain(err, endpoint, checkpoint):
    """A huggingface_hub or network exception as a PublishError: what happened and what to do."""
    from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, LocalTokenNotFoundError):
        why = "No Hub token: pass --token, set HF_TOKEN or run `hf auth login`."
    elif isinstance(err, OfflineModeIsEnabled):
        why = f"HF_HUB_OFFLINE is set, so nothing can be pushed to {endpoint}."
    elif status in (401, 403):
        server = (getattr(err, "server_message", None) or str(err).splitlines()[0]).strip()
        why = (
            f"The Hub at {endpoint} rejected the token (HTTP {status}{': ' + server if server else ''}). Pass a "
            f"valid token with write access via --token, HF_TOKEN or `hf auth login`."
        )
    elif status is not None:
        why = f"The Hub at {endpoint} answered HTTP {status}: {err}."
    else:
        why = (
            f"Could not reach the Hub endpoint {endpoint} ({type(err).__name__}: {err}). Check --endpoint / "
            f"HF_ENDPOINT and the network."
        )
    return PublishError(f"{why} Nothing local was changed: the checkpoint at {checkpoint} is as it was.")


def push(
    stage_dir,
    repo_id,
    *,
    endpoint=None,
    token=None,
    private=False,
    commit_message=None,
    revision=None,
    checkpoint=None,
):
    """create_repo (exist_ok) + upload_folder of the staged files, deleting stale top-level weight files."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HfUriError

    # huggingface_hub's errors (HfHubHTTPError, OfflineModeIsEnabled, LocalTokenNotFoundError) are OSErrors; a refused
    # connection or a timeout is the HTTP client's own error, the base HfHubHTTPError extends (httpx2's or httpx's)
    network_error = HfHubHTTPError.__bases__[0]
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.whoami()  # a bad token fails here, before anything is created
        try:
            api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        except HfUriError:  # huggingface_hub 2.x on another endpoint, for a repo that exists: it is there; go on
            pass
        return api.upload_folder(
            folder_path=str(stage_dir),
            repo_id=repo_id,
            revision=revision,
            commit_message=commit_message or "Upload model with looped_training.publish",
            delete_patterns=STALE_WEIGHT_FILES,
        )
    except (OSError, network_error) as err:
        raise _explain(err, endpoint, checkpoint or stage_dir) from err


def build_parser():
    p = argparse.ArgumentParser(prog="python -m looped_training.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a folder written by save_pretrained / Trainer")
    p.add_argument("--repo_id", required=True, help="owner/name on the Hub")
    p.add_argument("--token", help="write token (default: HF_TOKEN or the stored login)")
    p.add_argument(
        "--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)"
    )
    p.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--revision", help="branch to commit to (default: main)")
    p.add_argument("--commit_message")
    p.add_argument("--tokenizer", help="tokenizer folder if the checkpoint has none")
    p.add_argument("--eval_json", help="evaluation results for the card's model-index")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument(
        "--dataset", action="append", dest="datasets", metavar="DATASET", help="training dataset id (repeatable)"
    )
    p.add_argument("--tag", action="append", dest="tags", metavar="TAG", help="extra tag (repeatable)")
    p.add_argument("--base_model", help="the model this one was fine-tuned from")
    p.add_argument("--language", action="append", help="language code (repeatable)")
    p.add_argument(
        "--training_text", help="a paragraph for the card's Training section (default: written from the run's record)"
    )
    p.add_argument(
        "--prompt",
        help="prompt of the card's usage snippets (default: the record's held-out prompt, "
        "else the tokenizer's start-of-text token)",
    )
    p.add_argument("--stage_dir", help="stage the repo here and keep it (default: a temp folder)")
    p.add_argument("--dry_run", action="store_true", help="stage only (needs --stage_dir); push nothing")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    card = {
        k: getattr(args, k)
        for k in (
            "tokenizer",
            "eval_json",
            "license",
            "datasets",
            "tags",
            "base_model",
            "language",
            "training_text",
            "prompt",
        )
    }
    from looped_training.arguments import check_output_path, one_line  # here: `--help` stays fast

    try:
        if args.dry_run and args.stage_dir is None:
            raise ValueError("--dry_run needs --stage_dir (where the staged files are kept to look at).")
        check_output_path("--stage_dir", args.stage_dir, folder=True)
        with tempfile.TemporaryDirectory(prefix="publish-") as tmp:
            stage_dir = args.stage_dir or Path(tmp) / "repo"
            summary = stage(args.checkpoint, args.repo_id, stage_dir, **card)
            commit = (
                None
                if args.dry_run
                else push(
                    stage_dir,
                    args.repo_id,
                    endpoint=args.endpoint,
                    token=args.token,
                    private=args.private,
                    commit_message=args.commit_message,
                    revision=args.revision,
                    checkpoint=args.checkpoint,
                )
            )
    except (ValueError, PublishError) as err:  # bad input (a flag, the checkpoint, the evaluation JSON); the Hub
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(f"staged {summary['model_type']} files: {', '.join(summary['files'])}")
    print(
        f"pushed to {args.repo_id}: {getattr(commit, 'commit_url', commit)}"
        if commit is not None
        else f"dry run: nothing pushed; files are in {args.stage_dir}"
    )
    return 0


if __name__ == "__main__":
    from looped_training.arguments import run_command

    run_command(main, "python -m looped_training.publish")
