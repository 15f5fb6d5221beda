"""The agent's overhead on models fp8mon did not write: a nanoGPT-style GPT-2 124M (bench/models/gpt2.py) and
transformers' Llama (bench/models/llama.py, 553M), bf16 autocast or torchao float8 (``convert_to_float8_training``,
the lm_head left in bf16 as torchao's users do), eager or ``torch.compile``d, the agent reporting every step or
every 10th: whole training steps (fused AdamW) with

    off     no monitoring
    on      fp8mon's Agent (``from fp8mon import Agent``), every ``nn.Linear`` x 5 sites, its batches counted and
            dropped by a transport without a server (as ``NullTransport``: all the agent does but encode and post,
            which its transport's thread does)
    naive   plain torch hooks computing mean/std/amax/kurtosis of input, output and grad_output (bench/naive_hooks.py)

The H200 figures, one command per model, each within one call of 10 minutes (``--all``: bf16 and float8
(tensorwise; ``--recipe rowwise``) x eager and compiled x every {1, 10} x modes {off, on, naive}, the eager ones first,
within ``--budget-s`` 540: a configuration, or a copy, that would not fit is skipped and the output says which):

    python3 bench/external.py --model gpt2 --all
    python3 bench/external.py --model llama --all

What ``--all`` skipped, alone (a compiled copy whose hooks break the graph compiles for minutes; one every or one
mode at a time then):

    python3 bench/external.py --model llama --precision bf16 --compile --every 1 10
    python3 bench/external.py --model llama --precision float8 --compile --every 10 --modes off,on

On a CPU, tiny (2 layers, d 64, seq 64, batch 2): ``python3 bench/external.py --tiny --steps 2 --rounds 1 --no-record``.

Method. Every mode (and every value of ``every``) has its own copy of the model (the same seed, the same weights),
its own optimizer and, compiled, its own ``torch.compile`` (a backend object of its own: Dynamo shares compiled code
between equal backends, and does not guard on module hooks by default, so one mode's code would run another's hooks
or none). The agent watches the compiled model after ``torch.compile`` (``--watch-before-compile``: before), before
the first step, as a user does. Each copy takes its warm-up steps (compilation, autotuning, a reporting step with
and without the histogram, which the agent draws on every 10th reporting step), then all run a cycle each in turn,
in both orders, untimed (what compiles only when the copies alternate compiles there), and their step counters jump
to a whole cycle of the agent (every x 10 steps). Then ``--rounds`` rounds: in each, every copy runs ``--steps``
steps (rounded up to whole cycles of ``every``) in turn, the order reversed every other round; a step's time is
taken with CUDA events around it (no synchronisation inside the timed steps; one after). A copy's figure is the
median over rounds of its round's mean step time; overhead = that / the off copy's - 1. "all-mean %" compares the
means over all timed steps instead: the rounds together cover whole cycles of the histogram (every x 10 steps) when
rounds x steps is a multiple of it (the defaults: 5 x 20).

Rows: every reporting step of the agent should deliver one row per linear and site (the counting transport sees
each); the naive hooks write input/output/grad_output per linear. The table prints expected and the least and most
any timed reporting step got. Errors (an OOM, a failed compile) end their configuration, or only their copy when in
its warm-up; the others go on. Figures go to bench/results/external.csv (``--no-record``: not).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.naive_hooks import SITES as NAIVE_SITE_NAMES  # noqa: E402
from bench.naive_hooks import NaiveStats  # noqa: E402
from bench.record import Recorder  # noqa: E402

MODES = ("off", "on", "naive")
AGENT_SITES = 5
NAIVE_SITES = len(NAIVE_SITE_NAMES)
DEFAULT_SHAPE = {"gpt2": (16, 1024), "llama": (4, 2048)}  # batch, sequence
TINY_SHAPE = (2, 64)
TINY_GPT = dict(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)


@dataclass(frozen=True)
class Setup:
    """One configuration: the model, its precision and whether it is compiled."""

    model: str
    precision: str  # bf16 | float8 | fp32
    recipe: str = "tensorwise"
    compile: bool = False
    watch_before_compile: bool = False
    tiny: bool = False

    def key(self) -> str:
        prec = f"float8-{self.recipe}" if self.precision == "float8" else self.precision
        comp = ("compiled-watch-first" if self.watch_before_compile else "compiled") if self.compile else "eager"
        return f"{self.model}{'-tiny' if self.tiny else ''}/{prec}/{comp}"


class CountingTransport:
    """``agent.transport.NullTransport`` counting the tensor rows of each step (the collector thread calls it);
    without its module's imports (httpx, msgpack), which the agent itself does not need."""

    def __init__(self):
        self.rows: dict[int, int] = defaultdict(int)

    def send_tensors(self, block) -> None:
        self.rows[int(block["step"])] += len(block["layer"])

    def set_run_meta(self, **meta) -> None:
        pass

    def send_scalars(self, block) -> None:
        pass

    def flush(self, timeout=None) -> bool:
        return True

    def close(self, timeout=None) -> bool:
        return True


# ---- models ----------------------------------------------------------------------------------------------------

def build_model(setup: Setup) -> nn.Module:
    """The model, fp32 weights, on torch's default device."""
    if setup.model == "gpt2":
        from bench.models.gpt2 import GPT, GPTConfig

        cfg = GPTConfig(**TINY_GPT) if setup.tiny else GPTConfig()
        return GPT(cfg)
    from bench.models.llama import build_llama

    return build_llama(setup.tiny)


def loss_of(model_name: str):
    if model_name == "gpt2":
        return lambda model, x, y: model(x, y)[1]
    return lambda model, x, y: model(input_ids=x, labels=y).loss


def to_float8(model: nn.Module, recipe: str) -> None:
    """torchao's float8 training on every linear but the lm_head (and those whose sizes are not multiples of 16)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError("--precision float8 needs torchao (pip install torchao)") from exc

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)


def own_compile(model: nn.Module) -> nn.Module:
    """``torch.compile(model)`` with a backend object equal to no other: its compiled code is its own (Dynamo reuses
    code compiled for an equal backend, whatever hooks the other module had)."""
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    if base is None:
        return torch.compile(model)

    class OwnInductor(base):
        __eq__ = object.__eq__
        __hash__ = object.__hash__

    return torch.compile(model, backend=OwnInductor("default", None, None))


def dynamo_graphs() -> int:
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---- one mode's copy of the model -------------------------------------------------------------------------------

@dataclass
class Runner:
    mode: str
    every: int
    setup: Setup
    device: torch.device
    batch: tuple[torch.Tensor, torch.Tensor]
    model: nn.Module = field(init=False)
    error: str | None = None
    step_no: int = 0
    round_means: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    timed_reports: list[int] = field(default_factory=list)
    naive_rows: dict[int, int] = field(default_factory=dict)
    warm_graphs: int = 0
    warm_step: float = 0.0
    recompiles: int = 0

    def __post_init__(self):
        torch.manual_seed(0)
        with self.device:  # initialised where it trains: seconds less per copy of the 553M Llama
            model = build_model(self.setup)
        if self.setup.precision == "float8":
            to_float8(model, self.setup.recipe)
        self.model = model
        self.linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        self.float8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        self.loss = loss_of(self.setup.model)
        self.agent = self.naive = self.transport = None
        if self.mode == "on":
            from fp8mon import Agent

            self.transport = CountingTransport()
            self.agent = Agent(transport=self.transport, every=self.every)
            if self.setup.watch_before_compile:
                self.agent.watch(model)
        self.forward = own_compile(model) if self.setup.compile else model
        if self.agent is not None and not self.setup.watch_before_compile:
            self.agent.watch(self.forward)
        if self.mode == "naive":
            self.naive = NaiveStats(model, self.every)

    @property
    def name(self) -> str:
        return self.mode if self.mode == "off" else f"{self.mode}@{self.every}"

    @property
    def cycle(self) -> int:
        """Steps of the monitor's whole cycle: the agent draws its histogram on every ``hist_every``-th report."""
        if self.agent is not None and self.agent.hist:
            return self.every * self.agent.hist_every
        return self.every

    def step(self) -> None:
        x, y = self.batch
        autocast = self.setup.precision != "fp32"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = self.loss(self.forward, x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.agent is not None:
            self.agent.log(self.step_no, loss=loss.detach())
        elif self.naive is not None:
            self.naive_rows[self.step_no] = self.naive.end_step(self.step_no)
        self.step_no += 1

    def warm_up(self, steps: int, clock) -> None:
        """Untimed steps: every kind of step of the monitor's cycle (a report with and without the histogram)."""
        before = dynamo_graphs()
        times = clock.run(self.step, max(steps, self.every + 1))
        self.warm_graphs = dynamo_graphs() - before
        self.warm_step = min(times[1:])  # the later warm-up steps may still compile (a report, the histogram)

    def align(self) -> None:
        """The step counter to the next whole cycle of the monitor: the rounds cover whole cycles."""
        start = math.ceil(self.step_no / self.cycle) * self.cycle
        if self.agent is not None:
            self.agent.step(start)
        if self.naive is not None:
            self.naive.begin(start)
        self.step_no = start

    def timed_estimate(self, args) -> float:
        """Seconds its settling and rounds will take, from its warm-up's steps."""
        return (2 * (self.every + 1) + args.rounds * math.ceil(args.steps / self.every) * self.every) * self.warm_step

    def timed(self, steps: int, clock) -> None:
        first = self.step_no
        before = dynamo_graphs()
        times = clock.run(self.step, steps)
        self.recompiles += dynamo_graphs() - before
        self.times += times
        self.round_means.append(statistics.mean(times))
        self.timed_reports += [s for s in range(first, self.step_no) if s % self.every == 0]

    def rows_got(self) -> list[int]:
        if self.agent is not None:
            self.agent.flush(timeout=120)
            return [self.transport.rows.get(s, 0) for s in self.timed_reports]
        if self.naive is not None:
            return [self.naive_rows.get(s, 0) for s in self.timed_reports]
        return []

    def rows_expected(self) -> int:
        return self.linears * (AGENT_SITES if self.mode == "on" else NAIVE_SITES if self.mode == "naive" else 0)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close(timeout=60)
        if self.naive is not None:
            self.naive.close()
        self.model = self.forward = self.optimizer = None


class Clock:
    """Per-step times of ``n`` calls: CUDA events between the steps and one synchronisation after (on a CPU, the
    host's clock)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn, n: int) -> list[float]:
        if not self.cuda:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for i in range(n):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]


# ---- one configuration ------------------------------------------------------------------------------------------

def make_batch(vocab: int, shape: tuple[int, int], device: torch.device):
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, vocab, shape, generator=gen)
    y = torch.randint(0, vocab, shape, generator=gen)
    return x.to(device), y.to(device)


def runner_kinds(modes: list[str], everies: list[int]) -> list[tuple[str, int]]:
    """(mode, every) of each copy: one off copy (its steps do not depend on every), then on and naive per every."""
    kinds = [("off", 1)] if "off" in modes else []
    return kinds + [(m, e) for e in everies for m in ("on", "naive") if m in modes]


def measure(setup: Setup, args, device: torch.device, deadline: float) -> list[dict]:
    """The figures of one configuration: one dict per copy (``mode``, ``every``, times, rows, notes)."""
    shape = TINY_SHAPE if setup.tiny else (args.batch or DEFAULT_SHAPE[setup.model][0],
                                           args.seq or DEFAULT_SHAPE[setup.model][1])
    clock = Clock(device)
    vocab = build_vocab(setup)
    batch = make_batch(vocab, shape, device)
    runners: list = []
    warm_s: list[float] = []  # each copy's warm-up (its compilation)
    try:
        for mode, every in runner_kinds(args.modes, args.every):
            timed = [r.timed_estimate(args) for r in runners if r.error is None]
            need = max(warm_s, default=0.0) + sum(timed) + (statistics.mean(timed) if timed else 0.0)
            if warm_s and time.monotonic() + need > deadline:
                print(f"  {runner_name(mode, every):>8}: SKIPPED, the budget leaves {deadline - time.monotonic():.0f} s"
                      f" and it needs about {need:.0f} s with the rounds", flush=True)
                runners.append(Dead(mode, every, "skipped: budget"))
                continue
            t0 = time.perf_counter()
            runner, error = None, None
            try:
                runner = Runner(mode, every, setup, device, batch)
                runner.warm_up(args.warmup, clock)
            except Exception as exc:  # a failed compile, an OOM: this copy only
                failed(runner_name(mode, every), exc)
                error = short(exc)
            if error is not None:  # out of the except clause: its traceback no longer holds the copy's tensors
                if runner is not None:
                    with contextlib.suppress(Exception):
                        runner.close()
                runner = None
                runners.append(Dead(mode, every, error))
                free(device)
                continue
            runners.append(runner)
            warm_s.append(time.perf_counter() - t0)
            graphs = f", {runner.warm_graphs} graphs compiled" if setup.compile else ""
            f8 = f" ({runner.float8} in float8)" if setup.precision == "float8" else ""
            print(f"  {runner.name:>8}: {runner.linears} linears{f8}, batch {shape[0]}x{shape[1]}, warm-up "
                  f"{warm_s[-1]:.1f} s{graphs}, then {runner.warm_step * 1e3:.1f} ms a step", flush=True)
        live = [r for r in runners if r.error is None]
        settle(live, clock)
        rounds_run = run_rounds(live, args, clock, deadline)
        if args.profile:
            for runner in live:
                if runner.agent is not None:
                    profile_report(runner, setup.key(), Path(args.profile))
        return [summary(r, rounds_run) for r in runners]
    finally:
        for r in runners:
            if r.error is None:
                r.close()
        runners.clear()
        free(device, reset_dynamo=setup.compile)


def profile_report(runner, key: str, folder: Path) -> None:
    """A reporting step of an agent's copy under torch.profiler (the host's top ops and a Chrome trace), the same
    under cProfile (the host's Python), and a step that does not report under torch.profiler."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{key.replace('/', '_')}_{runner.name.replace('@', '_every')}"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    report = []
    steps = [("report", 0)] + ([("quiet", 1)] if runner.every > 1 else [])
    for what, offset in steps:
        runner.align()
        for _ in range(offset):
            runner.step()
        sync()
        with profile(activities=activities) as prof:
            runner.step()
            sync()
        prof.export_chrome_trace(str(folder / f"{stem}_{what}.json.gz"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        report.append(f"== {what} step under torch.profiler\n{table}")
    runner.align()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    runner.step()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    report.append(f"== report step under cProfile\n{text.getvalue()}")
    (folder / f"{stem}.txt").write_text("\n".join(report))
    print(f"  profiled {runner.name} ({key}): {folder / stem}.txt", flush=True)


def settle(live: list, clock) -> None:
    """Untimed, the copies in turn in both orders (as the rounds run them), a cycle of ``every`` each: what compiles
    only when the copies alternate (Dynamo recompiles a frame that another copy's compiled code sent it to) compiles
    here. Then every copy's counter goes to a whole cycle."""
    before = dynamo_graphs()
    for order in (live, live[::-1]):
        for runner in order:
            clock.run(runner.step, runner.every + 1)
    if dynamo_graphs() > before:
        print(f"  {dynamo_graphs() - before} graphs compiled when the copies alternated", flush=True)
    for runner in live:
        runner.align()


def run_rounds(live: list, args, clock, deadline: float) -> int:
    """``args.rounds`` rounds of ``args.steps`` steps (whole cycles of ``every``) per copy, fewer when the
    budget runs out (at least one)."""
    done = 0
    for r in range(args.rounds):
        t0 = time.perf_counter()
        order = live if r % 2 == 0 else live[::-1]
        for runner in order:
            runner.timed(math.ceil(args.steps / runner.every) * runner.every, clock)
        done += 1
        took = time.perf_counter() - t0
        if r + 1 < args.rounds and time.monotonic() + took > deadline:
            print(f"  budget: {done} of {args.rounds} rounds (a round takes {took:.1f} s)", flush=True)
            break
    return done


@dataclass
class Dead:
    """A copy that could not be built or warmed up."""

    mode: str
    every: int
    error: str


def summary(r, rounds: int) -> dict:
    out = {"mode": r.mode, "every": r.every, "error": r.error, "rounds": rounds}
    if r.error is not None:
        return out
    rows = r.rows_got()
    out.update(median_ms=statistics.median(r.round_means) * 1e3, mean_ms=statistics.mean(r.times) * 1e3,
               steps=len(r.times), reports=len(r.timed_reports), rows_expected=r.rows_expected(),
               rows_min=min(rows) if rows else None, rows_max=max(rows) if rows else None,
               recompiles=r.recompiles, graphs=r.warm_graphs,
               agent_errors=r.agent.errors if r.agent is not None else 0,
               last_error=r.agent.last_error if r.agent is not None else None)
    return out


def build_vocab(setup: Setup) -> int:
    if setup.model == "gpt2":
        from bench.models.gpt2 import GPTConfig

        return (GPTConfig(**TINY_GPT) if setup.tiny else GPTConfig()).vocab_size
    from bench.models.llama import FULL, TINY

    return (TINY if setup.tiny else FULL)["vocab_size"]


def runner_name(mode: str, every: int) -> str:
    return mode if mode == "off" else f"{mode}@{every}"


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def failed(what: str, exc: BaseException) -> None:
    print(f"  {what}: FAILED {short(exc)}", flush=True)
    tb = traceback.format_exception(exc)
    print("    " + "    ".join(tb[-3:]).rstrip(), flush=True)


def free(device: torch.device, reset_dynamo: bool = False) -> None:
    gc.collect()
    if reset_dynamo and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- output -----------------------------------------------------------------------------------------------------

HEADER = (f"{'configuration':<40} {'every':>5} {'mode':<6} {'step ms':>9} {'overhead %':>11} {'all-mean %':>11} "
          f"{'reports':>7}  rows per report: expected, got (least..most)")


def table_lines(key: str, results: list[dict]) -> list[str]:
    off = next((r for r in results if r["mode"] == "off" and r.get("error") is None), None)
    lines = []
    for r in results:
        every = "-" if r["mode"] == "off" else str(r["every"])
        if r.get("error") is not None:
            what = "SKIPPED (budget)" if r["error"].startswith("skipped") else f"FAILED: {r['error']}"
            lines.append(f"{key:<40} {every:>5} {r['mode']:<6} {what}")
            continue
        over = all_over = "-"
        if off is not None and r["mode"] != "off":
            over = f"{(r['median_ms'] / off['median_ms'] - 1) * 100:+.2f}"
            all_over = f"{(r['mean_ms'] / off['mean_ms'] - 1) * 100:+.2f}"
        rows = "-"
        if r["mode"] != "off":
            complete = r["rows_min"] == r["rows_max"] == r["rows_expected"]
            rows = (f"{r['rows_expected']}, got {r['rows_min']}..{r['rows_max']} "
                    f"{'complete' if complete else 'INCOMPLETE'}")
        notes = f"  ({r['recompiles']} graphs compiled while timed)" if r["recompiles"] else ""
        if r["agent_errors"]:
            notes += f"  (agent errors: {r['agent_errors']}, last: {r['last_error'][:120]})"
        lines.append(f"{key:<40} {every:>5} {r['mode']:<6} {r['median_ms']:9.2f} {over:>11} {all_over:>11} "
                     f"{r['reports'] if r['mode'] != 'off' else '-':>7}  {rows}{notes}")
    return lines


def record(rec: Recorder, key: str, results: list[dict]) -> None:
    off = next((r for r in results if r["mode"] == "off" and r.get("error") is None), None)
    for r in results:
        if r.get("error") is not None:
            continue
        name = "off" if r["mode"] == "off" else f"{r['mode']}/every{r['every']}"
        rec.add(f"step_ms/{key}/{name}", r["median_ms"], "ms")
        if r["mode"] == "off":
            continue
        if off is not None:
            rec.add(f"overhead_pct/{key}/{name}", (r["median_ms"] / off["median_ms"] - 1) * 100, "%")
            rec.add(f"overhead_allmean_pct/{key}/{name}", (r["mean_ms"] / off["mean_ms"] - 1) * 100, "%")
        rec.add(f"rows_per_report_min/{key}/{name}", r["rows_min"] if r["rows_min"] is not None else 0, "rows")
        rec.add(f"rows_per_report_expected/{key}/{name}", r["rows_expected"], "rows")
        if r["mode"] == "on":
            rec.add(f"agent_errors/{key}/{name}", r["agent_errors"], "errors")


# ---- command line -----------------------------------------------------------------------------------------------

def setups(args) -> list[Setup]:
    common = dict(model=args.model, recipe=args.recipe, watch_before_compile=args.watch_before_compile,
                  tiny=args.tiny)
    if not args.all:
        return [Setup(precision=args.precision, compile=args.compile, **common)]
    # the cheap ones first: a compiled configuration spends minutes compiling each copy
    return [Setup(precision=p, compile=c, **common) for c in (False, True) for p in ("bf16", "float8")]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--precision", choices=["bf16", "float8", "fp32"], default="bf16",
                   help="bf16 autocast; float8: torchao's float8 training under bf16 autocast; fp32: no autocast")
    p.add_argument("--recipe", choices=["tensorwise", "rowwise"], default="tensorwise", help="torchao float8 recipe")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the model")
    p.add_argument("--watch-before-compile", action="store_true",
                   help="the agent watches the model before torch.compile (default: after, the natural order)")
    p.add_argument("--every", type=int, nargs="+", default=[1, 10], help="report every N steps (on, naive)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per copy and round (whole cycles of every)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per copy (at least every + 1)")
    p.add_argument("--modes", default=",".join(MODES), help="some of off,on,naive")
    p.add_argument("--batch", type=int, help="batch size (default: gpt2 16, llama 4)")
    p.add_argument("--seq", type=int, help="sequence length (default: gpt2 1024, llama 2048)")
    p.add_argument("--tiny", action="store_true", help="2 layers, d 64, seq 64, batch 2: a CPU smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--all", action="store_true",
                   help="bf16 and float8, eager and compiled, within --budget-s (what does not fit is skipped)")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--explain-recompiles", action="store_true",
                   help="log why Dynamo recompiles (torch._logging recompiles): for a copy that compiles while timed")
    p.add_argument("--profile", metavar="DIR",
                   help="after the rounds, profile one reporting step of each agent copy: top host ops, Chrome trace")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/external.csv")
    return check_rounds_args(p, p.parse_args(argv), MODES)


def check_rounds_args(p: argparse.ArgumentParser, args, modes: tuple[str, ...]):
    """``args`` with ``--modes`` split into a list, after ``p.error`` on modes outside ``modes`` or a count < 1."""
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(modes):
        p.error(f"--modes: some of {','.join(modes)}")
    if min(args.every) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--every, --steps and --rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}; every {' '.join(map(str, args.every))}; {args.steps} steps x "
          f"{args.rounds} rounds; budget {args.budget_s:.0f} s", flush=True)
    if args.compile or args.all:
        import torch._dynamo.config as dynamo_config

        # The copies' compiled code shares code objects (and the limits on their cache entries): where a monitor's
        # hooks compile one graph per linear (a guard on the layer's name), torch's defaults (8 per code object, 256
        # in all) would send some copies' frames to eager. A user's single model may still hit them: the warm-up
        # prints each copy's number of graphs.
        for limit, value in (("recompile_limit", 256), ("accumulated_recompile_limit", 8192)):
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), value))
        if args.explain_recompiles:
            torch._logging.set_logs(recompiles=True)
    lines, took = [], {}
    rec = Recorder("external")
    for setup in setups(args):
        key = setup.key()
        # a compiled configuration's copies compile for a minute or more each (on a GPU)
        guess = took.get(setup.compile) or (3 * took.get(False, 0) + 120 * (device.type == "cuda")
                                            if setup.compile else 0)
        if time.monotonic() + guess > deadline:
            left = deadline - time.monotonic()
            print(f"== {key}: SKIPPED, {left:.0f} s of the budget left, it takes about {guess:.0f} s "
                  f"(alone: --model {setup.model} --precision {setup.precision}"
                  f"{' --recipe ' + setup.recipe if setup.precision == 'float8' else ''}"
                  f"{' --compile' if setup.compile else ''})", flush=True)
            lines.append(f"{key:<40} SKIPPED (budget)")
            continue
        print(f"== {key}", flush=True)
        t0 = time.monotonic()
        try:
            results = measure(setup, args, device, deadline)
        except Exception as exc:  # the configuration as a whole: the next one goes on
            failed(key, exc)
            lines.append(f"{key:<40} FAILED: {short(exc)}")
            free(device, reset_dynamo=setup.compile)
            continue
        took[setup.compile] = time.monotonic() - t0
        print(f"   {key}: {took[setup.compile]:.0f} s", flush=True)
        lines += table_lines(key, results)
        print("\n".join(table_lines(key, results)), flush=True)
        record(rec, key, results)
        if args.record and rec.rows:  # each configuration's figures as soon as they are in: a killed run keeps them
            rec.write()
            rec.rows.clear()
    print("\n" + HEADER)
    print("\n".join(lines))
    print(f"(step ms: median over rounds of each round's mean step, whole cycles of every; overhead vs off; all-mean: "
          f"means over all timed steps; agent rows: linears x {AGENT_SITES} sites, naive: x {NAIVE_SITES}; "
          f"{time.monotonic() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
