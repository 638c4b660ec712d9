"""Threads sharing one LoopFormer give what a sequential run gives (generate with mixed budgets, schedules and
halting), and resident memory stays flat over repeated generate calls."""

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from support.bad_input_table import loopformer

THREADS, CALLS = 4, 4
KNOBS = [
    dict(loop_budget=1),
    dict(loop_budget=3),
    dict(halt_eps=1e-2),
    dict(loop_budget=2, halt_eps=5e-2),
    dict(step_schedule=[0.5, 0.25, 0.25]),
    dict(),
]


def call(i):
    ids = torch.tensor([[3 + i % 5, 4, 5, 6 + i % 7]])
    with torch.no_grad():
        return loopformer().generate(ids, max_new_tokens=4, do_sample=False, **KNOBS[i % len(KNOBS)])


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_threads_times_generate_calls_with_mixed_budgets_equal_a_sequential_run():
    jobs = range(THREADS * CALLS)
    sequential = [call(i) for i in jobs]
    with ThreadPoolExecutor(THREADS) as pool:
        threaded = list(pool.map(call, jobs))
    assert all(torch.equal(a, b) for a, b in zip(sequential, threaded))


def test_memory_is_flat_over_repeated_calls():
    for i in range(10):  # warm-up: allocator pools and caches settle
        call(i)
    before = rss_mib()
    for i in range(50):
        call(i)
    growth = rss_mib() - before
    print(f"RSS growth over 50 generate calls: {growth:.1f} MiB")
    assert growth < 20, f"RSS grew {growth:.1f} MiB over 50 calls (bound 20 MiB)"
