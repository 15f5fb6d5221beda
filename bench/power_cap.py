"""The consumer kernels' statistics rows at the SM clock a training step runs at: each kernel plain and with its row,
timed alone (the SM at its full clock) and between large bf16 GEMMs, which hold the GPU at its power limit as a step's
GEMMs do (an H200's SM clock then falls to about 1.5 GHz), with the SM clock sampled by ``nvidia-smi`` beside them.
A plain kernel streams at memory speed at either clock; a kernel with a row issues more instructions than it moves
bytes, so its time follows the clock. Device time of each call by CUDA events around it: alone, a spin kernel ahead
of each 20 calls keeps their launches queued (none waits for the host); between GEMMs, each GEMM does.

    python3 bench/power_cap.py --shapes 1.5b,124m
    python3 bench/power_cap.py --shapes 1.5b --kernels swiglu_fwd \\
        --variants "default;trainer.kernels.swiglu.STATS_BM=8,trainer.kernels.swiglu.STATS_MAXNREG=96"
    python3 bench/power_cap.py --kernels swiglu_bwd --variants "default;trainer.kernels.swiglu.BWD_WORDS=False"
    python3 bench/power_cap.py --kernels swiglu_fwd_yh --variants "default;trainer.kernels.swiglu.WORDS_H=False"
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import launch as ts  # noqa: E402
from bench.consumers import SHAPES, StepRows, _step_inputs  # noqa: E402
from bench.variants import applied, parse_all  # noqa: E402
from fp8mon.trainer.kernels.heads import merge_heads_forward  # noqa: E402
from fp8mon.trainer.kernels.residual import residual_add_forward  # noqa: E402
from fp8mon.trainer.kernels.rmsnorm import rms_norm_forward  # noqa: E402
from fp8mon.trainer.kernels.rope import rope_qkv_backward, rope_qkv_forward  # noqa: E402
from fp8mon.trainer.kernels.swiglu import swiglu_backward, swiglu_forward  # noqa: E402

CALLS = 20  # calls per batch: one spin kernel or 20 GEMMs ahead of them
SPIN_CYCLES = 20_000_000  # about 10 ms at 2 GHz, far longer than the host takes to queue a batch
PHASE_S = 1.5


class ClockSampler:
    """The SM clock (MHz) every 20 ms from ``nvidia-smi``, with the host's monotonic time of each sample."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                       "-lms", "20"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line)))
            except ValueError:
                pass

    def median(self, t0: float, t1: float) -> float:
        inside = [c for t, c in self.samples if t0 < t < t1]
        return statistics.median(inside) if inside else float("nan")

    def close(self) -> None:
        self._proc.terminate()


def kernels(name: str, dev: torch.device) -> dict:
    """(plain, with its row) of each consumer kernel at ``name``'s shape (bf16, no histogram). ``swiglu_fwd_yh``: the
    forward with the rows of y and of h (a plain fc2's input), which the words path defers to a statistics launch,
    here flushed at once, inside the call's timing. ``heads``: the head merge with the projection input's row;
    ``heads_read``: the merge, then a statistics launch reading its result (what the agent's hooks do without
    ``trainer.layers.HEADS_ROW``)."""
    y, dh, x, b, w, (rot, qkv, grads), heads = _step_inputs(name, dev)
    tgt = StepRows(dev)
    att = grads[0]  # (batch, heads, seq, head size), the attention output's layout

    def both_rows():
        swiglu_forward(y, stats=tgt(), h_stats=tgt())
        ts.flush_deferred()

    def merged_then_read():
        t = tgt()
        ts.rows([merge_heads_forward(att)], fmt="e4m3", center=(0.0, 1.0), hist=False, out=t.rows, index=[t.index],
                later=True)

    return {
        "swiglu_fwd": (lambda: swiglu_forward(y), lambda: swiglu_forward(y, stats=tgt())),
        "swiglu_fwd_yh": (lambda: swiglu_forward(y), both_rows),
        "swiglu_bwd": (lambda: swiglu_backward(y, dh), lambda: swiglu_backward(y, dh, stats=tgt())),
        "rope_fwd": (lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, heads),
                     lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, heads, stats=tgt())),
        "rope_bwd": (lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16),
                     lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16, stats=tgt())),
        "residual_add": (lambda: residual_add_forward(x, b), lambda: residual_add_forward(x, b, stats=tgt())),
        "rmsnorm_fwd": (lambda: rms_norm_forward(x, w, 1e-6), lambda: rms_norm_forward(x, w, 1e-6, stats=tgt())),
        "heads": (lambda: merge_heads_forward(att), lambda: merge_heads_forward(att, stats=tgt())),
        "heads_read": (lambda: merge_heads_forward(att), merged_then_read),
    }


def timed(fn, gemm, clock: ClockSampler) -> tuple[float, float]:
    """(median device us of ``fn``, median SM clock MHz) over ``PHASE_S`` seconds of batches; between GEMMs when
    ``gemm`` is given, else alone."""
    t0 = time.monotonic()
    times: list[float] = []
    while time.monotonic() - t0 < PHASE_S:
        events = []
        if gemm is None:
            torch.cuda._sleep(SPIN_CYCLES)
        for _ in range(CALLS):
            if gemm is not None:
                gemm()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        ts.merge_later()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in events]
    return statistics.median(times), clock.median(t0 + 0.3, time.monotonic())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1.5b,124m", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--kernels", help="comma-separated, of swiglu_fwd, swiglu_fwd_yh, swiglu_bwd, rope_fwd, rope_bwd, "
                                     "residual_add, rmsnorm_fwd, heads, heads_read (default: all)")
    p.add_argument("--variants", default="default", help="settings measured one after another (bench/variants.py)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    variants = parse_all(args.variants)
    clock = ClockSampler()
    time.sleep(1.0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def gemm():
        return a @ b

    print(f"{torch.cuda.get_device_name()}; device us: plain, with the row, the row's cost (median SM clock)")
    for name in args.shapes.split(","):
        fns = kernels(name.strip(), dev)
        chosen = args.kernels.split(",") if args.kernels else list(fns)
        for label in chosen:
            plain, row = fns[label.strip()]
            for variant, assignments in variants:
                with applied(assignments):
                    plain(), row()
                    ts.merge_later()
                    torch.cuda.synchronize()
                    (pa, ca), (ra, _) = timed(plain, None, clock), timed(row, None, clock)
                    (pb, cb), (rb, _) = timed(plain, gemm, clock), timed(row, gemm, clock)
                tag = "" if len(variants) == 1 else f" [{variant}]"
                print(f"{name} {label}{tag}: alone {pa:.1f}, {ra:.1f}, +{ra - pa:.1f} ({ca:.0f} MHz) | between GEMMs "
                      f"{pb:.1f}, {rb:.1f}, +{rb - pb:.1f} ({cb:.0f} MHz)", flush=True)
    clock.close()


if __name__ == "__main__":
    main()
