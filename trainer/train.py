"""Training loop: ``python -m fp8mon.trainer.train`` or ``fp8mon train`` (``--help`` lists the flags).

    fp8mon train --arch fog --precision fp8 --config tiny --steps 200 --monitor-url http://127.0.0.1:8080
    torchrun --nproc_per_node 8 -m fp8mon.trainer.train --arch llama --precision fp8 --config 1.5b --data tokens.bin

One optimizer step: ``--grad-accum`` micro-batches of ``--batch-size`` sequences per rank (forward under
autocast for bf16/fp8, backward), gradients averaged over ranks by DDP (``--fsdp``: FSDP2), clipped to ``--clip``, AdamW
(fp32 master weights, decoupled weight decay on matrices), then ``agent.log`` with the step's loss (mean
over micro-batches and ranks), grad_norm, lr and tokens_per_s. Losses are read on the host every
``--log-every`` steps and before each checkpoint (one sync); a non-finite loss or gradient norm stops the
run as "diverged" (exit code 3), without a checkpoint.

``--cuda-graph`` (one GPU) runs ``train_step`` through ``trainer.graphs.StepGraphs``: each kind of step (the agent
reporting or not, with or without the histogram) runs eagerly once, is then captured as a CUDA graph and replayed
from static batch buffers, with the learning rate as a device tensor, so the host's per-launch cost is paid once.

Checkpoints (``--out DIR``: DIR/ckpt.pt every ``--save-every`` steps and at the end) hold the model, the
optimizer, the step, the RNG states and the data position (= the step: batches are a function of
(seed, step, micro-batch index), see trainer/data.py), so ``--resume`` continues bit-identically on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .clip import clip_grad_norm
from .config import ARCHS, CONFIGS, PRECISIONS, get_config
from .data import TokenData
from .model import Transformer, autocast

DEFAULT_LR = {"tiny": 2e-3, "124m": 6e-4, "1.5b": 2.5e-4}
EXIT_DIVERGED = 3


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train the fp8mon decoder-only LM (llama or FOG) in "
                                "fp8, bf16 or fp32, optionally streaming health statistics to a monitor.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--arch", choices=ARCHS, default="llama")
    m.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="fp8: block GEMMs in FP8 (Fp8Linear), the rest in bf16 autocast")
    m.add_argument("--config", choices=list(CONFIGS), default="tiny")
    m.add_argument("--n-layer", type=int, help="override the config's layer count")
    m.add_argument("--d-model", type=int, help="override the config's width")
    m.add_argument("--n-head", type=int, help="override the config's head count")
    m.add_argument("--d-ff", type=int, help="override the config's SwiGLU hidden width (FOG: x1.5)")
    m.add_argument("--no-qk-norm", action="store_true", help="fog: drop the QK-RMSNorm of attention (an "
                   "ablation that lets attention logits grow; llama has none)")
    m.add_argument("--vocab-size", type=int, help="default: 256 for text, max token id + 1 (rounded to 64) "
                                                  "for a token file")
    t = p.add_argument_group("optimisation")
    t.add_argument("--steps", type=int, default=200, help="optimizer steps (the schedule's length)")
    t.add_argument("--stop-at", type=int, help="stop after this step count without changing the schedule "
                                               "(run a long schedule in chunks with --resume)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--seq-len", type=int, help="default: the config's")
    t.add_argument("--lr", type=float, help=f"peak learning rate; default per config {DEFAULT_LR}")
    t.add_argument("--min-lr", type=float, help="final learning rate; default lr/10")
    t.add_argument("--warmup", type=int, help="linear warm-up steps; default steps/20")
    t.add_argument("--schedule", choices=("cosine", "wsd", "constant"), default="cosine",
                   help="cosine decay to min-lr, warmup-stable-decay (linear decay over --decay-frac), or constant "
                        "lr after the warm-up")
    t.add_argument("--decay-frac", type=float, default=0.2, help="WSD: fraction of the steps spent decaying")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("BETA1", "BETA2"))
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    t.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data")
    d.add_argument("--data", help="UTF-8 text file (byte-level) or uint16 token file (.bin/.u16); "
                                  "default: the built-in Shakespeare corpus")
    d.add_argument("--data-format", choices=("auto", "text", "u16"), default="auto")
    d.add_argument("--val-fraction", type=float, default=0.1)
    d.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (0: only at the end "
                                                              "when --eval-batches > 0)")
    d.add_argument("--eval-batches", type=int, default=0)
    o = p.add_argument_group("checkpoints and output")
    o.add_argument("--out", help="directory for ckpt.pt")
    o.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and always at the end)")
    o.add_argument("--resume", nargs="?", const="auto", help="checkpoint file or directory (default: --out)")
    o.add_argument("--log-every", type=int, default=10, help="read losses on the host (one sync) every N steps")
    o.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    a = p.add_argument_group("monitor")
    a.add_argument("--monitor-url", default=os.environ.get("FP8MON_URL"), help="attach the fp8mon agent "
                                                                                "(env FP8MON_URL)")
    a.add_argument("--run-name", default=os.environ.get("FP8MON_RUN"), help="default: arch-precision-config-time")
    a.add_argument("--monitor-every", type=int, default=10, help="statistics every N steps")
    a.add_argument("--monitor-hist-every", type=int, default=10,
                   help="the log2 histogram on every N-th reporting step only (the costliest statistic)")
    a.add_argument("--monitor-modules", default=r"^blocks\.", help="regex on module names to watch")
    a.add_argument("--monitor-token", default=os.environ.get("FP8MON_TOKEN"))
    a.add_argument("--monitor-spool", help="agent spool directory (default ~/.cache/fp8mon/spool/<run>)")
    a.add_argument("--monitor-reduce-ranks", action="store_true",
                   help="under torchrun: merge all ranks' statistics into one record per step (rank -1), sent by "
                        "rank 0, instead of each rank sending its own")
    a.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="run tag (repeatable)")
    f = p.add_argument_group("fp8")
    f.add_argument("--fp8-scaling", choices=("current", "delayed"), default="current")
    f.add_argument("--amax-history", type=int, default=1024, help="delayed scaling: amax history length")
    f.add_argument("--fp8-margin", type=int, default=0)
    f.add_argument("--fp8-freeze-scale-after", type=int, default=0, metavar="N",
                   help="delayed scaling: stop refreshing each scale after its first N steps (static scales, or a "
                   "history that stopped updating); 0: never. Runs on the torch FP8 path")
    f.add_argument("--fp8-backend", choices=("auto", "triton", "torch"), default="auto",
                   help="the FP8 linears' kernels: auto (Triton on CUDA sm89+, else torch), or one of them")
    f.add_argument("--fp8-no-saturate", action="store_true", help="cast overflows to NaN/Inf as torch's own float8 "
                   "conversion does, instead of saturating (an FP8 stack that forgets to clamp); torch FP8 path")
    s = p.add_argument_group("system")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (torchrun: cuda:LOCAL_RANK)")
    s.add_argument("--threads", type=int, help="torch intra-op CPU threads")
    s.add_argument("--compile", action="store_true", help="torch.compile the model")
    s.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard weights, gradients and optimizer state with FSDP2 (fully_shard per "
                        "block and at the root) instead of replicating them with DDP; without checkpoints (--out, "
                        "--resume) or --cuda-graph")
    s.add_argument("--cuda-graph", action="store_true",
                   help="capture each kind of optimizer step (the agent reporting or not, with or without the "
                        "histogram) as a CUDA graph after its first eager step, and replay it: the host's per-launch "
                        "cost is paid once (one GPU, no --compile)")
    return p


@dataclass
class TrainResult:
    status: str = "running"          # finished | diverged | failed
    start_step: int = 0
    step: int = 0                    # steps completed (the next step to run)
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float | None = None
    run_name: str | None = None
    rank: int = 0
    world_size: int = 1
    model: Transformer | None = field(default=None, repr=False)  # the trained (unwrapped) model


# ---- pieces ---------------------------------------------------------------------------------------

def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, steps: int, schedule: str,
          decay_frac: float = 0.2) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    decay_start = max(warmup, steps - int(round(decay_frac * steps)))
    if step < decay_start:
        return lr
    return lr + (min_lr - lr) * min(1.0, (step - decay_start) / max(1, steps - decay_start))


def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world, device); initialises the process group under torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_arg)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def fp8_recipe(args):
    from .fp8_linear import Fp8Recipe

    try:
        return Fp8Recipe(scaling=args.fp8_scaling, amax_history_len=args.amax_history, margin=args.fp8_margin,
                         freeze_scale_after=args.fp8_freeze_scale_after, saturate=not args.fp8_no_saturate)
    except ValueError as exc:
        raise SystemExit(f"fp8 flags: {exc}") from None


def _json_safe(value):
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def resolve_checkpoint(args) -> Path | None:
    """--resume PATH (a ckpt file or a directory holding ckpt.pt), or bare --resume: --out's checkpoint."""
    if args.resume is None:
        return None
    if args.resume == "auto":
        if not args.out:
            raise SystemExit("--resume without a path needs --out")
        path = Path(args.out)
    else:
        path = Path(args.resume)
    return path if path.suffix == ".pt" else path / "ckpt.pt"


def save_checkpoint(path: Path, model: Transformer, optimizer, next_step: int, args) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": next_step,
        "arch": model.arch,
        "model_config": model.cfg.to_dict(),
        "args": {k: _json_safe(v) for k, v in vars(args).items()},
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "data": {"seed": args.seed, "next_step": next_step, "grad_accum": args.grad_accum},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def load_checkpoint(path: Path, model: Transformer, optimizer, args) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["arch"] != model.arch or state["model_config"] != model.cfg.to_dict():
        raise SystemExit(f"{path}: checkpoint of a {state['arch']} {state['model_config']} model, "
                         f"not {model.arch} {model.cfg.to_dict()}")
    if state["data"]["seed"] != args.seed or state["data"]["grad_accum"] != args.grad_accum:
        print(f"warning: resuming with seed/grad-accum {args.seed}/{args.grad_accum}, checkpoint had "
              f"{state['data']['seed']}/{state['data']['grad_accum']}: the data order differs", file=sys.stderr)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["step"])


@torch.no_grad()
def evaluate(model: Transformer, data: TokenData, args, device) -> float:
    """Mean loss over a fixed set of --eval-batches validation batches."""
    was_training = model.training
    model.eval()
    model.set_diagnostics(False)
    total = 0.0
    for i in range(args.eval_batches):
        x, y = data.batch("val", args.batch_size, args.seq_len, seed=args.seed, step=0, index=i, device=device)
        with autocast(args.precision, device):
            total += model(x, y).item()
    model.train(was_training)
    return total / args.eval_batches


class Progress:
    """tqdm when installed (and wanted), else a plain line every --log-every steps."""

    def __init__(self, total: int, initial: int, enabled: bool, plain: bool):
        self.enabled, self.bar = enabled, None
        if enabled and not plain:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass
        self.total = total

    def update(self, step: int, n: int, loss: float, lr: float, tps: float, ms: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {tps:,.0f} tok/s {ms:.1f} ms/step")
        else:
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s  {ms:.1f} ms/step",
                  flush=True)

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        (self.bar.write if self.bar is not None else print)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _default_run_name(args, world: int) -> str:
    name = f"{args.arch}-{args.precision}-{args.config}-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    if world > 1:  # every rank must send under rank 0's name
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


def make_agent(args, model: Transformer, run_name: str, rank: int, world: int, start_step: int):
    from fp8mon.agent import Agent  # the agent only when asked for

    tags = {"arch": args.arch, "precision": args.precision, "config": args.config, "world_size": str(world)}
    for item in args.tag:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--tag {item!r}: expected KEY=VALUE")
        tags[key] = value
    config = {"model": model.cfg.to_dict(), "params": model.num_params(), "world_size": world,
              "train": {k: _json_safe(v) for k, v in vars(args).items()
                        if k not in ("monitor_token", "tag")}}
    agent = Agent(args.monitor_url, run=run_name, token=args.monitor_token, every=args.monitor_every,
                  hist_every=args.monitor_hist_every, modules=args.monitor_modules, scaling=args.fp8_scaling,
                  amax_history_len=args.amax_history, margin=args.fp8_margin, config=config, tags=tags,
                  spool_dir=args.monitor_spool, reduce_ranks=args.monitor_reduce_ranks,
                  resume="allow" if start_step else "never")  # a checkpoint's training continues its run
    agent.watch(model)
    if start_step:
        agent.step(start_step)
    return agent


def train_step(model, raw: Transformer, optimizer, params, batches, args, world: int, agent=None):
    """One optimizer step over the micro-batches ``batches`` ((x, y) pairs), watched by ``agent`` if given:
    (mean loss over micro-batches and ranks, gradient norm before clipping, the model's diagnostics), all device
    tensors, nothing read on the host (``StepGraphs`` captures this function)."""
    loss_sum = torch.zeros((), device=params[0].device)
    for micro in range(args.grad_accum):
        x, y = batches[micro]
        last = micro == args.grad_accum - 1
        # (DDP: one all-reduce per step; FSDP2 reduce-scatters each micro-batch's gradients, holding only shards)
        with (model.no_sync() if world > 1 and not last and hasattr(model, "no_sync") else contextlib.nullcontext()):
            with autocast(args.precision, x.device):
                loss = model(x, y)
            (loss / args.grad_accum).backward()
        loss_sum += loss.detach()
    # (with an agent on one rank, the norms of the gradients it has just read come from its rows: trainer.clip)
    grad_norm = clip_grad_norm(params, args.clip if args.clip > 0 else float("inf"), agent if world == 1 else None)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over all shards, as a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_loss = loss_sum / args.grad_accum
    if world > 1:  # the same loss on every rank: all stop together on divergence
        dist.all_reduce(step_loss)
        step_loss /= world
    return step_loss, grad_norm, raw.diagnostics()


# ---- the loop -------------------------------------------------------------------------------------

def _build(args, device: torch.device, world: int):
    """(data, model, the model as trained (DDP, compiled), optimizer, checkpoint path, first step, last step + 1) of a
    run; ``args``' defaults that follow from the config are filled in, a checkpoint to resume from is loaded."""
    data = TokenData.from_path(args.data, args.data_format, val_fraction=args.val_fraction,
                               vocab_size=args.vocab_size)
    cfg = get_config(args.config, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head, d_ff=args.d_ff,
                     seq_len=args.seq_len, vocab_size=data.vocab_size)
    args.seq_len = cfg.seq_len
    args.lr = DEFAULT_LR[args.config] if args.lr is None else args.lr
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.warmup = max(1, args.steps // 20) if args.warmup is None else args.warmup
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)

    fsdp = getattr(args, "fsdp", False)
    if fsdp and (args.out or args.resume or args.cuda_graph):
        raise SystemExit("--fsdp: without --out, --resume or --cuda-graph")
    if fsdp and world == 1:
        raise SystemExit("--fsdp: under torchrun with 2 ranks or more")
    torch.manual_seed(args.seed)  # same initial weights on every rank
    recipe = fp8_recipe(args) if args.precision == "fp8" else None
    raw = Transformer(cfg, args.arch, args.precision, recipe,
                      qk_norm=False if getattr(args, "no_qk_norm", False) else None).to(device)
    if fsdp:  # before the optimizer: sharding replaces the parameters (by DTensors)
        from torch.distributed.fsdp import fully_shard

        for block in raw.blocks:
            fully_shard(block)
        fully_shard(raw)
    optimizer = torch.optim.AdamW(raw.param_groups(args.weight_decay), lr=args.lr, betas=tuple(args.betas),
                                  eps=args.adam_eps, fused=device.type == "cuda")
    if args.precision == "fp8":  # the micro-batches of a step reuse each FP8 weight cast
        from .fp8_linear import Fp8Linear, cache_fp8_weights

        cache_fp8_weights(raw, optimizer)
        for m in raw.modules():
            if isinstance(m, Fp8Linear):
                m.backend = getattr(args, "fp8_backend", "auto")
    ckpt = Path(args.out) / "ckpt.pt" if args.out else None
    start = 0
    resume_from = resolve_checkpoint(args)
    if resume_from is not None:
        if resume_from.exists():
            start = load_checkpoint(resume_from, raw, optimizer, args)
        elif args.resume != "auto":
            raise SystemExit(f"--resume {resume_from}: no such checkpoint")
    if args.cuda_graph and (device.type != "cuda" or world > 1 or args.compile):
        raise SystemExit("--cuda-graph needs one CUDA device and no --compile")
    model = raw
    if world > 1 and not fsdp:
        # buffers (RoPE tables, frozen QK gains) never change: no per-forward broadcast
        model = DDP(raw, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    if args.compile:
        model = torch.compile(model)
    return data, raw, model, optimizer, ckpt, start, stop


def run(args) -> TrainResult:
    rank, world, device = setup_distributed(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    master = rank == 0
    result = TrainResult(rank=rank, world_size=world)

    data, raw, model, optimizer, ckpt, start, stop = _build(args, device, world)
    result.start_step = result.step = start
    result.model = raw

    run_name = args.run_name or _default_run_name(args, world)
    result.run_name = run_name
    agent = make_agent(args, raw, run_name, rank, world, start) if args.monitor_url else None

    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    progress = Progress(args.steps, start, enabled=master, plain=args.no_progress)
    if master:
        progress.write(f"{args.arch} {args.precision} {args.config}: {raw.num_params() / 1e6:.2f}M parameters, "
                       f"{world} rank(s) on {device}, {tokens_per_step:,} tokens/step, steps {start}..{stop}"
                       + (f", monitor {args.monitor_url} run {run_name}" if agent else ""))
    params = [p for p in raw.parameters() if p.requires_grad]
    graphs = lr_tensor = None
    if args.cuda_graph:  # the graphs read each step's micro-batches from these buffers
        from .graphs import StepGraphs, tensor_lr

        lr_tensor = tensor_lr(optimizer, device)
        shape = (args.batch_size, args.seq_len)
        static = [(torch.zeros(shape, dtype=torch.long, device=device),
                   torch.zeros(shape, dtype=torch.long, device=device)) for _ in range(args.grad_accum)]
        graphs = StepGraphs(lambda: train_step(model, raw, optimizer, params, static, args, world, agent), agent=agent,
                            warmup=1)
    pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [loss, grad_norm]) not yet read
    t_last, steps_since = time.perf_counter(), 0
    status = "failed"
    try:
        model.train()
        for step in range(start, stop):
            lr = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, steps=args.steps,
                       schedule=args.schedule, decay_frac=args.decay_frac)
            if lr_tensor is not None:
                lr_tensor.fill_(lr)
            else:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            diagnose = agent is not None and step % args.monitor_every == 0
            raw.set_diagnostics(diagnose)
            batches = [data.batch("train", args.batch_size, args.seq_len, seed=args.seed, step=step,
                                  index=rank * args.grad_accum + micro, device=device)
                       for micro in range(args.grad_accum)]
            if graphs is None:
                step_loss, grad_norm, diagnostics = train_step(model, raw, optimizer, params, batches, args, world,
                                                               agent)
            else:
                for (x, y), (sx, sy) in zip(batches, static):
                    sx.copy_(x)
                    sy.copy_(y)
                step_loss, grad_norm, diagnostics = graphs(diagnose)
            if agent is not None:
                agent.log(step, loss=step_loss, grad_norm=grad_norm, lr=lr, tokens_per_s=result.tokens_per_s,
                          **diagnostics)
            pending.append((step, lr, torch.stack((step_loss, grad_norm.to(step_loss.device).float()))))
            steps_since += 1
            result.step = step + 1

            # Read the losses at the same steps on every rank (a rank that stops alone would hang the others),
            # and before each checkpoint: never save weights that a NaN has not been looked for in.
            saving = bool(ckpt and args.save_every and result.step % args.save_every == 0)
            if result.step % args.log_every == 0 or result.step == stop or saving:
                values = torch.stack([v for _, _, v in pending]).tolist()  # the one host sync
                now = time.perf_counter()
                elapsed, t_last = now - t_last, now
                result.tokens_per_s = tokens_per_step * steps_since / elapsed
                for (s, _, _), (l_, g_) in zip(pending, values):
                    result.losses[s], result.grad_norms[s] = l_, g_
                bad = next((s for s, _, _ in pending
                            if not (math.isfinite(result.losses[s]) and math.isfinite(result.grad_norms[s]))), None)
                progress.update(step, steps_since, values[-1][0], lr, result.tokens_per_s,
                                1000 * elapsed / steps_since)
                pending, steps_since = [], 0
                if bad is not None:
                    status = "diverged"
                    good = [s for s in result.losses if s < bad and math.isfinite(result.losses[s])]
                    progress.write(f"DIVERGED: loss {result.losses[bad]}, grad norm {result.grad_norms[bad]} "
                                   f"at step {bad}"
                                   + (f" (last finite loss {result.losses[good[-1]]:.4f} at step {good[-1]})"
                                      if good else "") + "; stopping, no checkpoint written.")
                    break

            if args.eval_every and result.step % args.eval_every == 0 and args.eval_batches:
                result.val_losses[step] = evaluate(raw, data, args, device)
                progress.write(f"step {result.step}: val loss {result.val_losses[step]:.4f}")
                if agent is not None:
                    agent.log(step, val_loss=result.val_losses[step])
            if master and saving and result.step < stop:
                save_checkpoint(ckpt, raw, optimizer, result.step, args)
        else:
            status = "finished"
            if args.eval_batches and (stop - 1) not in result.val_losses and stop > start:
                result.val_losses[stop - 1] = evaluate(raw, data, args, device)
                progress.write(f"val loss {result.val_losses[stop - 1]:.4f}")
                if agent is not None:
                    agent.log(stop - 1, val_loss=result.val_losses[stop - 1])
            if master and ckpt:
                save_checkpoint(ckpt, raw, optimizer, result.step, args)
    finally:
        progress.close()
        result.status = status
        raw.set_diagnostics(False)
        if agent is not None:
            agent.close(status=status)
            result.run_name = agent.status().run or result.run_name  # a taken name gets a suffix (Agent's resume)
            if agent.errors and master:
                print(f"fp8mon agent: {agent.errors} error(s), last: {agent.last_error}", file=sys.stderr)
    if master:
        _summary(result, ckpt)
    return result


def _summary(result: TrainResult, ckpt: Path | None) -> None:
    """The run's last line: how it ended, its last loss and speed, and its checkpoint."""
    last = result.losses.get(result.step - 1)
    print(f"{result.status}: {result.step} steps" + (f", loss {last:.4f}" if last is not None else "")
          + (f", {result.tokens_per_s:,.0f} tok/s" if result.tokens_per_s else "")
          + (f", checkpoint {ckpt}" if ckpt and result.status == "finished" else ""), flush=True)


def end_distributed(succeeded: bool) -> None:
    """Tear the process group down (if any) before the process exits: a process that exits with it alive, or with
    FSDP2's modules still holding its collectives' state, can abort at exit."""
    if not dist.is_initialized():
        return
    gc.collect()  # the run's modules (FSDP2's, with their collectives' state) go while the group still works
    if succeeded:
        # every rank done with its collectives before any tears the group down: a rank whose peer has gone while a
        # gloo operation is in flight aborts the process (only on success: a failed rank must not wait here for
        # peers that wait for it)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    succeeded = False
    try:
        result = run(args)
        status = result.status
        del result  # (its model) before the teardown's gc.collect
        succeeded = True
    finally:
        end_distributed(succeeded)
    return EXIT_DIVERGED if status == "diverged" else 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m fp8mon.trainer.train"))
