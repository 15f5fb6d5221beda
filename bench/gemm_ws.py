"""The warp-specialized Gluon precise-accumulation GEMM (trainer/kernels/fp8_gemm_ws.py) against torch._scaled_mm
(precise) and our Triton fp8_gemm(fast_accum=False): accuracy against an fp64 product, then speed.

    python3 bench/gemm_ws.py acc       # relative errors, every config
    python3 bench/gemm_ws.py speed     # TFLOP/s: 8192^3 dgrad and the 124M / 1.5B backward shapes (T = 16384)
    python3 bench/gemm_ws.py speed --quick
    python3 bench/gemm_ws.py speed --short  # every shape, shorter timing (warmup 5 ms, rep 25 ms)
    python3 bench/gemm_ws.py speed --only 124m  # only the shapes whose label contains "124m"
    python3 bench/gemm_ws.py host      # small shapes: eager vs CUDA-graph (device) time, host time per call
    python3 bench/gemm_ws.py tails     # stream-K tail counts on the 124M wgrads (device time; ratio:
                                       # _scaled_mm time / ours)
    python3 bench/gemm_ws.py ncu       # one launch per kernel on the 124M qkv / fc2 wgrads, to run under ncu
    python3 bench/gemm_ws.py waves     # data-parallel time per K block against the tile count (one wave)
    python3 bench/gemm_ws.py trace     # per-CTA GPU timer stamps of stream-K launches (where the time goes)
    python3 bench/gemm_ws.py gaps      # GEMMs back to back against interleaved with another kernel (device time)
    python3 bench/gemm_ws.py warm [--workers 8]  # runs tests/trainer/test_gemm_ws.py's GPU cases per config in
                                                # parallel processes (fills the Triton cache; logs pass / fail)

Stream-K configs (tag suffix "sk") are timed like the others, without split variants; warm also runs their
stream-K tests (small grids, determinism). Speed: per shape the candidates (_scaled_mm, fp8_gemm, every config /
split) are timed in turn, 3 rounds interleaved, and each one's median over the rounds is reported (each timing
itself do_bench's median); ratios are _scaled_mm time / ours (> 1: faster). Wgrads with fewer output tiles than SMs
also run split-K 2 and 4 (not with --short), timed with the reduction (fp8_gemm's split-K reduce kernel).
Each timed output is checked against _scaled_mm (rel). Run on an sm90 GPU.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import triton  # noqa: E402

from fp8mon.trainer.kernels import fp8_gemm_ws as W  # noqa: E402
from fp8mon.trainer.kernels.fp8_gemm import _splitk_reduce_kernel, _stats_args, fp8_gemm  # noqa: E402
from fp8mon.trainer.kernels.timing import device_medians, interleaved_medians  # noqa: E402
from bench.gemm import MODELS, host_us, profile_calls  # noqa: E402

if os.environ.get("FP8MON_WS_SKIP_SK") == "1":  # stream-K configs left out (e.g. after a failed smoke test)
    W.CONFIGS[:] = [c for c in W.CONFIGS if not W._sched(c)]

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda"


def log(*args):
    print(*args, flush=True)


def ops(M, N, K, da, db, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 4).to(da).to(DEV)
    b = (torch.randn(N, K, generator=g) * 4).to(db).to(DEV)
    return a, b


def case(M, N, K, od, seed):
    """Operands of one wgrad / dgrad benchmark: a (M, K) e5m2, b (N, K) e4m3, scales 0.5 / 2, an empty C of ``od``."""
    a, b = ops(M, N, K, E5, E4, seed)
    sa, sb = torch.tensor(0.5, device=DEV), torch.tensor(2.0, device=DEV)
    return a, b, sa, sb, torch.empty(M, N, dtype=od, device=DEV)


def sm_precise(a, b, sa, sb, od):
    """torch._scaled_mm with precise accumulation: the reference and the time to beat."""
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=od, use_fast_accum=False)


WGRADS_124M = [(768, 768, 16384), (2304, 768, 16384), (4096, 768, 16384), (768, 2048, 16384)]  # proj qkv fc1 fc2


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def tag(cfg):
    return (f"ws{cfg[0]}x{cfg[1]}s{cfg[3]}" + (cfg[4] if len(cfg) > 4 and cfg[4] != "ptr" else "")
            + ("p" if W._pipe(cfg) else "") + W._sched(cfg))


def reduce_ws(ws, c, sa, sb, split_k):
    MN = c.numel()
    _splitk_reduce_kernel[(triton.cdiv(MN, 1024),)](ws, c, sa, sb, sa, MN, c.shape[1], **_stats_args(None, None, 0, sa),
                                                    SPLIT_K=split_k, HAS_BIAS=False, SOFT_ROUND=False, BLOCK=1024,
                                                    num_warps=4)


def acc_mode(nsm):
    one = torch.tensor(1.0, device=DEV)
    for (M, N, K, seed, pos) in [(256, 256, 512, 1, False), (384, 512, 8192, 2, False), (256, 256, 16384, 3, True),
                                 (1024, 1024, 4096, 4, False), (1000, 520, 272, 5, False)]:
        a, b = ops(M, N, K, E5, E4, seed)
        if pos:
            a = a.float().abs().to(E5)
            b = b.float().abs().to(E4)
        exact = a.double() @ b.double().t()
        res = {}
        for cfg in W.CONFIGS:
            c = torch.empty(M, N, dtype=torch.float32, device=DEV)
            W.launch(a, b, c, None, one, one, None, 1, nsm, cfg)
            res[tag(cfg)] = rel(c, exact)
            if W._sched(cfg):  # stream-K: split_k == 1 only
                continue
            ws = torch.empty(4, M, N, dtype=torch.float32, device=DEV)
            W.launch(a, b, c, ws, one, one, None, 4, nsm, cfg)
            res[tag(cfg) + "/k4"] = rel(ws.sum(0), exact)
        if M % 16 == 0 and N % 16 == 0:
            for fast in (False, True):
                res["sm_fast" if fast else "sm_precise"] = rel(torch._scaled_mm(
                    a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast), exact)
        res["triton_precise"] = rel(fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=False), exact)
        log(f"acc {M}x{N}x{K} pos={pos}: " + ", ".join(f"{k} {v:.2e}" for k, v in res.items()))


REPS = {"full": (25, 100), "quick": (10, 40), "short": (5, 25)}
ROUNDS = 3  # speed: every candidate of a shape timed once per round, rounds interleaved; median reported


def reps(quick):
    """(warmup, rep) of do_bench for a timing mode."""
    return REPS[quick] if isinstance(quick, str) else REPS["quick" if quick else "full"]


def speed_mode(nsm, quick, only=None):
    shapes = [("8192^3 dgrad", 8192, 8192, 8192, torch.bfloat16)]
    T = 16384
    for mtag in ("1.5b", "124m"):  # bench/gemm.py's linears, T = 16384 tokens for both models
        for name, (fin, fout) in MODELS[mtag][1].items():
            shapes.append((f"{mtag}.{name} dgrad", T, fin, fout, torch.bfloat16))
            shapes.append((f"{mtag}.{name} wgrad", fout, fin, T, torch.float32))
    if quick is True:
        shapes = [s for s in shapes if s[0] in ("8192^3 dgrad", "1.5b.fc1 dgrad", "1.5b.proj wgrad", "124m.qkv wgrad")]
    if only:
        shapes = [s for s in shapes if only in s[0]]
    summary = []
    for label, M, N, K, od in shapes:
        a, b, sa, sb, c = case(M, N, K, od, 7)
        fl = 2 * M * N * K
        ref = sm_precise(a, b, sa, sb, torch.float32)
        err, fns = {}, {}
        fns["sm"] = lambda: sm_precise(a, b, sa, sb, od)
        fns["triton"] = lambda: fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=False)
        splits = [1]
        if triton.cdiv(M, 128) * triton.cdiv(N, 128) < nsm and K >= 8192 and quick != "short":
            splits += [2, 4]  # (not with --short: slower than split_k 1 in every earlier run)
        for cfg in W.CONFIGS:
            for sk in (splits if not W._sched(cfg) else [1]):  # stream-K: no split variants
                name = tag(cfg) + (f"/k{sk}" if sk > 1 else "")
                ws = torch.empty(sk, M, N, dtype=torch.float32, device=DEV) if sk > 1 else None

                def fn(cfg=cfg, sk=sk, ws=ws):
                    W.launch(a, b, c, ws, sa, sb, None, sk, nsm, cfg)
                    if sk > 1:
                        reduce_ws(ws, c, sa, sb, sk)
                try:
                    fn()
                    torch.cuda.synchronize()
                    err[name] = rel(c, ref)
                    fns[name] = fn
                except Exception as e:  # report and go on
                    log(f"  fail {name}: {type(e).__name__}: {str(e)[:300]}")
        t = interleaved_medians(fns, ROUNDS, *reps(quick))
        ws_names = [k for k in t if k.startswith("ws")]
        best = min(ws_names, key=t.get) if ws_names else None
        line = (f"speed {label:16s} M{M} N{N} K{K}: " + ", ".join(f"{k} {fl / v / 1e9:.0f}" for k, v in t.items())
                + f" TFLOP/s | triton/sm {t['sm'] / t['triton']:.3f}")
        if best:
            line += f" best {best} ws/sm {t['sm'] / t[best]:.3f} | max rel err vs sm {max(err.values()):.1e}"
            summary.append((label, t["sm"] / t[best], best))
        log(line)
    log("summary (ws best / _scaled_mm): " + ", ".join(f"{lab} {r:.2f} ({b})" for lab, r, b in summary))


def host_mode(nsm):
    """Per candidate on the small 124M shapes: do_bench (eager, L2 flushed), do_bench_cudagraph (device time, no
    host gaps, L2 not flushed) and the host time per call (200 calls enqueued back to back)."""
    shapes = [("124m.proj wgrad", 768, 768, 16384, torch.float32), ("124m.qkv wgrad", 2304, 768, 16384, torch.float32),
              ("124m.proj dgrad", 16384, 768, 768, torch.bfloat16),
              ("124m.qkv dgrad", 16384, 768, 2304, torch.bfloat16),
              ("1.5b.proj dgrad", 8192, 2048, 2048, torch.bfloat16)]
    for label, M, N, K, od in shapes:
        a, b, sa, sb, c = case(M, N, K, od, 7)
        fns = {"sm": lambda: sm_precise(a, b, sa, sb, od)}
        for cfg in W.CONFIGS:
            fns[tag(cfg)] = (lambda cfg=cfg: W.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg))
        fl = 2 * M * N * K
        parts = []
        for name, fn in fns.items():
            us = host_us(fn)
            eager = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
            graph = triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")
            parts.append(f"{name} eager {fl / eager / 1e9:.0f} graph {fl / graph / 1e9:.0f} TFLOP/s "
                         f"host {us:.0f} us")
        log(f"host {label} M{M} N{N} K{K}: " + "; ".join(parts))
        if "--profile" in sys.argv and label == "124m.proj dgrad":  # where a launch's host time goes
            log(profile_calls(fns[tag((128, 128, 128, 5, "tma"))], top=14))


def tails_mode(nsm, rounds=5):
    """Stream-K tail counts on the 124M wgrads: device time (``device_medians``: queued launches, medians of
    interleaved rounds) of the sk configs at 0 tails, at ``_sk_params``' own choice, at every count that divides
    the leftover tiles (each tail then takes whole tiles' K ranges) and at the largest counts that fit, beside the
    data-parallel 6-stage pipe config and ``torch._scaled_mm`` (precise) in the same rounds."""
    dp_cfg = (128, 128, 128, 6, "ptr", "pipe")
    for M, N, K in WGRADS_124M:
        a, b, sa, sb, c = case(M, N, K, torch.float32, 1)
        tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
        stream = tiles % nsm
        fns = {"sm": lambda: sm_precise(a, b, sa, sb, torch.float32)}
        fns[tag(dp_cfg)] = lambda: W.launch(a, b, c, None, sa, sb, None, 1, nsm, dp_cfg)
        aligned = {q for q in range(1, stream + 1) if stream % q == 0 and stream // q <= 6 and stream + q <= nsm}
        for cfg in [c_ for c_ in W.CONFIGS if W._sched(c_)]:
            for tl in sorted(aligned | {0, nsm - stream} - {nsm - stream - 1}) + [None]:
                if tl is not None and tl > nsm - stream:
                    continue
                fns[f"{tag(cfg)} tails {'auto' if tl is None else tl}"] = (
                    lambda cfg=cfg, tl=tl: W.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg, sk_tails=tl))
        t = device_medians(fns, rounds=rounds)
        parts = [f"{k} {v * 1e3:.1f} us ({t['sm'] / v:.3f})" for k, v in t.items()]
        log(f"tails {M}x{N}x{K} ({tiles} tiles, {stream} leftover): " + "; ".join(parts))


def ncu_mode(nsm):
    """One launch each of _scaled_mm (precise) and our data-parallel, stream-K and BN = 256 configs on the
    124M qkv and fc2 wgrads, for ncu (cuBLAS's kernel, cluster shape, L2 traffic and throughput against ours):
    ncu --clock-control none -k regex:"gemm|nvjet|xmma|cutlass" --section SpeedOfLight --section LaunchStats
        --section MemoryWorkloadAnalysis --metrics lts__t_bytes.sum python3 bench/gemm_ws.py ncu"""
    cfgs = [(128, 128, 128, 6, "ptr", "pipe"), (128, 128, 128, 6, "ptr", "pipe", "sk"), (128, 256, 128, 4)]
    for M, N, K in (WGRADS_124M[1], WGRADS_124M[3]):
        a, b, sa, sb, c = case(M, N, K, torch.float32, 1)
        log(f"ncu {M}x{N}x{K}: _scaled_mm, then {', '.join(map(tag, cfgs))}")
        sm_precise(a, b, sa, sb, torch.float32)
        for cfg in cfgs:
            W.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg)
        torch.cuda.synchronize()


def waves_mode(nsm, rounds=5):
    """Data-parallel device time per K block against the number of output tiles (one wave, K = 16384): whether a
    CTA's K blocks get slower as more SMs run at once (the cost that stream-K's extra CTAs would pay), beside
    ``torch._scaled_mm`` (precise) on the same shapes, in the same rounds."""
    dp_cfg = (128, 128, 128, 6, "ptr", "pipe")
    K = 16384
    for M, N in [(768, 768), (768, 1536), (768, 2048), (1024, 2048), (768, 2816)]:
        a, b, sa, sb, c = case(M, N, K, torch.float32, 1)
        tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
        t = device_medians({"sm": lambda: sm_precise(a, b, sa, sb, torch.float32),
                            "dp": lambda: W.launch(a, b, c, None, sa, sb, None, 1, nsm, dp_cfg)}, rounds=rounds)
        fl = 2 * M * N * K
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sm_precise(a, b, sa, sb, torch.float32)
            torch.cuda.synchronize()
        kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        log(f"waves {M}x{N}x{K}: _scaled_mm runs {kernels}")
        log(f"waves {M}x{N}x{K} ({tiles} tiles): dp {t['dp'] * 1e3:.1f} us = {t['dp'] * 1e3 / (K // 128):.3f} us "
            f"per K block, {fl / t['dp'] / 1e9:.0f} TFLOP/s; sm {t['sm'] * 1e3:.1f} us, {fl / t['sm'] / 1e9:.0f} "
            f"TFLOP/s; sm / dp {t['sm'] / t['dp']:.3f}")


def trace_mode(nsm):
    """Where a stream-K launch spends its time: one launch with GPU timer stamps per CTA (``launch(trace=True)``),
    after warm-up launches; per role (tail CTAs, head CTAs, data-parallel items) the median and max, in us from the
    first CTA's start, of each stamp of its first three work items (``W._TRACE_POINTS``)."""
    import numpy as np
    for M, N, tails in [(768, 768, 36), (768, 768, 0), (768, 2048, 32), (768, 2048, 0), (4096, 768, None)]:
        K = 16384
        a, b, sa, sb, c = case(M, N, K, torch.float32, 1)
        cfg = (128, 128, 128, 6, "ptr", "pipe", "sk")
        for _ in range(3):
            W.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg, sk_tails=tails)
        tr = W.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg, sk_tails=tails, trace=True)
        torch.cuda.synchronize()
        ref = sm_precise(a, b, sa, sb, torch.float32)
        grid, dp_tiles, x, n_tail, _, _ = W._sk_params(triton.cdiv(M, 128) * triton.cdiv(N, 128), K // 128, nsm,
                                                       tails)
        t = tr.cpu().numpy().astype(np.int64)
        t = (t - t[:, :1].min()) % (1 << 32)  # ns from the first start (the low 32 bits wrap every 4.3 s)
        t[tr.cpu().numpy() == 0] = -1  # never stamped
        log(f"trace {M}x{N}x{K} tails {tails} (grid {grid}, {dp_tiles} DP tiles, x {x}, {n_tail} tails): span "
            f"{t.max() / 1e3:.1f} us, rel err {rel(c, ref):.1e}")
        roles = {"tail": range(n_tail), "head": range(n_tail, grid)}
        for role, pids in roles.items():
            rows = t[list(pids)]
            if not len(rows):
                continue
            cells = [f"start {np.median(rows[:, 0]) / 1e3:.1f}/{rows[:, 0].max() / 1e3:.1f}"]
            for i in range(3):
                for j, name in enumerate(W._TRACE_POINTS[1:]):
                    col = rows[:, 1 + 5 * i + j]
                    col = col[col >= 0]
                    if len(col):
                        cells.append(f"i{i}.{name} {np.median(col) / 1e3:.1f}/{col.max() / 1e3:.1f}")
            log(f"  {role:4s} x{len(rows)} (median/max us): " + ", ".join(cells))


def gaps_mode(nsm, rounds=5):
    """Back-to-back against interleaved launches, device time (``device_medians``) of the 124M wgrads: each GEMM
    (``torch._scaled_mm`` precise, our ``fp8_gemm``) queued alone, and queued with a small elementwise kernel after
    each call (as in a training step, where other kernels run between GEMMs), that kernel's own time subtracted.
    A gap between the two columns is time a GEMM gains from following a launch of itself."""
    for M, N, K in WGRADS_124M:
        a, b, sa, sb, _ = case(M, N, K, torch.float32, 1)
        small = torch.zeros(1 << 16, device=DEV)

        def sm():
            sm_precise(a, b, sa, sb, torch.float32)

        def ours():
            fp8_gemm(a, b, sa, sb, out_dtype=torch.float32, fast_accum=False)

        def other():
            small.add_(1.0)
        t = device_medians({"sm": sm, "ours": ours, "other": other, "sm+other": lambda: (sm(), other()),
                            "ours+other": lambda: (ours(), other())}, rounds=rounds)
        us = {k: v * 1e3 for k, v in t.items()}
        sm_i, ours_i = us["sm+other"] - us["other"], us["ours+other"] - us["other"]
        log(f"gaps {M}x{N}x{K}: back to back sm {us['sm']:.1f} us, ours {us['ours']:.1f} us, ratio "
            f"{us['sm'] / us['ours']:.3f}; interleaved (other kernel {us['other']:.1f} us subtracted) sm "
            f"{sm_i:.1f} us, ours {ours_i:.1f} us, ratio {sm_i / ours_i:.3f}")


def _warm_job(j):
    """Worker: every GPU test of tests/trainer/test_gemm_ws.py for config j (compiles land in the Triton cache)."""
    import importlib.util
    import time
    import traceback
    spec = importlib.util.spec_from_file_location("_t_gemm_ws", str(Path(__file__).resolve().parent.parent / "tests"
                                                                     / "trainer" / "test_gemm_ws.py"))
    T = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(T)
    cfg = T.W.CONFIGS[j]
    out = []
    sk_cases = [("sk",) + c for c in T.SK_CASES] if T.W._sched(cfg) else []
    for case in T.CASES + ["promote"] + sk_cases:
        t0 = time.time()
        try:
            if case == "promote":
                T.test_ws_promotes_every_128(cfg)
            elif case[0] == "sk":  # stream-K: exactness + determinism, small grids
                T.test_sk_exact_and_deterministic(case[1:], cfg)
            else:
                T.test_ws_vs_fp64(case, cfg)
            res = "ok"
        except Exception as e:  # noqa: BLE001 - reported
            res = f"FAIL {type(e).__name__}: {str(e)[:300]}" + ("" if isinstance(e, AssertionError)
                                                                else " " + traceback.format_exc()[-600:])
        name = (case if case == "promote" else f"sk{case[1:4]}g{case[4]}t{case[7]}" if case[0] == "sk"
                else case[:3] + case[-1:])
        out.append(f"warm {tag(cfg)} {name}: {res} ({time.time() - t0:.1f} s)")
    return out


def warm_mode(workers):
    import concurrent.futures as cf
    import multiprocessing as mp
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for lines in ex.map(_warm_job, range(len(W.CONFIGS))):
            for line in lines:
                log(line)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "speed"
    quick = "short" if "--short" in sys.argv else "--quick" in sys.argv
    if not (torch.cuda.is_available() and W.AVAILABLE):
        log("needs a CUDA GPU and Triton's Gluon; nothing run")
        return
    props = torch.cuda.get_device_properties(0)
    log(f"device {props.name}, torch {torch.__version__}, triton {triton.__version__}, configs {W.CONFIGS}")
    nsm = props.multi_processor_count
    by_sms = {"acc": acc_mode, "tails": tails_mode, "ncu": ncu_mode, "gaps": gaps_mode,
              "trace": trace_mode, "waves": waves_mode, "host": host_mode}
    if mode in by_sms:
        by_sms[mode](nsm)
    elif mode == "warm":
        workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else len(W.CONFIGS)
        warm_mode(workers)
    else:
        speed_mode(nsm, quick, sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None)


if __name__ == "__main__":
    main()
