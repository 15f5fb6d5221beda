"""Host time of the collector's decoding of one reporting step (rows -> wire block), which runs on the
agent's background thread and shares the GIL with the training loop.

    python bench/collector_block.py        # 240 rows with histograms (a GPT-124M step, five sites)

The rows are real ``device_stats.partials`` rows; the transport is a stub that keeps the blocks.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import torch_path as ds  # noqa: E402
from fp8mon.agent.collector import Collector, Job  # noqa: E402

SITES = ("input", "weight", "output", "grad_output", "grad_weight")


class _Keep:
    def __init__(self):
        self.blocks = []

    def send_tensors(self, block):
        self.blocks.append(block)

    def send_scalars(self, block):
        self.blocks.append(block)


def main(nrows: int = 240, reps: int = 50) -> None:
    g = torch.Generator().manual_seed(0)
    base = [ds.partials(torch.randn(4096, generator=g) * (i + 1), fmt="e4m3" if i % 2 else None,
                        scale=2.0 if i % 2 else None) for i in range(8)]
    host = torch.stack([base[i % 8] for i in range(nrows)]).reshape(-1)
    keys = [(f"blocks.{i // 20}.linear{i % 4}", SITES[i % 5]) for i in range(nrows)]
    sink = _Keep()
    collector = Collector(sink)
    try:
        def once():
            collector._process(Job(step=1, rank=0, host=host, keys=keys, scalars={"loss": 2.5}))
        once()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        ms = (time.perf_counter() - t0) / reps * 1e3
    finally:
        collector.close(5)
    print(f"collector: {ms:.2f} ms per reporting step of {nrows} rows (decode + wire block), "
          f"{len(sink.blocks[0]['layer'])} records")


if __name__ == "__main__":
    main()
