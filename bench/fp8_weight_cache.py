"""Does FP8 weight caching change training? Losses of the tiny Llama with delayed scaling over optimizer
steps of several micro-batches (bench/train_step.py's optimizer_step: clipping, AdamW): bf16, fp8 casting the weight every micro-batch, fp8 with
``cache_fp8_weights``, and fp8 with caching that also reuses a module's very first cast (made with an empty
amax history, scale 1), which ``cache_fp8_weights`` does not do. CPU (the torch FP8 path) or GPU.

    python bench/fp8_weight_cache.py                # CPU: 8 steps of 4 micro-batches
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.train_step import optimizer_step  # noqa: E402
from fp8mon.trainer.config import get_config  # noqa: E402
from fp8mon.trainer.fp8_linear import Fp8Linear, Fp8Recipe, cache_fp8_weights  # noqa: E402
from fp8mon.trainer.model import Transformer  # noqa: E402


def losses(mode: str, steps: int, micro: int, device: torch.device) -> list[float]:
    cfg = get_config("tiny", vocab_size=256)
    torch.manual_seed(0)
    precision = "bf16" if mode == "bf16" else "fp8"
    model = Transformer(cfg, "llama", precision, Fp8Recipe(scaling="delayed") if precision == "fp8" else None)
    model.to(device)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, fused=device.type == "cuda")
    if mode in ("cache", "cache-first"):
        cache_fp8_weights(model, opt)
        if mode == "cache-first":  # pretend the first cast was already made: it is reused
            for m in model.modules():
                if isinstance(m, Fp8Linear):
                    m.fp8_weight_cache[1] = 1
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, 256, (4, cfg.seq_len), generator=g).to(device)
    params = [q for q in model.parameters() if q.requires_grad]
    return [float(optimizer_step(model, opt, params, precision, x, y, micro).detach()) for _ in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    runs = {mode: losses(mode, args.steps, args.micro, device) for mode in ("bf16", "nocache", "cache", "cache-first")}
    for mode, ls in runs.items():
        print(f"{mode:12} " + " ".join(f"{v:.4f}" for v in ls))
    base = runs["nocache"]
    for mode in ("cache", "cache-first"):
        worst = max(abs(a - b) / b for a, b in zip(runs[mode], base))
        print(f"{mode} vs nocache: largest relative loss difference {100 * worst:.3f}%")


if __name__ == "__main__":
    main()
