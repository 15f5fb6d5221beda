"""What the statistics epilogue costs an FP8 GEMM: ``fp8_gemm(stats=)`` against the same GEMM without.

    PYTHONPATH=$PWD python3 bench/gemm_stats.py                  # 124m and 1.5b fwd + wgrad, on a GPU
    PYTHONPATH=$PWD python3 bench/gemm_stats.py --shapes 1.5b --kinds fwd

Per shape (bench/gemm.py's fwd and wgrad GEMMs, the two that carry the agent's ``output`` and ``grad_weight``
rows), device time of eager launches queued back to back (``trainer.kernels.timing.device_medians``), in one run:
  plain       ``fp8_gemm(impl="auto")`` without statistics (what the step runs with the agent off)
  tma         the TMA kernel without statistics (the kernel the statistics variant runs on)
  stats+hist  ``fp8_gemm(stats=Target(hist=True))`` (the agent's default row, outlier center given)
  stats       the same without the log2 histogram
  read+hist   ``plain``, then the standalone kernel reads the result (``stats.launch.rows``): the output row
              read apart instead of taken in the epilogue
  read        the same without the histogram
and each statistics time as a multiple of ``plain``. The compiled statistics kernel's registers and spills are
printed where Triton reports them. ``--host``: instead, the host time per call of plain, stats and read (200 calls
queued back to back, median of ``--rounds`` rounds, interleaved): what each costs a host-bound step.
The figures are appended to bench/results/gemm_stats.csv (bench/record.py; ``--no-record`` skips it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gemm import KINDS, MODELS, host_us  # noqa: E402
from bench.record import Recorder  # noqa: E402


def shapes(which: str, kinds: list[str]):
    for model in (["124m", "1.5b"] if which == "all" else [which]):
        tokens, linears = MODELS[model]
        for name, (fin, fout) in linears.items():
            dims = {"fwd": (tokens, fout, fin), "wgrad": (fout, fin, tokens)}
            for kind in kinds:
                yield f"{model}.{name}", kind, dims[kind]


def kernel_info(fn) -> str:
    """Registers / spills of the variants of a Triton kernel compiled so far."""
    out = []
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):  # autotuner / heuristics wrappers
        fn = fn.fn
    for per_dev in getattr(fn, "device_caches", {}).values():
        cache = per_dev[0] if isinstance(per_dev, tuple) else per_dev
        for k in cache.values():
            if getattr(k, "n_regs", None) is not None:
                out.append(f"{k.n_regs}r/{k.n_spills}s")
    return " ".join(sorted(set(out))) or "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="all", choices=["all", "124m", "1.5b"])
    p.add_argument("--kinds", default="fwd,wgrad")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--host", action="store_true", help="host time per call instead of device time")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/gemm_stats.csv")
    args = p.parse_args(argv)
    rec = Recorder("gemm_stats")
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer.kernels import fp8_gemm
    from fp8mon.trainer.kernels.fp8_gemm import _fp8_gemm_tma_kernel
    from fp8mon.trainer.kernels.timing import _medians, device_medians

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    print(f"{'shape':12s} {'kind':5s} {'M x N x K':>20s} {'plain':>8s} {'tma':>8s} {'st+hist':>8s} {'stats':>8s}"
          f" {'rd+hist':>8s} {'read':>8s}  (us; each / plain)", flush=True)
    for label, kind, (M, N, K) in shapes(args.shapes, args.kinds.split(",")):
        da, db, od, fast = KINDS[kind]
        a = torch.randn(M, K, device=dev).to(da)
        b = torch.randn(N, K, device=dev).to(db)
        sa, sb = torch.tensor(0.05, device=dev), torch.tensor(0.02, device=dev)
        rows = torch.zeros(2, ts.ds.WIDTH, dtype=torch.float64, device=dev)
        center = torch.tensor([0.0, 1.0], dtype=torch.float64, device=dev)

        def run(impl="auto", hist=None):
            stats = None if hist is None else ts.Target(rows, 0, False, center, hist=hist, fmt="e4m3")
            return fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=fast, impl=impl, stats=stats)

        def read(hist):
            y = run()
            ts.rows([y], fmt="e4m3", center=[center], hist=hist, out=rows, index=[0], merge=[False])
            return y

        fns = {"plain": run, "tma": lambda: run("tma"), "st+hist": lambda: run(hist=True),
               "stats": lambda: run(hist=False), "read+hist": lambda: read(True), "read": lambda: read(False)}
        if args.host:
            # host microseconds per call (200 calls queued back to back), median over interleaved rounds
            t = _medians({k: fns[k] for k in ("plain", "stats", "read")}, args.rounds, host_us)
            print(f"{label:12s} {kind:5s} {M:6d}x{N:6d}x{K:6d} host us per call: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
            for k, v in t.items():
                rec.add(f"host_us/{label}/{kind}/{k}", v, "us")
            continue
        t = device_medians(fns, rounds=args.rounds)
        base = t["plain"]
        print(f"{label:12s} {kind:5s} {M:6d}x{N:6d}x{K:6d} " + " ".join(f"{t[k] * 1e3:8.1f}" for k in fns)
              + "  " + " ".join(f"{t[k] / base:.2f}x" for k in ("st+hist", "stats", "read+hist", "read")), flush=True)
        for k, v in t.items():
            rec.add(f"device_us/{label}/{kind}/{k}", v * 1e3, "us")
            if k not in ("plain", "tma"):
                rec.add(f"ratio_to_plain/{label}/{kind}/{k}", v / base, "ratio")
    print(f"# statistics TMA kernel variants compiled: {kernel_info(_fp8_gemm_tma_kernel)}", flush=True)
    if args.record and rec.rows:
        rec.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
