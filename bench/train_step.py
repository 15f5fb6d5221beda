"""Training throughput, FP8 vs bf16, on the same model in one process: tokens/s of a whole optimizer step
(``--grad-accum`` forwards under autocast and backwards, gradient clipping, fused AdamW) of trainer/model.py.

    python3 bench/train_step.py --configs 124m,1.5b            # on a GPU
    python3 bench/train_step.py --configs tiny --device cpu --steps 3 --warmup 1   # smoke test

Both precisions use the same code path as `fp8mon train`: the fp8 model's block linears are Fp8Linear
(Triton kernels on a GPU: quantize, quantize-transpose, FP8 GEMMs in the forward and both backward GEMMs),
embeddings, attention, norms and the LM head stay in bf16 autocast in both. Precisions alternate within a
round (fp8, bf16, then bf16, fp8 in the next round), each measured after its own warm-up (Triton's
autotuning happens there), and the ratio is taken per round: clock and thermal drift between rounds do
not enter a ratio. Prints one line per measurement and a summary per config, and appends the figures to
bench/results/train_step.csv (bench/record.py; ``--no-record`` skips it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import Recorder  # noqa: E402
from fp8mon.trainer.clip import clip_grad_norm  # noqa: E402
from fp8mon.trainer.config import get_config  # noqa: E402
from fp8mon.trainer.fp8_linear import Fp8Recipe, cache_fp8_weights  # noqa: E402
from fp8mon.trainer.model import Transformer, autocast  # noqa: E402

BATCH = {"tiny": 8, "124m": 16, "1.5b": 4}  # sequences per step at the config's seq_len (124m: 16 x 1024)


def build(config: str, arch: str, precision: str, vocab: int, scaling: str, device: torch.device):
    cfg = get_config(config, vocab_size=vocab)
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling=scaling) if precision == "fp8" else None
    model = Transformer(cfg, arch, precision, recipe).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda")
    if precision == "fp8":  # as fp8mon train: the micro-batches of a step reuse each FP8 weight cast
        cache_fp8_weights(model, optimizer)
    return model, optimizer, cfg


def optimizer_step(model, optimizer, params, precision: str, x, y, grad_accum: int = 1, agent=None) -> torch.Tensor:
    """One whole optimizer step as `fp8mon train` takes it: `grad_accum` forwards under autocast and backwards,
    gradient clipping (the norms of the gradients ``agent`` read come from its rows, ``trainer.clip``), AdamW.
    Returns the last micro-batch's loss."""
    for _ in range(grad_accum):
        with autocast(precision, x.device):
            loss = model(x, y)
        (loss / grad_accum).backward()
    clip_grad_norm(params, 1.0, agent)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def measure(config: str, arch: str, precision: str, args, device: torch.device) -> dict:
    model, optimizer, cfg = build(config, arch, precision, args.vocab, args.scaling, device)
    batch = args.batch_size or BATCH[config]
    seq = cfg.seq_len
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    step_fn = torch.compile(model) if args.compile else model

    def step():
        return optimizer_step(step_fn, optimizer, params, precision, x, y, args.grad_accum)

    for _ in range(args.warmup):
        step()
    times = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    loss_value = float(loss.detach())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del model, optimizer, x, y, params, step_fn
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    median = statistics.median(times)
    tokens = batch * seq * args.grad_accum
    return {"precision": precision, "step_s": median, "tokens_per_s": tokens / median, "loss": loss_value,
            "peak_gib": peak, "tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="124m,1.5b", help="comma-separated trainer configs")
    p.add_argument("--arch", default="llama", choices=["llama", "fog"])
    p.add_argument("--scaling", default="current", choices=["current", "delayed"])
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default per config: {BATCH})")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary (GPT-2's, padded to 64)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="fp8/bf16 pairs per config, order alternating")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (both precisions)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/train_step.csv")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    else:
        print(f"# CPU, torch {torch.__version__} (the FP8 reference path: no speed-up expected)", flush=True)
    failed = False
    rec = Recorder("train_step")
    for config in args.configs.split(","):
        ratios = []
        for r in range(args.rounds):
            order = ("fp8", "bf16") if r % 2 == 0 else ("bf16", "fp8")
            got = {}
            for precision in order:
                m = measure(config, args.arch, precision, args, device)
                got[precision] = m
                print(f"{config:>5} {args.arch} {precision:>4} round {r}: {m['step_s'] * 1e3:8.1f} ms/step "
                      f"{m['tokens_per_s']:>10,.0f} tok/s  ({m['tokens']} tokens/step, loss {m['loss']:.3f}, "
                      f"peak {m['peak_gib']:.1f} GiB)", flush=True)
            ratios.append(got["fp8"]["tokens_per_s"] / got["bf16"]["tokens_per_s"])
            for precision, m in got.items():
                rec.add(f"step_ms/{config}/{precision}/round{r}", m["step_s"] * 1e3, "ms")
                rec.add(f"tokens_per_s/{config}/{precision}/round{r}", m["tokens_per_s"], "tokens/s")
            rec.add(f"tokens_per_s_ratio_fp8_to_bf16/{config}/round{r}", ratios[-1], "ratio")
            # a throughput of an FP8 model that does not learn is no result (the batch repeats: both fit it)
            if not got["fp8"]["loss"] <= 2 * got["bf16"]["loss"] + 0.5:
                failed = True
                print(f"{config:>5} FAIL: the fp8 loss {got['fp8']['loss']:.3f} does not track bf16's "
                      f"{got['bf16']['loss']:.3f}", flush=True)
        print(f"{config:>5} {args.arch}: fp8/bf16 tokens/s = " + ", ".join(f"{q:.3f}" for q in ratios)
              + f" (per round; median {statistics.median(ratios):.3f})", flush=True)
        for precision, m in got.items():
            rec.add(f"loss/{config}/{precision}", m["loss"], "nats")
    if args.record and rec.rows:
        rec.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
