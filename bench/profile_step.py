"""Where a training step's GPU time goes, FP8 against bf16: torch.profiler's CUDA kernel table for two whole
optimizer steps of the trainer's model (built and stepped as bench/train_step.py does), after four warm-up steps.

    python3 bench/profile_step.py --config 1.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import BATCH, build, optimizer_step  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="1.5b")
    p.add_argument("--arch", default="llama", choices=["llama", "fog"])
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default per config: {BATCH})")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rows", type=int, default=28, help="kernels listed per precision")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    for precision in ("fp8", "bf16"):
        model, optimizer, cfg = build(args.config, args.arch, precision, args.vocab, "current", device)
        batch = args.batch_size or BATCH[args.config]
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        params = [q for q in model.parameters() if q.requires_grad]
        for _ in range(4):
            optimizer_step(model, optimizer, params, precision, x, y)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                optimizer_step(model, optimizer, params, precision, x, y)
            torch.cuda.synchronize()
        print(f"===== {precision} ({args.config}, two steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        del model, optimizer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
