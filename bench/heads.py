"""Device time (every kernel of a call, from torch.profiler) of the attention's heads merged for the projection
(trainer/kernels/heads.py), without and with the projection input's row, against torch's copy and against torch's copy
followed by a statistics launch that reads its result (what the agent's hooks do without the row), at the 124M and
1.5B shapes. Each setting of ``--variants`` (bench/variants.py) is timed in turn, in one process.

    python3 bench/heads.py
    python3 bench/heads.py --variants "default;trainer.kernels.heads.STATS_PROGRAMS_PER_SM=4"
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import launch as ts  # noqa: E402
from bench.stats_kernel_time import timed  # noqa: E402
from bench.variants import applied, parse_all  # noqa: E402
from fp8mon.trainer.kernels import heads  # noqa: E402


def us(fn) -> float:
    """Device time per call of ``fn``: every kernel it launches (a row's later merge included)."""
    return timed(fn, 50, kernel="")[2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="default")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    dev = torch.device("cuda")
    rows = torch.zeros(4, ts.ds.WIDTH, dtype=torch.float64, device=dev)
    for name, (b, nh, t, hd) in (("124M", (16, 6, 1024, 128)), ("1.5B", (4, 16, 2048, 128))):
        q, k, v = (torch.randn(b, nh, t, hd, device=dev, dtype=torch.bfloat16) for _ in range(3))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        tgt = ts.Target(rows, 0, False, (0.0, 1.0), 6.0, False, None, "e4m3")

        def torch_copy_and_read():
            out = heads.merge_heads_ref(y)
            ts.rows([out], fmt="e4m3", center=(0.0, 1.0), hist=False, out=rows, index=[1], later=True)
            ts.flush_deferred()

        def kernel_row():
            heads.merge_heads_forward(y, stats=tgt)
            ts.flush_deferred()

        base = {"torch copy": us(lambda: heads.merge_heads_ref(y)), "torch copy + read": us(torch_copy_and_read)}
        print(f"{name} {tuple(y.shape)} strides {y.stride()}: " + ", ".join(f"{k} {v:.1f} us" for k, v in base.items()),
              flush=True)
        for vname, assignments in parse_all(args.variants):
            with applied(assignments):
                plain, row = us(lambda: heads.merge_heads_forward(y)), us(kernel_row)
            print(f"  [{vname}] kernel {plain:.1f} us, kernel + row {row:.1f} us", flush=True)


if __name__ == "__main__":
    main()
