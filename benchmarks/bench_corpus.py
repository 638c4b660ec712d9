"""Memory and speed of LoopFormer's real-corpus path (issue 62), at two corpus sizes 40x apart, side by side:

- `prepare` (tokenize through `datasets` and write the token files): peak RSS and tokens/s, against the tokenizer's
  own batched speed on the same documents and cores (`tokenizer(batch)` and nothing else);
- `train --task text --data_dir` on those files: peak RSS, seconds from the command's start to its first step, and
  training steps/s;
- for comparison, the in-memory text path (`--train_files`, its BPE) at the small size only: it holds every token as
  a Python int (~190 bytes a token), so the large size would take gigabytes.

    .venv/bin/python -m benchmarks.bench_corpus                          # 5 MB and 200 MB, ~10 min on 2 cores
    .venv/bin/python -m benchmarks.bench_corpus --sizes_mb 1 40 --quick  # a smaller check

Each measurement runs in its own child process, which reports its own high-water mark (VmHWM: resident memory,
the pages of memory-mapped files included: Arrow caches, token files), the peak of its private memory (RssAnon, sampled
every 20 ms: what the process holds itself) and its timings; the corpus is Shakespeare's plays cut into documents
of about 4 KB and repeated with each copy's words shuffled in place (../shared/data/shakespeare; random words where it
is absent). Writes benchmarks/results/corpus.json.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "shakespeare")
RESULTS = os.path.join(os.path.dirname(__file__), "results", "corpus.json")


def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class AnonPeak:
    """The peak of RssAnon (heap and other private memory, without the pages of memory-mapped files, which the kernel
    can drop at will), sampled every 20 ms; VmHWM counts the mapped files' pages too."""

    def __init__(self):
        import threading

        self.peak, self.stop = 0.0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, status_mib("RssAnon"))

    def finish(self):
        self.stop.set()
        self.thread.join()
        return max(self.peak, status_mib("RssAnon"))


def source_paragraphs():
    if os.path.isdir(SHAKESPEARE):
        text = "".join(
            open(os.path.join(SHAKESPEARE, n), encoding="utf-8").read() for n in sorted(os.listdir(SHAKESPEARE))
        )
    else:
        rng = random.Random(0)
        words = [f"w{i}" for i in range(5000)]
        text = " ".join(rng.choice(words) for _ in range(1_000_000))
    return [text[i : i + 4000] for i in range(0, len(text), 4000)]


def write_corpus(path, size_mb, seed=0):
    """A .jsonl of ~4 KB documents totalling `size_mb` MB."""
    rng = random.Random(seed)
    paragraphs = source_paragraphs()
    written, target = 0, size_mb * 1_000_000
    with open(path, "w") as f:
        while written < target:
            for p in paragraphs:
                words = p.split(" ")
                if written:  # later copies: each document's words shuffled, so that no copy repeats another
                    rng.shuffle(words)
                line = json.dumps({"text": " ".join(words)}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break


def child(kind, args_json):
    """Run one measurement in this process and print its JSON."""
    start = time.monotonic()
    anon = AnonPeak()
    args = json.loads(args_json)
    result = {}
    if kind == "prepare":
        from looped_training.loopformer import prepare

        meta = prepare.main(args)
        result["tokens"] = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    elif kind == "tokenizer":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args["tokenizer"])
        docs = [json.loads(line)["text"] for line in open(args["corpus"])]
        t0, tokens = time.monotonic(), 0
        for i in range(0, len(docs), 1000):
            ids = tok(docs[i : i + 1000], add_special_tokens=False, return_attention_mask=False, verbose=False)
            tokens += sum(map(len, ids["input_ids"]))
        result["tokens"], result["tokenize_s"] = tokens, time.monotonic() - t0
    elif kind == "train":
        import transformers

        from looped_training.loopformer import train

        marks = {}

        class FirstStep(transformers.TrainerCallback):
            def on_step_end(self, a, state, control, **kw):
                marks.setdefault("first_step_s", time.monotonic() - start)
                marks["last_step_at"] = time.monotonic()
                marks["steps"] = state.global_step

        original = train.build_trainer

        def with_mark(*a, **kw):
            trainer = original(*a, **kw)
            trainer.add_callback(FirstStep())
            return trainer

        train.build_trainer = with_mark
        train.main(args)
        result.update(marks)
        result["steps_per_s_after_first"] = (marks["steps"] - 1) / (
            marks["last_step_at"] - start - marks["first_step_s"]
        )
        del result["last_step_at"]
    result["wall_s"] = time.monotonic() - start
    result["peak_rss_mib"] = status_mib("VmHWM")
    result["peak_anon_mib"] = anon.finish()
    print("RESULT " + json.dumps(result))


def measure(kind, args, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_corpus", "--child", kind, json.dumps(args)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


TRAIN = [
    "--task", "text", "--hidden_size", "64", "--num_attention_heads", "2", "--num_loops", "4", "--block_size", "128",
    "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--save_strategy", "no", "--logging_steps", "1000",
]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_corpus")
    parser.add_argument("--sizes_mb", type=int, nargs=2, default=[5, 200])
    parser.add_argument("--train_steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="skip the in-memory comparison")
    parser.add_argument("--output", default=RESULTS, help="where the JSON goes (default: %(default)s)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    small, large = args.sizes_mb
    if not 0 < small < large:
        parser.error(f"--sizes_mb {small} {large}: give two sizes in MB, the smaller first, both above 0")
    if args.train_steps < 3:
        parser.error(f"--train_steps {args.train_steps}: give at least 3 (the rate is timed after the first step)")
    results = {"sizes_mb": args.sizes_mb, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer  # noqa: F401  (a clear failure before the long work)

        from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

        tok_dir = os.path.join(tmp, "tokenizer")
        train_bpe_tokenizer(source_paragraphs()[:300], 4096).save_pretrained(tok_dir)
        for size in args.sizes_mb:
            corpus = os.path.join(tmp, f"corpus{size}.jsonl")
            write_corpus(corpus, size)
            out = os.path.join(tmp, f"tokens{size}")
            run = {"corpus_bytes": os.path.getsize(corpus)}
            run["tokenizer"] = measure("tokenizer", {"tokenizer": tok_dir, "corpus": corpus}, args.threads)
            prep = ["--train_files", corpus, "--tokenizer_name", tok_dir, "--output_dir", out,
                    "--validation_fraction", "0.01"]  # fmt: skip
            run["prepare"] = measure("prepare", prep, args.threads)
            train = [*TRAIN, "--data_dir", out, "--output_dir", os.path.join(tmp, f"run{size}"),
                     "--max_steps", str(args.train_steps)]  # fmt: skip
            run["train"] = measure("train", train, args.threads)
            if not args.quick and size == min(args.sizes_mb):
                text_dir = os.path.join(tmp, "text")
                os.makedirs(text_dir, exist_ok=True)
                with open(os.path.join(text_dir, "corpus.txt"), "w") as f:
                    f.writelines(json.loads(line)["text"] + "\n" for line in open(corpus))
                old = [*TRAIN, "--train_files", text_dir, "--tokenizer_name", tok_dir,
                       "--output_dir", os.path.join(tmp, "old"), "--max_steps", str(args.train_steps)]  # fmt: skip
                run["train_in_memory"] = measure("train", old, args.threads)
            results["runs"][str(size)] = run
            print(json.dumps({size: run}), flush=True)
    report(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.output}")


def report(results):
    small, large = (results["runs"][str(s)] for s in results["sizes_mb"])
    print(f"\ncorpus: {small['corpus_bytes'] / 1e6:.1f} MB and {large['corpus_bytes'] / 1e6:.1f} MB "
          f"({large['corpus_bytes'] / small['corpus_bytes']:.0f}x)")  # fmt: skip
    print("| measurement | small | large | large / small |\n|---|---:|---:|---:|")
    rows = []
    for run in (small, large):
        tok_rate = run["tokenizer"]["tokens"] / run["tokenizer"]["tokenize_s"]
        prep_rate = run["prepare"]["tokens"] / run["prepare"]["wall_s"]
        rows.append({
            "tokens": run["prepare"]["tokens"],
            "prepare peak RSS MiB": run["prepare"]["peak_rss_mib"],
            "prepare peak RssAnon MiB": run["prepare"]["peak_anon_mib"],
            "prepare tokens/s (whole command)": prep_rate,
            "tokenizer's own batched tokens/s": tok_rate,
            "tokenizer speed / prepare speed": tok_rate / prep_rate,
            "train peak RSS MiB": run["train"]["peak_rss_mib"],
            "train peak RssAnon MiB": run["train"]["peak_anon_mib"],
            "train: s from start to first step": run["train"]["first_step_s"],
            "train steps/s after the first": run["train"]["steps_per_s_after_first"],
        })  # fmt: skip
    for key in rows[0]:
        a, b = rows[0][key], rows[1][key]
        print(f"| {key} | {a:,.2f} | {b:,.2f} | {b / a:.2f} |")
    print(
        f"| train peak RSS, large - small (MiB) | | | {rows[1]['train peak RSS MiB'] - rows[0]['train peak RSS MiB']:+.1f} |"
    )
    if "train_in_memory" in small:
        old = small["train_in_memory"]
        print(f"\nin-memory text path at the small size: peak RSS {old['peak_rss_mib']:,.0f} MiB, first step after "
              f"{old['first_step_s']:.1f} s (token files: {small['train']['peak_rss_mib']:,.0f} MiB, "
              f"{small['train']['first_step_s']:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
