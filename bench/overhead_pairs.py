"""The agent's overhead from adjacent steps: one model whose optimizer step is captured as CUDA graphs without the
agent and with it (every block linear watched at all five sites at every step, as ``bench/agent_overhead.py``), then
replayed in pairs, off and on side by side (off-on, then on-off, alternately), ``--pairs`` times.

    python bench/overhead_pairs.py --configs 124m,1.5b --precisions bf16,fp8 --pairs 100     # on a GPU

``bench/agent_overhead.py`` times whole phases, each with its own agent and its own captures, and compares medians
across them: the machine's drift between phases, and each capture's own memory layout, moved its figures by up to
0.9 points between runs of one tree (bench/RESULTS.md), more than most settings it was asked to tell apart. Here the
two graphs are captured once and each on-step is compared with the off-step beside it:
- "median %": the median over pairs of on / off - 1, with a 95% bootstrap interval (resampling the pairs);
- "mean %": mean(on) / mean(off) - 1 over all pairs, with its interval: it carries the histogram steps (every
  ``--hist-every``-th on-step), the amortized cost.
Both graphs share one memory pool and the model's parameters and optimizer state: every step, off or on, trains it.
``--variants`` as in ``agent_overhead.py`` (a fresh model per variant).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent import Agent  # noqa: E402
from agent.wire import SITES  # noqa: E402
from bench.train_step import BATCH, build, optimizer_step  # noqa: E402
from bench.variants import applied, parse_all  # noqa: E402
from trainer.graphs import StepGraphs, tensor_lr  # noqa: E402


def interval(values: list[float], stat, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``stat`` over ``n`` resamples of ``values`` with replacement."""
    rng = random.Random(seed)
    got = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    return got[int(0.025 * n)], got[int(0.975 * n) - 1]


def summary(offs: list[float], ons: list[float]) -> dict:
    """Overheads (%) of paired step times: the median of the pairs' ratios and the ratio of the means, each with a
    95% bootstrap interval over the pairs."""
    pairs = list(zip(offs, ons, strict=True))
    med = lambda ps: statistics.median(b / a for a, b in ps) * 100 - 100  # noqa: E731
    mean = lambda ps: statistics.mean(b for _, b in ps) / statistics.mean(a for a, _ in ps) * 100 - 100  # noqa: E731
    return {"off_ms": statistics.median(offs) * 1e3, "on_ms": statistics.median(ons) * 1e3,
            "median": med(pairs), "median_ci": interval(pairs, med), "mean": mean(pairs),
            "mean_ci": interval(pairs, mean), "pairs": len(pairs)}


def measure(config: str, precision: str, args, device: torch.device, url: str) -> dict:
    model, optimizer, cfg = build(config, "llama", precision, args.vocab, "current", device)
    batch = args.batch_size or BATCH[config]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    tensor_lr(optimizer, device)  # capturable
    watching = [None]  # read at each capture: the on-graph's clipping takes its norms from the agent's rows

    def step():
        return optimizer_step(model, optimizer, params, precision, x, y, agent=watching[0])

    off = StepGraphs(step, warmup=1)
    for _ in range(1 + args.warmup):  # eagerly, then captured before any hook exists
        off()
    spool = tempfile.TemporaryDirectory()
    agent = Agent(url, run=f"pairs-{config}-{precision}-{int(time.time())}", every=1, modules=r"^blocks\.",
                  spool_dir=spool.name, stats_backend="triton", sites=SITES, hist=args.hist,
                  hist_every=args.hist_every).watch(model)
    agent.step(0)
    watching[0] = agent
    on = StepGraphs(step, agent=agent, warmup=1, share=off)
    logged = [0]

    def on_step():
        loss = on()
        agent.log(logged[0], loss=loss.detach())
        logged[0] += 1

    for _ in range(2 * args.hist_every + args.warmup):  # each kind of on-step eagerly, then captured
        on_step()
    torch.cuda.synchronize()
    offs, ons = [], []
    for i in range(args.pairs):
        for which in ((off, on_step) if i % 2 == 0 else (on_step, off)):
            t0 = time.perf_counter()
            which()
            torch.cuda.synchronize()
            (offs if which is off else ons).append(time.perf_counter() - t0)
    delivered = agent.close(timeout=120)
    spool.cleanup()
    if agent.errors or not delivered:
        raise RuntimeError(f"the agent failed: {agent.errors} errors, last {agent.last_error}, "
                           f"delivered={delivered}")
    return summary(offs, ons)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="124m")
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--pairs", type=int, default=100, help="off/on pairs timed")
    p.add_argument("--warmup", type=int, default=2, help="untimed replays of each graph before the pairs")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--no-hist", dest="hist", action="store_false",
                   help="the agent without the optional log2 histogram (SPEC section 4)")
    p.add_argument("--hist-every", type=int, default=10,
                   help="the histogram on every N-th on-step only (the agent's default, 10)")
    p.add_argument("--variants", default="default", help="as bench/agent_overhead.py's --variants")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the steps are CUDA graphs)")
    try:
        variants = parse_all(args.variants)
    except ValueError as e:
        p.error(str(e))
    warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    sink = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sink.py"))], stdout=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
    rows = []
    try:
        for name, assignments in variants:
            with applied(assignments):
                for config in args.configs.split(","):
                    for precision in args.precisions.split(","):
                        rows.append((name, config, precision, measure(config, precision, args, device, url)))
                        torch.cuda.empty_cache()
    finally:
        sink.terminate()
    print("\nconfig precision   off ms    on ms   median %   (95%)             mean %    (95%)            pairs  variant")
    for name, config, precision, r in rows:
        (ml, mh), (al, ah) = r["median_ci"], r["mean_ci"]
        print(f"{config:>6} {precision:>9} {r['off_ms']:8.2f} {r['on_ms']:8.2f} {r['median']:+9.2f}  "
              f"[{ml:+.2f}, {mh:+.2f}]  {r['mean']:+9.2f}  [{al:+.2f}, {ah:+.2f}]  {r['pairs']:6d}  {name}")
    print(f"(every=1, every block linear x {'/'.join(SITES)}; log2 histogram "
          f"{'every ' + str(args.hist_every) + ' on-steps' if args.hist else 'off'}; adjacent off/on steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
