"""Monitoring overhead: whole optimizer steps of the trainer's real model (trainer/model.py) with the agent
off vs on, every step (``every=1``), every block linear watched at all five sites (input, weight, output,
grad_output, grad_weight), measured in one process, phases alternating.

    python bench/agent_overhead.py --configs 124m,1.5b --precisions fp8,bf16          # on a GPU
    python bench/agent_overhead.py --configs tiny --precisions bf16 --device cpu --steps 3 --warmup 1 --rounds 1

Per config and precision one model is built and stepped by bench/train_step.py's ``build`` and
``optimizer_step`` (llama, current scaling, fused AdamW, gradient clipping, autocast; with the agent on, clipping
takes the norms of the gradients it watches from its rows, as ``fp8mon train`` does, unless ``--clip-reads``) and the
phases run in the order ``off, on, on-torch, off, on, ...`` (``--rounds``
repetitions of ``off`` + each backend): the agent on the one-pass Triton path (``stats_backend="triton"``:
in fp8 the rows of input/weight/grad_output come from the FP8 quantize kernels of Fp8Linear, output from its GEMM,
grad_weight from the standalone kernel on weight.grad; in bf16 the sites no fused kernel reports come from the
standalone kernel), and the naive
torch path (``stats_backend="torch"``) for comparison. Each phase: its own warm-up steps, then ``--steps``
timed steps (host clock around a synchronised step); the figure is the median step time of each phase,
printed beside the median host time until the step's Python returned (a step whose host time is close to its
step time is host-bound: its GPU waits for launches);
overhead = median(on) / median(off) - 1 over all phases of a kind (off phases bracket the on phases); "paired %",
the median over rounds of each on-phase against the off-phases around it (``paired``: robust to a drift of the
machine's clocks over the run); and the first with means ("mean %"): the agent computes the log2 histogram on every
``--hist-every``-th step only (its default, 10; 1 = every step), so the median step carries none and the mean over
whole cycles (``--steps`` a multiple of it) is the amortized cost.

``--cuda-graph`` replays every phase's steps as CUDA graphs (``trainer.graphs.StepGraphs``, as ``fp8mon train
--cuda-graph``), each kind of step captured in the phase's warm-up: the launches' host cost leaves the step, so
the overhead is the agent's device time.

The agent posts to --url (a real ``fp8mon serve``), or by default to bench/sink.py, a stdlib endpoint in a
subprocess that acknowledges every batch: the agent's whole client side (statistics, device-to-host copy,
encoding, gzip, HTTP) is in the measurement.

The summary's figures are appended to bench/results/agent_overhead.csv (bench/record.py; ``--no-record`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.record import Recorder  # noqa: E402
from bench.train_step import BATCH, build, optimizer_step  # noqa: E402
from fp8mon.agent import Agent  # noqa: E402
from fp8mon.agent.wire import SITES  # noqa: E402
from fp8mon.trainer.graphs import StepGraphs, tensor_lr  # noqa: E402


def measure(config: str, precision: str, args, device: torch.device, url: str) -> dict:
    model, optimizer, cfg = build(config, "llama", precision, args.vocab, "current", device)
    batch = args.batch_size or BATCH[config]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_no = [0]
    if args.cuda_graph:
        tensor_lr(optimizer, device)  # capturable

    watching = [None]  # the phase's agent, whose rows give clipping the watched gradients' norms (trainer.clip)

    def plain():
        return optimizer_step(model, optimizer, params, precision, x, y, agent=watching[0])

    def step(agent, run=plain):  # run: plain, or its StepGraphs (--cuda-graph)
        loss = run()
        if agent is not None:
            agent.log(step_no[0], loss=loss.detach())
        step_no[0] += 1

    def phase(backend: str | None, timed=contextlib.nullcontext) -> dict:
        """Warm-up steps, then ``--steps`` timed ones inside the context ``timed()`` (a profiler)."""
        agent = None
        spool = tempfile.TemporaryDirectory()
        if backend is not None:
            backend, _, sites = backend.partition(":")  # "triton:input+grad_weight": those sites only
            agent = Agent(url, run=f"overhead-{config}-{precision}-{int(time.time())}", every=1,
                          modules=r"^blocks\.", spool_dir=spool.name, stats_backend=backend,
                          sites=sites.split("+") if sites else SITES,
                          hist=args.hist, hist_every=args.hist_every).watch(model)
            agent.step(step_no[0])
        watching[0] = None if args.clip_reads else agent
        # --cuda-graph: a step of each kind eagerly, then captured, both within the warm-up
        run = StepGraphs(plain, agent=agent, warmup=1) if args.cuda_graph else plain
        # with the agent on, the warm-up takes in a histogram step (its kernels compile then, not in the timing)
        hist_steps = (2 if args.cuda_graph else 1) * args.hist_every if backend is not None and args.hist else 0
        for _ in range(args.warmup + hist_steps):
            step(agent, run)
        sync()
        times, host = [], []
        with timed():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(agent, run)
                host.append(time.perf_counter() - t0)  # until the step's Python returns: its launches are queued
                sync()
                times.append(time.perf_counter() - t0)
        info = {"times": times, "host": host, "graphs": run.captured if run is not plain else 0}
        del run  # a phase's graphs and their memory pool go with it
        if agent is not None:
            info["linears"] = len(agent._layers)
            info["delivered"] = agent.close(timeout=120)
            info["errors"] = agent.errors
            info["last_error"] = agent.last_error
        spool.cleanup()
        return info

    phase(None)  # warm-up of the model alone (Triton autotuning, allocator)
    lower_bound(model, batch * cfg.seq_len, precision, device)
    if args.profile:
        return profile(phase, device, args)
    got: dict[str, list[dict]] = {"off": []}
    for b in args.backends:
        got[b] = []
    for r in range(args.rounds):
        for kind in ["off", *args.backends]:
            info = phase(None if kind == "off" else kind)
            got[kind].append(info)
            med = statistics.median(info["times"]) * 1e3
            extra = "" if kind == "off" else (f"  {info['linears']} linears x 5 sites, delivered={info['delivered']}, "
                                              f"errors={info['errors']}")
            extra += f"  graphs={info['graphs']}" if args.cuda_graph else ""
            print(f"{config:>5} {precision:>4} round {r} {kind:>6}: median {med:8.2f} ms  "
                  f"mean {statistics.mean(info['times']) * 1e3:8.2f} ms  "
                  f"(min {min(info['times']) * 1e3:.2f}; host {statistics.median(info['host']) * 1e3:.2f}){extra}",
                  flush=True)
            if kind != "off" and info["errors"]:
                print(f"      last agent error: {info['last_error']}", flush=True)
    del model, optimizer, x, y, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    off = statistics.median([t for i in got["off"] for t in i["times"]])
    off_mean = statistics.mean([t for i in got["off"] for t in i["times"]])
    out = {"off_ms": off * 1e3}
    for b in args.backends:
        on = statistics.median([t for i in got[b] for t in i["times"]])
        out[b] = (on / off - 1) * 100
        out[f"{b}_paired"] = paired([i["times"] for i in got["off"]], [i["times"] for i in got[b]])
        out[f"{b}_ms"] = on * 1e3
        # with the histogram on every N-th step only, the median step has none: the mean over whole cycles
        # (--steps a multiple of --hist-every) is the amortized cost
        out[f"{b}_mean"] = (statistics.mean([t for i in got[b] for t in i["times"]]) / off_mean - 1) * 100
    return out


def paired(offs: list[list[float]], ons: list[list[float]]) -> float:
    """The overhead (%) as the median over rounds of each on-phase's median step against the mean of the medians of
    the off-phases on either side of it (the same round's and the next one's; the same round's alone after the last
    round). A drift of the machine's clocks over the run cancels within each pair, where the pooled medians mix it
    in."""
    offs_m = [statistics.median(t) for t in offs]
    return statistics.median(statistics.median(t) / statistics.mean(offs_m[r:r + 2]) - 1
                             for r, t in enumerate(ons)) * 100


def lower_bound(model, tokens: int, precision: str, device: torch.device) -> None:
    """The time a separate read of every watched tensor takes at the device's copy bandwidth (measured
    here): what statistics that are not fused into a kernel already reading the tensor cost at least. In fp8 only
    grad_weight needs that read (Fp8Linear's kernels fuse the other four sites). bf16 linears have no cast to fuse
    into: the figure is all five sites, what the rows would cost with none of them fused, though llama's consumer
    kernels (SwiGLU, the residual adds, RoPE, RMSNorm) and the weights' casts take most of them from reads they do
    anyway (README)."""
    import re

    rx = re.compile(r"^blocks\.")
    act = 2  # bf16 activations and gradients under autocast
    total = unfused = 0
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if rx.search(name) and isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(m, "in_features"):
            o, i = w.shape
            total += tokens * (i + o + o) * act + 2 * o * i * w.element_size()  # x, y, dy; W, dW
            unfused += o * i * w.element_size()  # dW
    if device.type != "cuda":
        return
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 10 / (time.perf_counter() - t0)  # read + write
    del src, dst
    read, what = (unfused, "of them read apart") if precision == "fp8" else (total, "with no row fused")
    print(f"# {precision}: watched tensors {total / 1e9:.2f} GB per step, {read / 1e9:.2f} GB {what}; "
          f"one read at copy bandwidth ({bw / 1e12:.2f} TB/s) >= {read / bw * 1e3:.2f} ms", flush=True)


def _warm(phase, backend, args) -> None:
    """One untimed phase of ``backend`` (its warm-up steps only: compiles and first-call tuning)."""
    steps, warmup = args.steps, args.warmup
    args.steps, args.warmup = 0, max(1, warmup)
    phase(backend)
    args.steps, args.warmup = steps, warmup


def device_profile(phase, device, args) -> dict:
    """``--profile device``: per phase (off, on), the kernels' device time per step (torch.profiler, CUDA
    activity only, over the phase's ``--steps`` timed steps: with the histogram on every 10th step, ``--steps 10``
    holds one, the amortized share), in all and for the 12 costliest kernels. With ``--profile-trace DIR``, each
    phase's Chrome trace goes to DIR/off.json and DIR/triton.json. (On a CPU, the operators' own CPU
    time: only to try the bench.)"""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cuda = device.type == "cuda"

    per = {}
    for backend in (None, "triton"):
        _warm(phase, backend, args)
        profiles = []

        def timed():
            profiles.append(tprofile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]))
            return profiles[-1]

        info = phase(backend, timed)
        prof = profiles[0]
        if args.profile_trace:  # a directory: the profiled steps' Chrome trace per phase
            prof.export_chrome_trace(str(Path(args.profile_trace) / f"{backend or 'off'}.json"))
        n = len(info["times"])
        rows = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / n / 1e3, e.count / n)
                for e in prof.key_averages()]
        rows = [r for r in rows if r[1] > 0]
        rows.sort(key=lambda r: -r[1])
        per[backend] = dict((k, t) for k, t, _ in rows)
        print(f"\n=== device time per step, agent {backend or 'off'} ({n} steps profiled): "
              f"{sum(t for _, t, _ in rows):.2f} ms in all", flush=True)
        for k, t, c in rows[:12]:
            print(f"  {t:8.2f} ms  {c:6.1f} calls  {k[:90]}", flush=True)
    off, on = per[None], per["triton"]
    delta = {k: on.get(k, 0) - off.get(k, 0) for k in set(on) | set(off)}
    print("agent on - off, per kernel (ms per step, every change of 0.01 or more): " + ", ".join(
        f"{k[:40]} {d:+.2f}" for k, d in sorted(delta.items(), key=lambda kd: -abs(kd[1])) if abs(d) >= 0.005),
        flush=True)
    return {}


def profile(phase, device, args) -> dict:
    """Where the agent's time goes: torch.profiler over a few steps with the agent off and on (Triton
    path), the top operators by self CPU time and by device time of each (``--profile torch``), then cProfile's
    top host functions: by own time, and with ``--profile host`` by cumulative time too."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    if args.profile == "device":
        return device_profile(phase, device, args)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for backend in (None, "triton"):
        _warm(phase, backend, args)
        if args.profile == "torch":
            with tprofile(activities=acts) as prof:
                t0 = time.perf_counter()
                info = phase(backend)
                wall = time.perf_counter() - t0
            med = statistics.median(info["times"]) * 1e3
            print(f"\n=== profile {backend or 'off'}: median step {med:.2f} ms, phase wall {wall:.2f} s", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            if device.type == "cuda":
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20,
                                                max_name_column_width=60))
        cp = cProfile.Profile()
        cp.enable()
        info = phase(backend)
        cp.disable()
        print(f"\n=== cProfile {backend or 'off'}: {args.steps} steps, median step "
              f"{statistics.median(info['times']) * 1e3:.2f} ms, host {statistics.median(info['host']) * 1e3:.2f} ms "
              f"(both inflated by the profiler)", flush=True)
        for order in ("tottime",) + (("cumulative",) if args.profile == "host" else ()):
            out = io.StringIO()
            pstats.Stats(cp, stream=out).sort_stats(order).print_stats(30 if order == "tottime" else 45)
            print("\n".join(out.getvalue().splitlines()[:60]), flush=True)
    return {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="124m,1.5b")
    p.add_argument("--precisions", default="fp8,bf16")
    p.add_argument("--backends", default="triton,torch",
                   help="agent statistics paths to measure (triton, torch), each optionally with some sites only: "
                        "triton:input+grad_weight")
    p.add_argument("--clip-reads", action="store_true",
                   help="gradient clipping reads every gradient again (clip_grad_norm_), not the agent's rows")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=15, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    p.add_argument("--url", default=None, help="monitor URL; default: a local acknowledging sink (bench/sink.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", nargs="?", const="torch", choices=["torch", "host", "device"],
                   help="instead of the timing, off vs on: torch.profiler tables then cProfile's (torch, the "
                        "default), or cProfile's alone, by own and by cumulative time (host), or the kernels' device "
                        "time per step alone (device)")
    p.add_argument("--no-hist", dest="hist", action="store_false",
                   help="the agent without the optional log2 histogram (SPEC section 4)")
    p.add_argument("--hist-every", type=int, default=10,
                   help="the histogram on every N-th step only (the agent's default, 10; 1: every step)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="every phase replays its steps as CUDA graphs (trainer.graphs.StepGraphs, as fp8mon train "
                        "--cuda-graph), captured in its warm-up: the host's launch costs leave the step")
    p.add_argument("--profile-trace", metavar="DIR",
                   help="with --profile device: write each phase's Chrome trace to DIR/off.json and DIR/triton.json")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the summary to bench/results/agent_overhead.csv")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if args.cuda_graph:
        if not args.device.startswith("cuda"):
            p.error("--cuda-graph needs a CUDA device")
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    sink = None
    url = args.url
    if url is None:
        sink = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sink.py"))], stdout=subprocess.PIPE,
                                text=True)
        url = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
    summary = []
    try:
        for config in args.configs.split(","):
            for precision in args.precisions.split(","):
                summary.append((config, precision, measure(config, precision, args, device, url)))
    finally:
        if sink is not None:
            sink.terminate()
    if args.profile:
        return 0
    print("\nconfig precision   off ms "
          + "".join(f"{b + ' ms':>12}{b + ' %':>10}{'mean %':>9}{'paired %':>10}" for b in args.backends))
    rec = Recorder("agent_overhead")
    for config, precision, r in summary:
        print(f"{config:>6} {precision:>9} {r['off_ms']:8.2f} "
              + "".join(f"{r[f'{b}_ms']:12.2f}{r[b]:+10.2f}{r[f'{b}_mean']:+9.2f}{r[f'{b}_paired']:+10.2f}"
                        for b in args.backends))
        rec.add(f"step_off_ms/{config}/{precision}", r["off_ms"], "ms")
        for b in args.backends:
            rec.add(f"step_on_ms/{config}/{precision}/{b}", r[f"{b}_ms"], "ms")
            rec.add(f"overhead_median_pct/{config}/{precision}/{b}", r[b], "%")
            rec.add(f"overhead_mean_pct/{config}/{precision}/{b}", r[f"{b}_mean"], "%")
            rec.add(f"overhead_paired_pct/{config}/{precision}/{b}", r[f"{b}_paired"], "%")
    print(f"(every=1, every block linear x input/weight/output/grad_output/grad_weight; log2 histogram "
          f"{'every ' + str(args.hist_every) + ' steps' if args.hist else 'off'}; medians of whole steps)")
    if args.record and summary:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
