"""Cost of the statistics fused into quantize_transpose (trainer/kernels/quantize_transpose.py), on a GPU:
kernel time with and without ``stats=``, with and without the histogram, at register caps of the statistics
variant (``STATS_MAXNREG``), pipelining depths of its tile loop (``STATS_STAGES``) and row lengths of its view
of a tile (``_STATS_V``), on the 1.5B model's activation and weight shapes. CUDA-event medians
(``triton.testing.do_bench``), all in one run.

    python3 bench/qt_stats.py            # every variant of VARIANTS
    python3 bench/qt_stats.py --defaults # the defaults only (histogram on and off): two compiles per input
    python3 bench/qt_stats.py --sweep-v  # V 8 / 16 x depth 1 / 2 (depth 1 only with the histogram)
    python3 bench/qt_stats.py --defaults --step 1.5b  # instead of CASES, the casts of one bench/agent_overhead.py step
    python3 bench/qt_stats.py --step 1.5b --packed-ab  # the bf16 casts: plain / statistics without and with PACKED
    python3 bench/qt_stats.py --step 1.5b --current-ab  # current scaling: the row from the amax pass or the cast
    python3 bench/qt_stats.py --step 124m --variants "default;trainer.kernels.quantize.STATS_PROGRAMS_PER_SM=2"

``--step C``: the tensors an FP8 step of config C casts (bench/train_step.py's batch; llama: every block's four
inputs and grad_outputs in bf16, its four fp32 weights), each with a given scale (delayed scaling), so that neither
variant runs the amax pass of current scaling and the ratio is that of the two cast kernels alone.
``--packed-ab``: the step's bf16 casts with current scaling (the amax pass in every variant), no histogram: the plain
cast, the statistics variant without and with the word loop (``PACKED_STATS``), queued device time
(``trainer.kernels.timing.device_medians``, 7 interleaved rounds of 20 calls).
``--current-ab``: every cast of the step with current scaling (the trainer's default), without and with the
histogram: the plain cast (amax pass + cast), the statistics row made by the standalone kernel in place of the amax
pass (``CURRENT_STATS = "row"``), and by the cast's statistics variant after the amax pass (``"cast"``); queued
device time as for ``--packed-ab``, and host time per call (``calls`` eager calls of each in turn, the GPU idle at
the start, median of 7 rounds), with each case's total over one layer.
``--variants V``: the casts with statistics (no histogram; delayed scaling, as ``--step`` gives) under each setting of
``bench/variants.py``, against the plain cast, queued device time as for ``--packed-ab``, and the total over one layer.
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8mon.agent.stats import launch as ts  # noqa: E402
import importlib  # noqa: E402
QT = importlib.import_module("fp8mon.trainer.kernels.quantize_transpose")

CASES = [("activation 16384x2048 bf16, current", (16384, 2048), torch.bfloat16, False),
         ("grad_output 16384x8192 bf16, current", (16384, 8192), torch.bfloat16, False),
         ("weight 6144x2048 fp32, delayed", (6144, 2048), torch.float32, True)]


# (histogram, register cap, pipelining depth of the persistent tile loop, V); None: the module's default
VARIANTS = [(True, 128, None, None), (True, 128, 1, None), (True, 128, 2, None), (True, 128, 3, None),
            (True, None, 2, None), (True, None, 3, None),
            (False, 128, None, None), (False, 128, 1, None), (False, 128, 2, None), (False, 128, 3, None)]
SWEEP_V = [(False, 128, 1, 8), (False, 128, 2, 8), (False, 128, 1, 16), (False, 128, 2, 16), (True, 128, 1, 8),
           (True, 128, 1, 16)]


def step_cases(config: str) -> list:
    """(label, shape, dtype, delayed) of the casts of one layer of an FP8 step of ``config`` (see the docstring)."""
    from bench.train_step import BATCH
    from fp8mon.trainer.config import get_config

    cfg = get_config(config)
    t, d, f = BATCH[config] * cfg.seq_len, cfg.d_model, cfg.d_ff
    ins = {"qkv/fc1 input": (t, d), "fc2 input": (t, f)}  # proj's input has qkv's shape
    grads = {"qkv grad_output": (t, 3 * d), "proj/fc2 grad_output": (t, d), "fc1 grad_output": (t, 2 * f)}
    weights = {"qkv weight": (3 * d, d), "proj weight": (d, d), "fc1 weight": (2 * f, d), "fc2 weight": (d, f)}
    return ([(f"{k} {a}x{b} bf16", (a, b), torch.bfloat16, True) for k, (a, b) in {**ins, **grads}.items()]
            + [(f"{k} {a}x{b} fp32", (a, b), torch.float32, True) for k, (a, b) in weights.items()])


def packed_ab(cases: list) -> None:
    """``--packed-ab`` (the module docstring)."""
    from fp8mon.trainer.kernels.timing import device_medians

    dev = torch.device("cuda")
    for label, shape, dtype, _ in cases:
        if dtype != torch.bfloat16:
            continue
        x = torch.randn(shape, device=dev).to(dtype)
        tgt = ts.Target.new(dev, hist=False)

        def variant(packed, stats):
            def fn():
                QT.PACKED_STATS = packed
                return QT.quantize_transpose(x, "e4m3", stats=tgt if stats else None)
            return fn

        fns = {"plain": variant(True, False), "fast": variant(False, True), "packed": variant(True, True)}
        for fn in fns.values():
            fn()  # compiles outside the timing
        t = device_medians(fns, rounds=7, calls=20)
        QT.PACKED_STATS = True
        print(f"{label}: " + ", ".join(f"{k} {v * 1e3:.1f} us ({v / t['plain']:.2f}x)" for k, v in t.items())
              + f" | packed / fast {t['packed'] / t['fast']:.3f}", flush=True)


def _host_ms(fn, calls: int = 20) -> float:
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def current_ab(cases: list) -> None:
    """``--current-ab`` (the module docstring)."""
    from fp8mon.trainer.kernels.timing import _medians, device_medians

    dev = torch.device("cuda")
    totals: dict = {}
    for label, shape, dtype, _ in cases:
        x = torch.randn(shape, device=dev).to(dtype)
        fmt = "e4m3"
        for hist in (False, True):
            tgt = ts.Target.new(dev, hist=hist, center=(0.0, 1.0))

            def variant(mode):
                def fn():
                    QT.CURRENT_STATS = (mode or "row").split("_")[0]
                    ts.CAST_MERGE = "last" if mode == "row_last" else "later"
                    return QT.quantize_transpose(x, fmt, stats=tgt if mode else None)
                return fn

            # "row": its row merged later, here by a merge launch at the next call (the same row is merged into
            # again); in a step, one merge launch takes every cast's row. "row_last": merged by the last program.
            fns = {"plain": variant(None), "row": variant("row"), "row_last": variant("row_last"),
                   "cast": variant("cast")}
            for fn in fns.values():
                fn()  # compiles outside the timing
            d = device_medians(fns, rounds=7, calls=20)
            h = _medians(fns, 7, _host_ms)
            QT.CURRENT_STATS, ts.CAST_MERGE = "row", "later"
            ts.flush_deferred()
            for k in fns:
                tot = totals.setdefault((hist, k), [0.0, 0.0])
                tot[0] += d[k]
                tot[1] += h[k]
            print(f"{label}{' +hist' if hist else ''}: device " + ", ".join(
                f"{k} {v * 1e3:.1f} us ({v / d['plain']:.2f}x)" for k, v in d.items()) + " | host " + ", ".join(
                f"{k} {v * 1e3:.1f} us" for k, v in h.items()), flush=True)
    for hist in (False, True):
        dp, hp = totals[(hist, "plain")]
        print(f"one layer's casts{' +hist' if hist else ''}: " + ", ".join(
            f"{k} device {totals[(hist, k)][0] * 1e3:.1f} us (+{(totals[(hist, k)][0] - dp) * 1e3:.1f}), host "
            f"{totals[(hist, k)][1] * 1e3:.1f} us (+{(totals[(hist, k)][1] - hp) * 1e3:.1f})"
            for k in ("plain", "row", "row_last", "cast")), flush=True)


def variants_ab(cases: list, variants: list) -> None:
    """``--variants`` (the module docstring)."""
    from bench.variants import applied
    from fp8mon.trainer.kernels.timing import device_medians

    dev = torch.device("cuda")
    totals = {}
    for label, shape, dtype, delayed in cases:
        x = torch.randn(shape, device=dev).to(dtype)
        scale = torch.tensor(4.0, device=dev) if delayed else None
        accum = torch.zeros((), device=dev) if delayed else None
        tgt = ts.Target.new(dev, hist=False)

        def under(assignments, stats):
            def fn():
                with applied(assignments):
                    return QT.quantize_transpose(x, "e4m3", scale, accum, stats=tgt if stats else None)
            return fn

        fns = {"plain": under([], False), **{v: under(a, True) for v, a in variants}}
        for fn in fns.values():
            fn()  # compiles outside the timing
        t = device_medians(fns, rounds=7, calls=20)
        for k, v in t.items():
            totals[k] = totals.get(k, 0.0) + v
        print(f"{label}: " + ", ".join(f"{k} {v * 1e3:.1f} us ({v / t['plain']:.2f}x)" for k, v in t.items()),
              flush=True)
    print("one layer: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in totals.items()), flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cases = step_cases(argv[argv.index("--step") + 1]) if "--step" in argv else CASES
    if "--variants" in argv:
        from bench.variants import parse_all

        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
        variants_ab(cases, parse_all(argv[argv.index("--variants") + 1]))
        return 0
    if "--packed-ab" in argv or "--current-ab" in argv:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
        (packed_ab if "--packed-ab" in argv else current_ab)(cases)
        return 0
    defaults = (QT.STATS_MAXNREG, QT.STATS_STAGES, QT._STATS_V)
    variants = [(True, defaults[0], None, None), (False, defaults[0], None, None)] if "--defaults" in argv else \
        SWEEP_V if "--sweep-v" in argv else VARIANTS
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for label, shape, dtype, delayed in cases:
        x = torch.randn(shape, device=dev).to(dtype)
        scale = torch.tensor(4.0, device=dev) if delayed else None
        accum = torch.zeros((), device=dev) if delayed else None
        fmt = "e4m3"
        t = {"no stats": triton.testing.do_bench(lambda: QT.quantize_transpose(x, fmt, scale, accum),
                                                 return_mode="median")}
        for hist, cap, stages, v in variants:
            QT.STATS_MAXNREG, QT.STATS_STAGES = cap, defaults[1] if stages is None else stages
            QT._STATS_V = defaults[2] if v is None else v
            tgt = ts.Target.new(dev, hist=hist)
            fn = lambda: QT.quantize_transpose(x, fmt, scale, accum, stats=tgt)  # noqa: E731
            name = f"stats{'' if hist else ' -hist'} cap {cap} stages {stages or 'default'} V {v or 'default'}"
            try:
                t[name] = triton.testing.do_bench(fn, return_mode="median")
            except Exception as exc:  # e.g. a pipelining depth that does not compile: report, go on
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        QT.STATS_MAXNREG, QT.STATS_STAGES, QT._STATS_V = defaults
        base = t["no stats"]
        gbytes = x.numel() * x.element_size() / 1e9
        print(f"{label}: " + ", ".join(f"{k} {v * 1e3:.0f} us ({v / base:.2f}x)" for k, v in t.items())
              + f" | input {gbytes:.3f} GB, no stats {gbytes / base * 1e3:.0f} GB/s read", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
