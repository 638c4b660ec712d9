"""Peak private memory of LoopFormer's corpus path, side by side at two sizes (issue 70, Deliver 3): memory must stay
flat in every dimension of the corpus.

- `prepare --num_proc 2` on corpora of ~10 KB documents, small against large;
- `prepare` on one document of the small size against one of the large size (one .txt file each);
- 30 steps of `train --streaming` on the corpora of ~10 KB documents, small against large.

    .venv/bin/python -m benchmarks.bench_corpus_memory                              # 5 MB against 200 MB (and 60 MB)
    .venv/bin/python -m benchmarks.bench_corpus_memory --sizes_mb 5 50 --document_mb 5 60   # what the README table ran

What is measured is the peak, over the run, of RssAnon (private memory: heap, the tokenizer's buffers; not the pages
of memory-mapped files, which the kernel may drop) summed over the command's whole process tree (the `--num_proc`
workers included), sampled every 20 ms from /proc by this process, which runs each command as a child
(`python -m looped_training.loopformer.prepare` / `train`). The text is Shakespeare's plays
(../shared/data/shakespeare; random words where they are absent) with each copy's words shuffled. Writes
benchmarks/results/corpus_memory.json (`--output`).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(__file__), "results", "corpus_memory.json")
SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "shakespeare")
PREPARE = "looped_training.loopformer.prepare"
TRAIN = "looped_training.loopformer.train"
STREAM_TRAIN = [
    "--task", "text", "--hidden_size", "64", "--num_attention_heads", "2", "--num_loops", "4", "--block_size", "128",
    "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--save_strategy", "no", "--logging_steps", "1000", "--validation_fraction", "0.01",
]  # fmt: skip


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def words():
    if os.path.isdir(SHAKESPEARE):
        names = sorted(os.listdir(SHAKESPEARE))
        text = " ".join(read(os.path.join(SHAKESPEARE, n)) for n in names)
        return text.split(" ")
    rng = random.Random(0)
    return [f"w{rng.randrange(5000)}" for _ in range(500_000)]


def write_documents(path, size_mb, doc_bytes, seed=0):
    """A .jsonl of documents of about `doc_bytes` each, `size_mb` MB in all: runs of the source's words, shuffled
    in each document after the first pass (no two copies alike)."""
    rng, source = random.Random(seed), words()
    written, at, target = 0, 0, size_mb * 1_000_000
    with open(path, "w") as f:
        while written < target:
            doc, n = [], 0
            while n < doc_bytes:
                w = source[at % len(source)]
                doc.append(w)
                n, at = n + len(w) + 1, at + 1
            if at > len(source):
                rng.shuffle(doc)
            line = json.dumps({"text": " ".join(doc)}) + "\n"
            f.write(line)
            written += len(line)


def write_one_document(path, size_mb, seed=0):
    """One .txt document of `size_mb` MB, written a line at a time (this process holds no copy of it)."""
    rng, source = random.Random(seed), words()
    written, target = 0, size_mb * 1_000_000
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            at = rng.randrange(len(source) - 2000) if len(source) > 2000 else 0
            line = source[at : at + 2000]
            rng.shuffle(line)
            text = " ".join(line) + "\n"
            f.write(text)
            written += len(text.encode())


def tree_anon_kib(root):
    """RssAnon (KiB) summed over `root` and every process under it."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
        except OSError:
            pass
    return total


def measure(module, argv, threads):
    """Run `python -m module argv`; (peak RssAnon of its process tree in MiB, seconds, peak process count)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.getcwd(), "TQDM_DISABLE": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_anon_kib(proc.pid))
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{module} {' '.join(argv)} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return {"peak_anon_mib": peak / 1024, "wall_s": time.monotonic() - start}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_corpus_memory")
    parser.add_argument("--sizes_mb", type=int, nargs=2, default=[5, 200], help="corpora of ~10 KB documents")
    parser.add_argument("--document_mb", type=int, nargs=2, default=[5, 60], help="one document of each size")
    parser.add_argument("--doc_kb", type=int, default=10, help="document size of the --sizes_mb corpora")
    parser.add_argument("--train_steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("num_proc", "document", "streaming"), nargs="*", default=None)
    parser.add_argument("--output", default=RESULTS, help="where the JSON goes (default: %(default)s)")
    args = parser.parse_args(argv)
    for flag in ("sizes_mb", "document_mb"):
        small, large = getattr(args, flag)
        if not 0 < small < large:
            parser.error(f"--{flag} {small} {large}: give two sizes in MB, the smaller first, both above 0")
    if args.train_steps < 1:
        parser.error(f"--train_steps {args.train_steps}: give at least 1")
    parts = args.only or ["num_proc", "document", "streaming"]
    results = {"command": " ".join(["python -m benchmarks.bench_corpus_memory", *(argv or sys.argv[1:])]), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        from looped_training.loopformer.data.tokenizer import train_bpe_tokenizer

        tok_dir = os.path.join(tmp, "tokenizer")
        source = words()
        sample = [" ".join(source[i : i + 2000]) for i in range(0, min(len(source), 600_000), 2000)]
        train_bpe_tokenizer(sample, 4096).save_pretrained(tok_dir)
        corpora = {}
        for size in args.sizes_mb if {"num_proc", "streaming"} & set(parts) else ():
            corpora[size] = os.path.join(tmp, f"docs{size}.jsonl")
            write_documents(corpora[size], size, args.doc_kb * 1000)

        def prepare(files, name, *flags):
            out = os.path.join(tmp, name)
            return measure(PREPARE, ["--train_files", files, "--tokenizer_name", tok_dir, "--output_dir", out,
                                     "--validation_fraction", "0.01", *flags], args.threads)  # fmt: skip

        def row(what, small, large, a, b, limit):
            r = {"run": what, "small": small, "large": large, "small_mib": a["peak_anon_mib"],
                 "large_mib": b["peak_anon_mib"], "growth_mib": b["peak_anon_mib"] - a["peak_anon_mib"],
                 "limit_mib": limit, "wall_s": [a["wall_s"], b["wall_s"]]}  # fmt: skip
            results["rows"].append(r)
            print(json.dumps(r), flush=True)

        small, large = args.sizes_mb
        if "num_proc" in parts:
            a, b = (prepare(corpora[s], f"np{s}", "--num_proc", "2") for s in (small, large))
            row("prepare --num_proc 2", f"~{small} MB", f"~{large} MB", a, b, 300)
        if "document" in parts:
            measured = []
            for size in args.document_mb:
                folder = os.path.join(tmp, f"one{size}")
                os.makedirs(folder)
                write_one_document(os.path.join(folder, "doc.txt"), size)
                measured.append(prepare(folder, f"doc{size}"))
                os.remove(os.path.join(folder, "doc.txt"))
            row("prepare, one document", f"{args.document_mb[0]} MB", f"{args.document_mb[1]} MB", *measured, 300)
        if "streaming" in parts:
            runs = [
                measure(TRAIN, [*STREAM_TRAIN, "--streaming", "--train_files", corpora[s], "--tokenizer_name", tok_dir,
                                "--max_steps", str(args.train_steps), "--output_dir", os.path.join(tmp, f"run{s}")],
                        args.threads)
                for s in (small, large)
            ]  # fmt: skip
            row(f"{args.train_steps} steps of --streaming training", f"~{small} MB", f"~{large} MB", *runs, 200)
    print(table(results))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.output}")


def table(results):
    lines = [
        "| run | small | large | peak RssAnon, small | large | growth | limit |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['run']} | {r['small']} | {r['large']} | {r['small_mib']:,.0f} MiB | {r['large_mib']:,.0f} MiB | "
            f"{r['growth_mib']:+,.0f} MiB | {r['limit_mib']} MiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
