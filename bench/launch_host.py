"""Host time per call of the agent's and the trainer's Triton launches, with the direct launch of compiled
kernels (agent/triton_launch.py) on and off, alternating in one process.

    python3 bench/launch_host.py            # on a GPU

Each case is timed as 300 calls queued back to back on small tensors (the GPU keeps up, so the host's time per
call is what is measured), median of --rounds rounds per setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent import triton_launch as tlaunch  # noqa: E402
from agent import triton_stats as ts  # noqa: E402
from trainer.kernels.quantize import quantize  # noqa: E402
from trainer.kernels.quantize_transpose import quantize_transpose  # noqa: E402


def cases() -> dict:
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev).to(torch.bfloat16)
    x2 = x.view(1024, 1024)
    out = torch.zeros(4, ts.ds.WIDTH, dtype=torch.float64, device=dev)
    center = torch.tensor([0.0, 1.0], dtype=torch.float64, device=dev)
    scale, accum = torch.tensor(2.0, device=dev), torch.zeros((), device=dev)

    def target():
        return ts.Target(out, 1, False, center, 6.0, False, None, None)

    return {
        "rows() (agent form, 1 tensor)": lambda: ts.rows([x], fmt="e4m3", center=[center], hist=False, out=out,
                                                         index=[1], merge=[False]),
        "quantize current (2 launches)": lambda: quantize(x, "e4m3"),
        "quantize delayed": lambda: quantize(x, "e4m3", scale, accum),
        "quantize delayed + stats": lambda: quantize(x, "e4m3", scale, accum, stats=target()),
        "quantize_transpose delayed": lambda: quantize_transpose(x2, "e5m2", scale, accum),
        "quantize_transpose delayed + stats": lambda: quantize_transpose(x2, "e5m2", scale, accum, stats=target()),
    }


def per_call(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, direct launch off / on")
    for name, fn in cases().items():
        got = {False: [], True: []}
        for setting in (False, True):  # warm-up: compiles, and fills the launchers' caches
            tlaunch.ENABLED = setting
            per_call(fn, 20)
        for _ in range(args.rounds):
            for setting in (False, True):
                tlaunch.ENABLED = setting
                got[setting].append(per_call(fn, args.calls) * 1e6)
        off, on = statistics.median(got[False]), statistics.median(got[True])
        print(f"{name:38} {off:7.1f} / {on:7.1f} us  ({off - on:+.1f} us, x{off / on:.2f})", flush=True)
    tlaunch.ENABLED = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
