"""Timing kernel candidates against each other on a GPU (first-call tuning, benches).

The candidates are timed in turn over several rounds and each one's median over the rounds is kept: one short
timing each, back to back, varied 5-10% between runs on an H200 (clock and thermal drift), enough to pick a kernel
13-27% slower than the best (bench/gemm_ws.py speed, 2026-11-21)."""

from __future__ import annotations

from typing import Callable, Hashable

import triton


def interleaved_medians(fns: dict[Hashable, Callable[[], object]], rounds: int = 3, warmup: int = 5,
                        rep: int = 25) -> dict:
    """Per key, the median over ``rounds`` interleaved rounds of ``triton.testing.do_bench``'s median (ms)."""
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            runs[k].append(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return {k: sorted(v)[len(v) // 2] for k, v in runs.items()}


def fastest(fns: dict[Hashable, Callable[[], object]], rounds: int = 3) -> Hashable:
    """The key of the fastest candidate by ``interleaved_medians``."""
    t = interleaved_medians(fns, rounds)
    return min(t, key=t.get)
