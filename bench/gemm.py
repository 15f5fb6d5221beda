"""FP8 GEMM benchmark: our Triton ``fp8_gemm`` vs ``torch._scaled_mm`` (tensorwise) vs bf16 cuBLAS.

    PYTHONPATH=$PWD python3 bench/gemm.py --check          # GPU correctness checks, then the benchmark
    PYTHONPATH=$PWD python3 bench/gemm.py --shapes 8192    # only 8192^3
    PYTHONPATH=$PWD python3 bench/gemm.py --check --no-bench --extras   # checks, quantize bandwidth,
        # Fp8Linear vs bf16 nn.Linear fwd+bwd (eager and CUDA graph), BK=256 precise-accumulation trade-off

Shapes: 8192^3 and the trainer's block GEMMs (trainer/config.py, llama arch) for every linear
(QKV, out-proj, FC1 = [gate|up], FC2) in its three GEMMs:
    fwd   (T, out, in)   E4M3 x E4M3 -> bf16, fast accumulation
    dgrad (T, in, out)   E5M2 x E4M3 -> bf16, precise accumulation
    wgrad (out, in, T)   E5M2 x E4M3 -> fp32, precise accumulation
with T tokens: 124M (d 768, SwiGLU hidden 2048), T = 16 x 1024; 1.5B (d 2048, hidden 8192), T = 4 x 2048.
_scaled_mm gets the same operands, layouts, output dtype and accumulation mode (use_fast_accum).
Times are triton.testing.do_bench medians (L2 flushed before each run); with ``--graph``, do_bench_cudagraph
medians instead: device time with no host gaps between launches (L2 not flushed), for the small shapes whose kernels
are shorter than a launch's Python host time; with ``--queued``, device time of eager launches queued back to back
behind a sleep kernel (no host gaps, no graph: the trainer launches eagerly). Each shape is checked
against _scaled_mm before it is timed. ``--check`` first runs the kernel correctness checks (bit
exactness of the quantizers, GEMM errors against an fp64 product, Fp8Linear against nn.Linear, and no
host sync in Fp8Linear's forward + backward). The last lines are a summary table; with $OUT set the
report is also written, line by line, to the file ``--log`` names, and the timed figures are appended to
bench/results/gemm.csv (bench/record.py; ``--no-record`` skips it).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.record import Recorder  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
KINDS = {  # kind: (A dtype, B dtype, out dtype, fast accumulation)
    "fwd": (E4, E4, torch.bfloat16, True),
    "dgrad": (E5, E4, torch.bfloat16, False),
    "wgrad": (E5, E4, torch.float32, False),
}
MODELS = {  # name: (tokens, {linear: (in, out)})
    "124m": (16 * 1024, {"qkv": (768, 2304), "proj": (768, 768), "fc1": (768, 4096), "fc2": (2048, 768)}),
    "1.5b": (4 * 2048, {"qkv": (2048, 6144), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}),
}
LINES: list[str] = []
LOG = None
FAILED: set = set()
CHECK_CFG = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}  # checks: no autotune


def say(*parts):
    line = " ".join(str(p) for p in parts)
    LINES.append(line)
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def shapes(which: str):
    out = []
    if which in ("all", "8192"):
        out += [("8192^3", 8192, 8192, 8192, "fwd"), ("8192^3", 8192, 8192, 8192, "dgrad")]
    for model, (T, lins) in MODELS.items():
        if which not in ("all", model):
            continue
        for name, (fin, fout) in lins.items():
            out += [(f"{model}.{name}", T, fout, fin, "fwd"), (f"{model}.{name}", T, fin, fout, "dgrad"),
                    (f"{model}.{name}", fout, fin, T, "wgrad")]
    return out


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same_fp8(a, b) -> bool:
    """Bit-identical, except that any NaN equals any NaN."""
    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all())


# --------------------------------------------------------------------------------------------------
# correctness checks (GPU)


def diagnose(x, fmt, q, r, parts):
    """Which outputs differ, and a few elements: x, s*x, ours, torch on the GPU, torch on the CPU."""
    from fp8mon.trainer.kernels import quantize_ref

    rc = quantize_ref(x.cpu(), fmt, scale=r.meta[1].cpu())
    qd, rd = (q.data, r.data) if not parts.get("q", True) or parts.get("qT", True) else (q.data_t.t(), r.data)
    diff = ~((qd.view(torch.uint8) == rd.view(torch.uint8)) | (qd.float().isnan() & rd.float().isnan()))
    gpu_vs_cpu = int((r.data.cpu().view(torch.uint8) != rc.data.view(torch.uint8)).sum())
    say(f"  quantize {fmt.name} {x.dtype} {tuple(x.shape)}: MISMATCH {parts}, {int(diff.sum())} elements differ; "
        f"torch GPU vs torch CPU differ in {gpu_vs_cpu}; meta ours {q.meta.tolist()} ref {r.meta.tolist()}")
    if diff.any():
        rows_bad = diff.any(1).nonzero().flatten()
        cols_bad = diff.any(0).nonzero().flatten()
        say(f"    differing rows {rows_bad[:8].tolist()}.. ({len(rows_bad)}), cols {cols_bad[:8].tolist()}.. "
            f"({len(cols_bad)})")
    for idx in diff.nonzero()[:6].tolist():
        xi = x[tuple(idx)].float()
        y = (xi * r.meta[1]).item()
        say(f"    x[{idx}]={xi.item()!r} s*x={y!r} ours=0x{int(qd.view(torch.uint8)[tuple(idx)]):02x} "
            f"torch-gpu=0x{int(r.data.view(torch.uint8)[tuple(idx)]):02x} "
            f"torch-cpu=0x{int(rc.data.view(torch.uint8)[tuple(idx)]):02x}")


def check_quantize(dev):
    from fp8mon.agent.formats import E4M3, E5M2
    from fp8mon.trainer.kernels import (
        delayed_update,
        delayed_update_ref,
        quantize,
        quantize_ref,
        quantize_transpose,
        quantize_transpose_ref,
    )

    bad = 0
    for fmt in (E4M3, E5M2):
        for dt in (torch.float32, torch.bfloat16):
            for M, N in ((1000, 520), (77, 33), (4096, 3072)):
                x = torch.randn(M, N, device=dev) * torch.logspace(-7, 4, N, device=dev)
                x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], device=dev)
                x = x.to(dt)
                r = quantize_transpose_ref(x, fmt)
                if (M, N) == (4096, 3072):  # the three ways of writing qT (H200, Triton 3.6: 0 and 1 fail for fp32)
                    res = {}
                    for mode in (0, 1, 2):
                        qm = quantize_transpose(x, fmt, trans_mode=mode)
                        res[mode] = same_fp8(qm.data_t, r.data_t) and same_fp8(qm.data, r.data)
                    say(f"  quantize_transpose {fmt.name} {dt} 4096x3072, qT bit-exact per trans_mode: {res}")
                q = quantize_transpose(x, fmt)
                q1 = quantize(x, fmt)
                parts = {"q": same_fp8(q.data, r.data), "qT": same_fp8(q.data_t, r.data_t),
                         "meta": torch.equal(q.meta, r.meta), "q1": same_fp8(q1.data, r.data),
                         "meta1": torch.equal(q1.meta, r.meta)}
                ok = all(parts.values())
                bad += not ok
                if not ok:
                    diagnose(x, fmt, q, r, parts)
            # delayed: 6 steps, a 1000x jump at step 3 (stale scale -> saturation), history length 4
            H = 4
            hk, sk, ak = (torch.zeros(H, device=dev), torch.ones((), device=dev), torch.zeros((), device=dev))
            hr, sr = torch.zeros(H, device=dev), torch.ones((), device=dev)
            for step in range(6):
                x = (torch.randn(300, 200, device=dev) * (1000.0 if step == 3 else 1.0)).to(dt)
                qk = quantize_transpose(x, fmt, scale=sk, accum=ak)
                delayed_update(ak, hk, sk, qk.meta, fmt, margin=1)
                rr = quantize_ref(x, fmt, scale=sr)
                delayed_update_ref(rr.amax, hr, sr, fmt, margin=1)
                ok = (same_fp8(qk.data, rr.data) and same_fp8(qk.data_t, rr.data.t()) and torch.equal(qk.meta, rr.meta)
                      and torch.equal(hk, hr) and torch.equal(sk, sr) and float(ak) == 0.0)
                if step == 3:
                    ok = ok and bool((qk.data.float().abs() == fmt.max).any())  # saturated, not inf/NaN
                    ok = ok and bool(torch.isfinite(qk.data.float()).all())
                bad += not ok
                if not ok:
                    say(f"  delayed {fmt.name} {dt} step {step}: MISMATCH {hk.tolist()} {hr.tolist()}")
    say(f"check quantize/quantize_transpose (current + delayed, bit-exact vs torch): {'PASS' if not bad else 'FAIL'}")
    return not bad


def check_gemm(dev):
    from fp8mon.trainer.kernels import fp8_gemm

    bad = 0
    worst = {}
    for impl in ("tma", "ptr"):
        for kind, (da, db, od, fast) in KINDS.items():
            for M, N, K in ((1000, 520, 272), (130, 200, 100), (512, 384, 8192), (256, 256, 128)):
                a = torch.randn(M, K, device=dev).to(da)
                b = torch.randn(N, K, device=dev).to(db)
                sa = torch.tensor(0.37, device=dev)
                sb = torch.tensor(1.9, device=dev)
                bias = torch.randn(N, device=dev) if (M, N) == (1000, 520) else None
                exact = (a.double() @ b.double().t()) * (0.37 * 1.9)
                if bias is not None:
                    exact = exact + bias.double()
                c = fp8_gemm(a, b, sa, sb, out_dtype=od, bias=bias, fast_accum=fast, impl=impl, config=CHECK_CFG)
                e = rel(c, exact)
                tol = (2e-2 if fast else 2e-3) + (4e-3 if od == torch.bfloat16 else 0)
                ok = bool(torch.isfinite(c).all()) and e < tol
                bad += not ok
                worst[(impl, kind)] = max(worst.get((impl, kind), 0.0), e)
                if not ok:
                    say(f"  gemm {impl} {kind} {M}x{N}x{K}: rel err {e:.2e} > {tol:.0e}")
    for kind, (da, db, od, fast) in KINDS.items():  # cuBLAS' own error on the K=8192 case, for comparison
        a = torch.randn(512, 8192, device=dev).to(da)
        b = torch.randn(384, 8192, device=dev).to(db)
        one = torch.tensor(1.0, device=dev)
        try:
            c = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=od, use_fast_accum=fast)
            worst[("_scaled_mm K=8192", kind)] = rel(c, a.double() @ b.double().t())
        except RuntimeError as exc:
            worst[("_scaled_mm K=8192", kind)] = float("nan")
            say(f"  _scaled_mm {kind}: {str(exc).splitlines()[0][:100]}")
    say("check fp8_gemm vs fp64 product (max rel err): "
        + ", ".join(f"{i}/{k} {v:.1e}" for (i, k), v in worst.items()) + f": {'PASS' if not bad else 'FAIL'}")
    precise_accumulation_errors(dev)
    return not bad


def precise_accumulation_errors(dev):
    """How precise "precise accumulation" is, side by side: the fp32-output error against an fp64 product of
    our kernels (promotion into fp32 every 128 products) and of _scaled_mm with and without fast accumulation,
    on the operands where the reverted Gluon kernel (9420403) had 8.8e-5 against _scaled_mm's 2.9e-8: was that
    its bug, or what promoting every 128 products costs on these operands? Printed, not judged."""
    from fp8mon.trainer.kernels import fp8_gemm

    g = torch.Generator().manual_seed(384 + 8192)
    a = (torch.randn(384, 8192, generator=g) * 4).to(E5).to(dev)
    b = (torch.randn(512, 8192, generator=g) * 4).to(E4).to(dev)
    one = torch.tensor(1.0, device=dev)
    exact = a.double() @ b.double().t()
    got = {impl: rel(fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=False, impl=impl), exact)
           for impl in ("tma", "ptr")}
    for fast in (False, True):
        c = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        got[f"_scaled_mm {'fast' if fast else 'precise'}"] = rel(c, exact)
    say("precise accumulation, 384x512x8192 e5m2 x e4m3 (x4), fp32 out, rel err vs fp64: "
        + ", ".join(f"{k} {v:.1e}" for k, v in got.items()))


def check_linear(dev):
    from torch import nn

    from fp8mon.trainer.fp8_linear import Fp8Linear, Fp8Recipe

    bad = 0
    for recipe in (Fp8Recipe(), Fp8Recipe(scaling="delayed", amax_history_len=16)):
        torch.manual_seed(0)
        ours = Fp8Linear(2048, 6144, recipe=recipe, device=dev)
        refm = Fp8Linear(2048, 6144, recipe=recipe, device=dev)
        refm.load_state_dict(ours.state_dict())
        refm.backend = "torch"  # torch float8 + _scaled_mm on the GPU
        lin = nn.Linear(2048, 6144, bias=False, device=dev)
        lin.weight.data.copy_(ours.weight.data)
        errs = {}
        for step in range(3):
            x = torch.randn(4, 512, 2048, device=dev)
            g = torch.randn(4, 512, 6144, device=dev)
            outs = []
            for m in (ours, refm, lin):
                xi = x.clone().requires_grad_()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    y = m(xi)
                y.backward(g.to(y.dtype))
                if m is ours and (y.dtype != torch.bfloat16 or xi.grad.dtype != x.dtype):
                    bad += 1
                    say(f"  Fp8Linear: output {y.dtype} / dx {xi.grad.dtype}, expected bf16 / {x.dtype}")
                outs.append((y.float(), xi.grad.float(), m.weight.grad.float()))
                m.zero_grad(set_to_none=True)
            for i, site in enumerate(("y", "dx", "dw")):
                for j, what in ((1, "vs torch-path"), (2, "vs nn.Linear")):
                    e = rel(outs[0][i], outs[j][i])
                    k = f"{what} {site}"
                    errs[k] = e if (e != e or k not in errs) else max(errs[k], e)  # keep a NaN
        for k in ("input", "weight", "grad_output"):
            if not (torch.equal(ours.fp8_amax[k], refm.fp8_amax[k])
                    and torch.equal(ours.fp8_scale[k], refm.fp8_scale[k])):
                bad += 1
                say(f"  Fp8Linear {recipe.scaling}: amax/scale of {k} differs from the torch path")
        if recipe.scaling == "delayed":
            for k, v in ours.state_dict().items():
                if not torch.equal(v, refm.state_dict()[k]):
                    bad += 1
                    say(f"  Fp8Linear delayed: buffer {k} differs from the torch path")
        over = {k: v for k, v in errs.items()
                if not (v <= (0.1 if "nn.Linear" in k else 2e-2))}  # NaN fails too
        bad += bool(over)
        say(f"  Fp8Linear {recipe.scaling}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        if dev.type != "cuda":
            continue
        # no host sync in forward + backward (after the first calls have compiled and autotuned)
        x = torch.randn(4, 512, 2048, device=dev, requires_grad=True)
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = ours(x)
            y.backward(torch.ones_like(y))
            _ = ours.fp8_amax["grad_output"] * 1.0
            sync_ok = True
        except RuntimeError as exc:
            sync_ok = False
            say(f"  Fp8Linear {recipe.scaling}: host sync: {str(exc).splitlines()[0][:160]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        bad += not sync_ok
        say(f"  Fp8Linear {recipe.scaling}: no host sync in forward+backward: {sync_ok}")
    say(f"check Fp8Linear (triton vs torch path vs nn.Linear, no sync): {'PASS' if not bad else 'FAIL'}")
    return not bad


# --------------------------------------------------------------------------------------------------
# benchmark


def bench(dev, which: str, impls):
    rows = []
    for label, M, N, K, kind in shapes(which):
        try:
            rows.append(bench_one(dev, label, M, N, K, kind, impls))
        except Exception as exc:
            say(f"  {label} {kind}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return rows


GRAPH = False  # --graph: device time (CUDA graph replays) instead of eager launches
QUEUED = False  # --queued: device time of eager launches queued back to back


def timed(fn) -> float:
    """Median ms of ``fn``: eager do_bench, do_bench_cudagraph with ``--graph``, or with ``--queued`` the median of 5
    rounds of 20 eager calls queued behind a sleep kernel (``trainer.kernels.timing.device_medians``)."""
    import triton
    if QUEUED:
        from fp8mon.trainer.kernels.timing import device_medians
        return device_medians({0: fn}, rounds=5)[0]
    if GRAPH:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    return triton.testing.do_bench(fn, return_mode="median")


def bench_one(dev, label, M, N, K, kind, impls):
    from fp8mon.trainer.kernels import fp8_gemm

    def tflops(ms):
        return 2.0 * M * N * K / (ms * 1e-3) / 1e12

    da, db, od, fast = KINDS[kind]
    a = torch.randn(M, K, device=dev).to(da)
    b = torch.randn(N, K, device=dev).to(db)
    sa = torch.tensor(0.05, device=dev)
    sb = torch.tensor(0.02, device=dev)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)

    def scaled():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=od, use_fast_accum=fast)

    ref = scaled()
    res = {}
    for impl in impls:
        if impl in FAILED:
            continue
        try:
            c = fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=fast, impl=impl)
        except Exception as exc:
            if impl not in FAILED:
                say(f"  {impl}: ERROR {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
            FAILED.add(impl)
            continue
        err = rel(c, ref)
        if not (err < 3e-2):
            say(f"  {label} {kind} {impl}: rel diff vs _scaled_mm {err:.2e}: WRONG, not timed")
            continue
        res[impl] = tflops(timed(lambda: fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=fast, impl=impl)))
    res["_scaled_mm"] = tflops(timed(scaled))
    res["bf16"] = tflops(timed(lambda: a16 @ b16.t()))
    ours = res.get(impls[0], float("nan"))
    say(f"  {label:10s} {kind:5s} {M:6d}x{N:6d}x{K:6d} " + " ".join(f"{k} {v:7.1f}" for k, v in res.items())
        + f"  ours/_scaled_mm {ours / res['_scaled_mm']:.3f}")
    return (label, kind, M, N, K, res, ours / res["_scaled_mm"])


def host_us(fn, n: int = 200) -> float:
    """Host time per call (µs) of ``fn``, n calls queued back to back (the GPU is synchronized before and after)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def profile_calls(fn, n: int = 200, top: int = 25) -> str:
    """cProfile of n calls of ``fn``: the ``top`` entries by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def host_profile(dev, which: str):
    """Host time per call (200 calls queued back to back) of fp8_gemm(impl="auto") and _scaled_mm per shape, then a
    cProfile of fp8_gemm on the first shape: where a launch's Python time goes."""
    from fp8mon.trainer.kernels import fp8_gemm

    def calls(M, N, K, kind):
        da, db, od, fast = KINDS[kind]
        a = torch.randn(M, K, device=dev).to(da)
        b = torch.randn(N, K, device=dev).to(db)
        sa, sb = torch.tensor(0.05, device=dev), torch.tensor(0.02, device=dev)
        return (lambda: fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=fast),
                lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=od, use_fast_accum=fast))

    first = None
    for label, M, N, K, kind in shapes(which):
        ours, scaled = calls(M, N, K, kind)
        say(f"  host {label:10s} {kind:5s} {M}x{N}x{K}: fp8_gemm {host_us(ours):.0f} us, _scaled_mm "
            f"{host_us(scaled):.0f} us per call")
        first = first or (label, kind, ours)
    say(f"  cProfile of 200 fp8_gemm calls, {first[0]} {first[1]}:\n" + profile_calls(first[2]))


def bench_linear(dev):
    """Fp8Linear vs bf16-autocast nn.Linear, forward + backward (quantize cost included), eager and as a
    replayed CUDA graph (the graph removes the host's launch overhead: it shows the GPU time alone)."""
    import triton
    from torch import nn

    from fp8mon.trainer.fp8_linear import Fp8Linear

    say("Fp8Linear fwd+bwd vs bf16-autocast nn.Linear, ms (eager | CUDA graph), speedup = bf16 / fp8:")
    for model, (T, lins) in MODELS.items():
        for name, (fin, fout) in lins.items():
            x = torch.randn(T, fin, device=dev, dtype=torch.bfloat16, requires_grad=True)
            times = {}
            mods = (("fp8", Fp8Linear(fin, fout, device=dev)), ("bf16", nn.Linear(fin, fout, bias=False, device=dev)))
            for label, m in mods:
                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # graph-capturable
                        y = m(x)
                    y.backward(torch.ones_like(y))

                step()
                times[label] = triton.testing.do_bench(step, return_mode="median", grad_to_none=[x, m.weight])
                try:
                    x.grad = m.weight.grad = None
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step()
                    torch.cuda.current_stream().wait_stream(side)
                    x.grad = m.weight.grad = None
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    times[label + "_graph"] = triton.testing.do_bench(graph.replay, return_mode="median")
                except Exception as exc:
                    times[label + "_graph"] = float("nan")
                    say(f"  {label} graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
                x.grad = m.weight.grad = None
            say(f"  {model}.{name:5s} T={T} {fin}->{fout}: fp8 {times['fp8']:.3f} | {times['fp8_graph']:.3f}  "
                f"bf16 {times['bf16']:.3f} | {times['bf16_graph']:.3f}  speedup {times['bf16'] / times['fp8']:.2f} | "
                f"{times['bf16_graph'] / times['fp8_graph']:.2f}")


def bench_precise_bk256(dev):
    """How much of the precise-accumulation cost goes with promoting every 256 instead of every 128 products
    (BK = 256 tiles): time and error at 8192^3 dgrad (E5M2 x E4M3 -> bf16) and a K=8192 fp32 case."""
    import triton

    from fp8mon.trainer.kernels import fp8_gemm

    a = torch.randn(8192, 8192, device=dev).to(E5)
    b = torch.randn(8192, 8192, device=dev).to(E4)
    one = torch.tensor(1.0, device=dev)
    a2 = torch.randn(512, 8192, device=dev).to(E5)
    b2 = torch.randn(384, 8192, device=dev).to(E4)
    exact = a2.double() @ b2.double().t()
    say("precise accumulation, promotion interval = BK (tma, explicit configs):")
    for cfg, fast in (((128, 128, 128, 4, 8), False), ((128, 256, 128, 3, 8), False), ((128, 128, 256, 3, 8), False),
                      ((128, 256, 256, 2, 8), False), ((128, 256, 128, 3, 8), True)):
        bm, bn, bk, st, w = cfg
        conf = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_stages": st, "num_warps": w}
        try:
            ms = triton.testing.do_bench(lambda: fp8_gemm(a, b, one, one, torch.bfloat16, fast_accum=fast,
                                                          impl="tma", config=conf), return_mode="median")
            err = rel(fp8_gemm(a2, b2, one, one, torch.float32, fast_accum=fast, impl="tma", config=conf), exact)
            say(f"  {bm}x{bn}x{bk} s{st} w{w} {'fast' if fast else 'precise'}: "
                f"{2 * 8192 ** 3 / ms / 1e9:.0f} TFLOP/s, rel err (K=8192, fp32 out) {err:.1e}")
        except Exception as exc:
            say(f"  {bm}x{bn}x{bk} s{st} w{w}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}")


def bench_quantize(dev):
    import triton

    from fp8mon.agent.formats import E4M3
    from fp8mon.trainer.kernels import quantize_ref, quantize_transpose

    say("quantize_transpose (current scaling: amax pass + cast pass writing q and qT), bf16 input:")
    for M, N in ((16384, 768), (8192, 2048), (8192, 16384)):
        x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        t_q = triton.testing.do_bench(lambda: quantize_transpose(x, E4M3), return_mode="median")
        t_ref = triton.testing.do_bench(lambda: quantize_ref(x, E4M3), return_mode="median")
        t_copy = triton.testing.do_bench(lambda: x.clone(), return_mode="median")
        byts = x.numel() * (2 + 2 + 1 + 1)  # read twice (amax, cast), write q and qT
        say(f"  {M}x{N}: {t_q * 1e3:.1f} us ({byts / t_q / 1e6:.0f} GB/s moved), torch ref (no transpose) "
            f"{t_ref * 1e3:.1f} us, bf16 clone {t_copy * 1e3:.1f} us ({4 * x.numel() / t_copy / 1e6:.0f} GB/s)")


def record(rows, which: str, clock: str, geomean: float) -> None:
    """Appends each shape's TFLOP/s and ratio, and the geometric mean and minimum, to bench/results/gemm.csv."""
    rec = Recorder("gemm")
    for label, kind, _M, _N, _K, res, ratio in rows:
        for impl, tflops in res.items():
            name = {"_scaled_mm": "scaled_mm"}.get(impl, impl)
            rec.add(f"tflops_{name}/{label}/{kind}/{clock}", tflops, "TFLOP/s")
        rec.add(f"ratio_ours_to_scaled_mm/{label}/{kind}/{clock}", ratio, "ratio")
    rec.add(f"ratio_geomean/{which}/{clock}", geomean, "ratio")
    rec.add(f"ratio_min/{which}/{clock}", min(r[6] for r in rows), "ratio")
    rec.write()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="run the GPU correctness checks first")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--shapes", default="all", choices=["all", "8192", "124m", "1.5b"])
    p.add_argument("--impls", default="auto,tma,ptr",
                   help="Triton GEMM variants to time; the first is 'ours' in the ratio (auto = the default)")
    p.add_argument("--extras", action="store_true",
                   help="also time quantize_transpose, Fp8Linear fwd+bwd (eager, CUDA graph) and BK=256 precise GEMMs")
    p.add_argument("--graph", action="store_true", help="time GEMMs as CUDA graph replays (device time)")
    p.add_argument("--queued", action="store_true", help="time GEMMs as eager launches queued back to back (device "
                   "time; cuBLAS may pick other kernels under graph capture)")
    p.add_argument("--host", action="store_true", help="host time per call and a cProfile of fp8_gemm, no timing")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/gemm.csv")
    p.add_argument("--log", metavar="FILE", help="also write the report, line by line, to FILE")
    args = p.parse_args(argv)
    global GRAPH, QUEUED
    GRAPH, QUEUED = args.graph, args.queued
    if not torch.cuda.is_available():
        print("bench/gemm.py needs a CUDA GPU (the kernels are tested on the CPU by tests/trainer/test_kernels.py)")
        return 0
    dev = torch.device("cuda")
    import triton

    global LOG
    if args.log:
        LOG = open(args.log, "w")

    say(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    torch.manual_seed(0)
    ok = True
    t0 = time.time()
    if args.check:
        for fn in (check_quantize, check_gemm, check_linear):
            try:
                ok &= fn(dev)
            except Exception:  # report and go on to the benchmark
                ok = False
                say(f"check {fn.__name__}: ERROR\n" + traceback.format_exc(limit=6))
        say(f"checks done in {time.time() - t0:.0f} s")
    rows = []
    if args.host:
        host_profile(dev, args.shapes)
        return 0
    if not args.no_bench:
        say("TFLOP/s (" + ("queued device time" if QUEUED else "do_bench_cudagraph" if GRAPH else "do_bench")
            + " medians):")
        try:
            rows = bench(dev, args.shapes, [i for i in args.impls.split(",") if i])
        except Exception:
            ok = False
            say("bench: ERROR\n" + traceback.format_exc(limit=6))

    if args.extras:
        for fn in (bench_quantize, bench_linear, bench_precise_bk256):
            try:
                fn(dev)
            except Exception:
                say(f"{fn.__name__}: ERROR\n" + traceback.format_exc(limit=6))
    if rows:
        try:  # the autotuners' picks, for the record
            fg = sys.modules["fp8mon.trainer.kernels.fp8_gemm"]  # the module (the package exports the function)

            for name, tuner in (("tma", fg._tma_tuned), ("ptr", fg._ptr_tuned)):
                for key, cfg in tuner.cache.items():
                    say(f"  best {name} {key[:3]} {key[3] if len(key) > 3 else ''} {key[5:8]}: {cfg}")
            say(f"  auto picks: { {k[:2]: v for k, v in fg._AUTO_CHOICE.items()} }")
        except Exception as exc:
            say(f"  (autotuner cache not readable: {exc})")
    if rows:
        cols = [*dict.fromkeys(k for r in rows for k in r[5])]
        say("summary (TFLOP/s): shape kind | " + " | ".join(cols) + " | ours/_scaled_mm")
        for label, kind, M, N, K, res, ratio in rows:
            say(f"{label} {kind} {M}x{N}x{K} | " + " | ".join(f"{res.get(c, float('nan')):.0f}" for c in cols)
                + f" | {ratio:.3f}")
        geo = 1.0
        for r in rows:
            geo *= r[6]
        say(f"geomean ours/_scaled_mm over {len(rows)} shapes: {geo ** (1 / len(rows)):.3f}; "
            f"min {min(r[6] for r in rows):.3f}; total {time.time() - t0:.0f} s")
        if args.record:
            record(rows, args.shapes, "queued" if QUEUED else "graph" if GRAPH else "eager", geo ** (1 / len(rows)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
