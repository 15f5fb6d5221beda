"""The agent on several GPUs under torchrun: nanoGPT's GPT-2 124M (bench/models/gpt2.py; float8: torchao's
``convert_to_float8_training``, the lm_head left in bf16, skipped when torchao cannot be imported or on a CPU) or,
with ``--model fp8mon``, ``fp8mon train``'s llama 124m (float8: its Fp8Linear, Triton FP8 GEMMs on a GPU, the agent
watching its blocks), trained with DDP or FSDP2 (``fully_shard`` per block and at the root), bf16 autocast, AdamW;
one copy of the model per mode:

    off      no monitoring
    on       fp8mon's Agent, every ``nn.Linear`` x 5 sites, each rank sending its own records (to a transport that
             counts and drops them: all the agent does but encode and post)
    reduce   the same with ``reduce_ranks=True``: every reporting step merges all ranks' rows (three all_reduces)
             and rank 0 alone sends

at ``--every`` 1 and 10. Each copy takes its warm-up steps, then ``--rounds`` rounds of ``--steps`` steps each (whole
cycles of every), the copies in turn, the order reversed every other round. A rank's figure is the median over rounds
of its round's mean step time (CUDA events; the host's clock on a CPU); the printed figure is the slowest rank's.
Overhead = that / the off copy's - 1. Tokens/s = batch x sequence x ranks / step time; the float8 copy's against the
bf16 one's (the off copies) is the FP8 speed-up at this number of ranks: run with 1 process for the base line.

Checks: after the rounds, one reporting step (with the histogram) of the ``reduce`` copy at every 1: every merged row
of the step against the fp64 pairwise merge of all ranks' rows (exact), and the merged input and output records of
one layer (GPT-2's ``transformer.h.0.mlp.c_fc``, the llama's ``blocks.0.mlp.fc1``) against the fp64 statistics of
the ranks' concatenated tensors (``Moments.from_tensor``; moments to 1e-5: a GPU rank's row sums fp32 partials).
outlier_frac, underflow_frac, overflow_frac and scale are per rank by design (docs/agent.md) and are not compared.

On N GPUs (NCCL; figures appended to bench/results/multi_gpu.csv unless ``--no-record``):

    torchrun --nproc-per-node 8 bench/multi_gpu.py --wrap ddp       # one wrap per command: 5 copies x 2 precisions
    torchrun --nproc-per-node 8 bench/multi_gpu.py --wrap fsdp
    torchrun --nproc-per-node 1 bench/multi_gpu.py --wrap ddp --modes off   # the 1-GPU base line of tokens/s

On CPUs (gloo), tiny (2 layers, d 64, seq 64, batch 2):

    torchrun --nproc-per-node 2 bench/multi_gpu.py --tiny --device cpu --steps 2 --rounds 1 --no-record
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.external import TINY_GPT, Clock, CountingTransport, check_rounds_args, make_batch, own_compile, to_float8  # noqa: E402
from bench.record import Recorder  # noqa: E402

MODES = ("off", "on", "reduce")
CHECKED_LAYER = {"gpt2": "transformer.h.0.mlp.c_fc", "fp8mon": "blocks.0.mlp.fc1"}
WATCHED = {"gpt2": None, "fp8mon": r"^blocks\."}  # the agent's modules: every linear; fp8mon train's default
PER_RANK = {"outlier_frac", "underflow_frac", "overflow_frac", "scale", "amax_history_max"}
HEADER = (f"{'configuration':<34} {'copy':<10} {'step ms':>9} {'overhead':>9} {'tokens/s':>11} {'rows':>6} "
          f"{'errors':>6}")


class KeepingTransport(CountingTransport):
    """Counts each step's rows and keeps the blocks of the steps in ``keep``."""

    def __init__(self):
        super().__init__()
        self.keep: set[int] = set()
        self.blocks: list[dict] = []

    def send_tensors(self, block) -> None:
        super().send_tensors(block)
        if int(block["step"]) in self.keep:
            self.blocks.append(block)


@dataclass
class Runner:
    """One copy of the model: wrapped, with its optimizer and (mode on/reduce) its agent."""

    mode: str
    every: int
    wrap: str
    precision: str
    args: argparse.Namespace
    device: torch.device
    batch: tuple
    step_no: int = 0
    round_means: list[float] = field(default_factory=list)

    def __post_init__(self):
        torch.manual_seed(0)
        raw, blocks = self.build()
        self.raw = raw
        self.linears = sum(type(m).__name__ in ("Linear", "Float8Linear", "Fp8Linear")
                           for m in raw.modules() if m is not getattr(raw, "head", None))
        if self.wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(raw, device_ids=ids)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in blocks:
                fully_shard(block)
            self.model = fully_shard(raw)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        if self.args.model == "fp8mon" and self.precision == "float8":  # as `fp8mon train` does
            from fp8mon.trainer.fp8_linear import cache_fp8_weights

            cache_fp8_weights(raw, self.optimizer)
        if self.args.compile:
            self.model = own_compile(self.model)
        self.agent = self.transport = None
        if self.mode != "off":
            from fp8mon import Agent

            self.transport = KeepingTransport()
            self.agent = Agent(transport=self.transport, every=self.every, reduce_ranks=self.mode == "reduce",
                               modules=WATCHED[self.args.model])
            self.agent.watch(self.model)

    def build(self) -> tuple[nn.Module, list[nn.Module]]:
        """(the model, its blocks) on the device."""
        if self.args.model == "fp8mon":
            from fp8mon.trainer.config import get_config
            from fp8mon.trainer.model import Transformer

            cfg = get_config("tiny" if self.args.tiny else "124m", vocab_size=vocab_size(self.args))
            with self.device:
                raw = Transformer(cfg, "llama", "fp8" if self.precision == "float8" else "bf16")
            return raw, list(raw.blocks)
        from bench.models.gpt2 import GPT, GPTConfig

        with self.device:
            raw = GPT(GPTConfig(**TINY_GPT) if self.args.tiny else GPTConfig())
        if self.precision == "float8":
            to_float8(raw, "tensorwise")
        return raw, list(raw.transformer.h)

    @property
    def name(self) -> str:
        return self.mode if self.mode == "off" else f"{self.mode}@{self.every}"

    def step(self) -> None:
        x, y = self.batch
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(x, y)
            loss = out[1] if isinstance(out, tuple) else out  # GPT-2: (logits, loss); fp8mon's model: the loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.agent is not None:
            self.agent.log(self.step_no, loss=loss.detach())
        self.step_no += 1

    def align(self, cycle: int) -> None:
        """The step counter to the next multiple of ``cycle``."""
        self.step_no = math.ceil(self.step_no / cycle) * cycle
        if self.agent is not None:
            self.agent.step(self.step_no)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close(timeout=60)
        self.model = self.raw = self.optimizer = None


def slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure(wrap: str, precision: str, args, device: torch.device, world: int) -> list[dict]:
    kinds = [("off", 1)] if "off" in args.modes else []
    kinds += [(m, e) for e in args.every for m in ("on", "reduce") if m in args.modes]
    batch = make_batch(vocab_size(args), (args.batch, args.seq), device)
    runners = [Runner(m, e, wrap, precision, args, device, batch) for m, e in kinds]
    clock = Clock(device)
    for r in runners:
        clock.run(r.step, max(args.warmup, r.every + 1))
    for i in range(args.rounds):
        for r in runners if i % 2 == 0 else runners[::-1]:
            r.align(r.every)
            dist.barrier()
            r.round_means.append(statistics.mean(clock.run(r.step, math.ceil(args.steps / r.every) * r.every)))
    check = next((r for r in runners if r.name == "reduce@1"), None)
    mismatches = check_oracle(check, world) if check is not None and args.check else None
    results = []
    for r in runners:
        step_s = slowest(statistics.median(r.round_means), device)
        rows = None
        if r.agent is not None:
            r.agent.flush(timeout=120)
            rows = min(r.transport.rows.values(), default=0)
        results.append({"copy": r.name, "mode": r.mode, "step_s": step_s, "rows": rows, "linears": r.linears,
                        "tokens_s": args.batch * args.seq * world / step_s,
                        "errors": r.agent.errors if r.agent is not None else 0})
        r.close()
    if mismatches is not None:
        results.append({"copy": "oracle", "mismatches": mismatches})
    del runners
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def check_oracle(runner: Runner, world: int) -> int | None:
    """One reporting step with the histogram, two checks (rank 0 counts; None elsewhere):

    * the reduction: every merged row of the step (each ``reduce_rows`` call, all slots) against the fp64 pairwise
      merge (``merge_all``) of the rows that the ranks put in: counts, amax, scale and histogram exact, moments to
      1e-12 of the data's scale;
    * the oracle: ``CHECKED_LAYER``'s merged input and output records against the fp64 statistics of the ranks'
      concatenated tensors: counts, amax and histogram exact, the moments' statistics to 1e-5 (a rank's row comes
      from fp32 partial sums on a GPU).

    Returns the number of rows or fields that differ."""
    from fp8mon.agent import distributed as agent_distributed
    from fp8mon.agent.stats.reference import Moments

    agent = runner.agent
    runner.align(runner.every * agent.hist_every)
    step = runner.step_no
    runner.transport.keep.add(step)
    seen, reductions = {}, []
    real_reduce = agent_distributed.reduce_rows

    def capturing(rows, group=None):
        merged = real_reduce(rows, group)
        reductions.append((rows.detach().double().clone(), merged.detach().double().clone(), group))
        return merged

    # what torchao's casts take (fp8mon's Fp8Linear reads its input as it comes)
    cast = torch.bfloat16 if runner.precision == "float8" and runner.args.model == "gpt2" else torch.float32
    hook = runner.raw.get_submodule(CHECKED_LAYER[runner.args.model]).register_forward_hook(
        lambda m, a, out: seen.update(input=a[0].detach().to(cast).float(), output=out.detach().float()))
    agent_distributed.reduce_rows = capturing
    try:
        runner.step()
        agent.flush(timeout=120)
    finally:
        agent_distributed.reduce_rows = real_reduce
        hook.remove()
    bad = check_reductions(reductions)
    for site in ("input", "output"):
        parts = [torch.empty_like(seen[site]) for _ in range(world)]
        dist.all_gather(parts, seen[site].contiguous())
        if dist.get_rank() != 0:
            continue
        fmt = agent.formats.get(site)
        whole = Moments.from_tensor(torch.cat([p.reshape(-1) for p in parts]).cpu(), fmt=fmt).to_stats()
        rec = record_of(runner.transport.blocks, step, CHECKED_LAYER[runner.args.model], site)
        if rec is None:
            print(f"   oracle {site}: NO merged record at step {step}", flush=True)
            bad += 1
            continue
        wrong = [f"{k} {rec.get(k)!r} vs {want!r}" for k, want in whole.items()
                 if k not in PER_RANK and not agrees(k, rec.get(k), want, whole)]
        print(f"   oracle {site} (step {step}, {whole['numel']} elements over {world} ranks): "
              f"{'equal' if not wrong else 'DIFFERS in ' + '; '.join(wrong)}", flush=True)
        bad += len(wrong)
    return bad if dist.get_rank() == 0 else None


def check_reductions(reductions: list) -> int:
    """Rank 0: how many merged rows of ``reductions`` ((rows in, rows out, group) per ``reduce_rows`` call, the same
    calls on every rank) differ from the fp64 pairwise merge of all ranks' rows in."""
    from fp8mon.agent.stats import layout as L
    from fp8mon.agent.stats.torch_path import merge_all

    bad = rows = 0
    for rows_in, merged, group in reductions:
        parts = [torch.empty_like(rows_in) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows_in, group=group)
        if dist.get_rank() != 0:
            continue
        want, got = merge_all(torch.stack(parts)).cpu(), merged.cpu()
        exact = [L.PARTS, L.NUMEL, L.N, L.NONFINITE, L.ZEROS, L.NONZERO, L.OUTLIERS, L.UNDERFLOW, L.OVERFLOW, L.AMAX,
                 L.SCALE, L.AMAX_HISTORY_MAX, *range(L.HIST, L.WIDTH)]
        same = ((want[:, exact] == got[:, exact]) | (want[:, exact].isnan() & got[:, exact].isnan())).all(1)
        scale = want[:, L.AMAX].abs().nan_to_num(0.0) + 1e-30
        n = want[:, L.N].clamp(min=1.0)
        for col, bound in ((L.MEAN, scale), (L.M2, n * scale ** 2), (L.M3, n * scale ** 3), (L.M4, n * scale ** 4)):
            close = (want[:, col] - got[:, col]).abs() <= 1e-12 * bound
            same &= close | (want[:, col].isnan() & got[:, col].isnan())
        rows += len(same)
        bad += int((~same).sum())
    if dist.get_rank() == 0:
        print(f"   reduction: {rows} merged rows in {len(reductions)} reduce_rows call(s), "
              f"{bad} differ from the fp64 pairwise merge", flush=True)
    return bad


def record_of(blocks: list[dict], step: int, layer: str, site: str) -> dict | None:
    for b in blocks:
        if int(b["step"]) != step or int(b["rank"]) != -1:
            continue
        for i, key in enumerate(zip(b["layer"], b["site"])):
            if key == (layer, site):
                return {name: col[i] for name, col in b["stats"].items()} | {"log2_hist": b["log2_hist"][i]}
    return None


def agrees(name: str, got, want, whole: dict) -> bool:
    if want is None or got is None:
        return want is None and got is None
    if isinstance(want, (list, tuple)):
        return list(map(int, got)) == list(map(int, want))
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(float(got))
    if name in ("numel", "amax", "nonfinite", "zero_frac"):
        return float(got) == float(want)
    # the mean, by the data's scale (it may be near 0); the moments' statistics relatively
    abs_tol = 1e-5 * float(whole.get("rms") or 0.0) if name == "mean" else 0.0
    return math.isclose(float(got), float(want), rel_tol=1e-5, abs_tol=abs_tol)


def table_and_record(key: str, results: list[dict], rec: Recorder) -> list[str]:
    lines = []
    off = next((r for r in results if r.get("mode") == "off"), None)
    for r in results:
        if r["copy"] == "oracle":
            lines.append(f"{key:<34} {'oracle':<10} {'merged rows ' + ('equal' if not r['mismatches'] else 'DIFFER')}")
            rec.add(f"oracle_mismatches/{key}", r["mismatches"], "fields")
            continue
        over = f"{(r['step_s'] / off['step_s'] - 1) * 100:+8.2f}%" if off and r is not off else f"{'-':>9}"
        rows = "-" if r["rows"] is None else f"{r['rows']}/{r['linears'] * 5}"
        errors = "-" if r["mode"] == "off" else str(r["errors"])
        lines.append(f"{key:<34} {r['copy']:<10} {r['step_s'] * 1e3:9.2f} {over} {r['tokens_s']:11.0f} {rows:>6} "
                     f"{errors:>6}")
        rec.add(f"step_ms/{key}/{r['copy']}", r["step_s"] * 1e3, "ms")
        rec.add(f"tokens_per_s/{key}/{r['copy']}", r["tokens_s"], "tokens/s")
        if off and r is not off:
            rec.add(f"overhead_pct/{key}/{r['copy']}", (r["step_s"] / off["step_s"] - 1) * 100, "%")
            rec.add(f"rows_per_report_min/{key}/{r['copy']}", r["rows"] or 0, "rows")
            rec.add(f"agent_errors/{key}/{r['copy']}", r["errors"], "errors")
    return lines


def float8_usable(device: torch.device, model: str) -> str | None:
    """Why float8 cannot run here (None: it can)."""
    if model == "fp8mon":
        return None  # Fp8Linear: Triton on a GPU, its torch path elsewhere
    if device.type != "cuda":
        return "torchao float8 needs a CUDA device"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed"
    return None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt2", "fp8mon"], default="gpt2",
                   help="nanoGPT's GPT-2 124M (float8: torchao), or fp8mon train's llama 124m (float8: its Fp8Linear, "
                        "Triton kernels)")
    p.add_argument("--wrap", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    p.add_argument("--precision", nargs="+", choices=["bf16", "float8"], default=["bf16", "float8"])
    p.add_argument("--modes", default=",".join(MODES), help="some of off,on,reduce")
    p.add_argument("--every", type=int, nargs="+", default=[1, 10])
    p.add_argument("--steps", type=int, default=20, help="timed steps per copy and round (whole cycles of every)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per copy (at least every + 1)")
    p.add_argument("--batch", type=int, help="per rank (default 16; --tiny 2)")
    p.add_argument("--seq", type=int, help="default 1024; --tiny 64")
    p.add_argument("--compile", action="store_true", help="torch.compile each copy (after wrapping, before the "
                   "agent watches it)")
    p.add_argument("--tiny", action="store_true", help="2 layers, d 64, seq 64, batch 2: a CPU smoke run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the merged rows' oracle check")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/multi_gpu.csv")
    args = check_rounds_args(p, p.parse_args(argv), MODES)
    args.batch = args.batch or (2 if args.tiny else 16)
    args.seq = args.seq or (TINY_GPT["block_size"] if args.tiny else 1024)
    return args


def model_key(args) -> str:
    return f"{args.model}{'-tiny' if args.tiny else ''}{'-compiled' if args.compile else ''}"


def vocab_size(args) -> int:
    return TINY_GPT["vocab_size"] if args.tiny else 50304


def init(device_type: str) -> tuple[int, int, torch.device]:
    """The process group torchrun describes (a single process without torchrun)."""
    if "RANK" not in os.environ:
        from fp8mon.monitor.localserver import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda"
                            else None)
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None) -> int:
    args = parse(argv)
    rank, world, device = init(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.set_float32_matmul_precision("high")
    try:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        if rank == 0:
            print(f"# {world} x {gpu}, torch {torch.__version__}; every {' '.join(map(str, args.every))}; "
                  f"{args.steps} steps x {args.rounds} rounds; batch {args.batch} x seq {args.seq} per rank", flush=True)
        command = f"torchrun --nproc-per-node {world} " + shlex.join(["bench/multi_gpu.py", *sys.argv[1:]])
        rec = Recorder("multi_gpu", command=command, gpu=gpu)
        lines, base = [], {}
        for wrap in args.wrap:
            for precision in args.precision:
                key = f"{model_key(args)}/{wrap}/{precision}/n{world}"
                why = float8_usable(device, args.model) if precision == "float8" else None
                if why:
                    lines.append(f"{key:<34} SKIPPED: {why}")
                    continue
                if rank == 0:
                    print(f"== {key}", flush=True)
                results = measure(wrap, precision, args, device, world)
                done = table_and_record(key, results, rec)
                lines += done
                if rank == 0:  # as each configuration ends: a run cut short keeps what it measured
                    print(HEADER + "\n" + "\n".join(done), flush=True)
                    if args.record and rec.rows:
                        rec.write()
                        rec.rows.clear()
                off = next((r for r in results if r.get("mode") == "off"), None)
                if off is not None:
                    base[(wrap, precision)] = off["tokens_s"]
            if ("bf16" in args.precision and "float8" in args.precision and (wrap, "bf16") in base
                    and (wrap, "float8") in base):
                speedup = base[(wrap, "float8")] / base[(wrap, "bf16")]
                key = f"{model_key(args)}/{wrap}/n{world}"
                lines.append(f"{key:<34} float8 vs bf16 tokens/s (off): x{speedup:.3f}")
                rec.add(f"fp8_vs_bf16_tokens_per_s/{key}", speedup, "x")
        if rank == 0:
            print("\n" + HEADER + "\n" + "\n".join(lines))
            print("(step ms: the slowest rank's median over rounds of its round's mean step; overhead vs off; "
                  "tokens/s over all ranks; rows: the fewest a reporting step delivered on rank 0 / linears x 5; "
                  "errors: the agent's on rank 0)")
            if args.record and rec.rows:
                rec.write()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
