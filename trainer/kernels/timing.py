"""Timing kernel candidates against each other on a GPU (first-call tuning, benches).

The candidates are timed in turn over several rounds and each one's median over the rounds is kept: one short
timing each, back to back, drifts with the GPU's clock and temperature between runs, enough to pick a kernel well
slower than the best.

Two clocks. ``interleaved_medians`` takes ``triton.testing.do_bench`` (eager calls, L2 flushed): where a call's
Python host time exceeds its kernel (an fp8_gemm call costs several times ``torch._scaled_mm``'s host time), that
measures the host. ``device_medians``
measures the device alone: the stream is held by a sleep kernel while ``calls`` launches are queued behind it, so
the GPU runs them back to back with no host gap (inputs stay in L2 between calls, as in a CUDA graph replay).
Where the sleep ends before the host has queued them all, the timing is taken again behind a longer sleep, and after
three tries it is returned with a warning: it may include the host's time.
Tuning picks by device time: in training the host runs ahead of the GPU, so a launch's host time is hidden and
its kernel time is what the step pays."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch
import triton

SLEEP_CYCLES = 20_000_000  # milliseconds at a GPU's clock: longer than queueing ``calls`` launches on the host


def _medians(fns: dict, rounds: int, time_one: Callable[[Callable[[], object]], float]) -> dict:
    """Per key, the median over ``rounds`` interleaved rounds (each candidate once per round) of ``time_one``."""
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            runs[k].append(time_one(fn))
    return {k: sorted(v)[len(v) // 2] for k, v in runs.items()}


def interleaved_medians(fns: dict[Hashable, Callable[[], object]], rounds: int = 3, warmup: int = 5,
                        rep: int = 25) -> dict:
    """Per key, the median over ``rounds`` interleaved rounds of ``triton.testing.do_bench``'s median (ms)."""
    return _medians(fns, rounds, lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _queued_ms(fn, calls: int, tries: int = 3) -> float:
    """Device time per call (ms) of ``calls`` calls queued behind a sleep kernel. Where the sleep has ended before
    the host has queued them all, the GPU may have waited on the host between calls: the timing is taken again
    behind a sleep twice as long, and after ``tries`` such timings it is returned with a warning."""
    fn()  # warm: compiles and first-call tuning stay out of the timing
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = SLEEP_CYCLES
    for _ in range(tries):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        host_behind = start.query()  # the queued calls had begun before the last was queued
        end.record()
        end.synchronize()
        if not host_behind:
            break
        cycles *= 2
    else:
        warnings.warn(f"timing: queueing {calls} calls outlasted a sleep of {cycles // 2} cycles {tries} times; "
                      f"the time per call may include the host's", stacklevel=2)
    return start.elapsed_time(end) / calls


def device_medians(fns: dict[Hashable, Callable[[], object]], rounds: int = 3, calls: int = 20) -> dict:
    """Per key, the median over ``rounds`` interleaved rounds of the device time per call (ms) of ``calls`` calls
    queued behind a sleep kernel (no host gaps between them)."""
    return _medians(fns, rounds, lambda fn: _queued_ms(fn, calls))


def fastest(fns: dict[Hashable, Callable[[], object]], rounds: int = 3) -> Hashable:
    """The key of the fastest candidate by ``device_medians``."""
    t = device_medians(fns, rounds)
    return min(t, key=t.get)
