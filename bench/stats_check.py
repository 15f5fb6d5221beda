"""GPU self-check of the Triton statistics, without pytest: prints PASS/FAIL per check, exit status 1 on
any failure.

    python bench/stats_check.py            # standalone kernel, fused quantize, Fp8Linear + Agent
    python bench/stats_check.py --only standalone

Checks: (1) ``triton_stats.rows`` against ``device_stats.partials`` (the torch path) on adversarial tensors
(NaN, +-Inf, zeros, subnormals, huge values, large mean, all-equal, empty, one element, bf16/fp16/fp32,
non-contiguous), with a scale, with current scaling, with delayed scaling and with an outlier center;
(2) one multi-tensor launch against per-tensor launches, merged into existing rows; (3) no host sync;
(4) the quantize kernels' fused statistics against the standalone kernel; (5) Fp8Linear + Agent: the rows
the layer reports from its quantize kernels and GEMM epilogues against the rows of the hooks' path; (6) the
FP8 GEMM epilogue statistics (``fp8_gemm(stats=)``, ptr and TMA, split-K, edges, bias) against
``device_stats.partials`` of the returned output; the sync check covers them too; (7) the hooks' rows on the Triton
path (merged at the step's end) against the torch path, bf16 autocast and fp32, a frozen first linear.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import torch_path as ds  # noqa: E402
from fp8mon.agent.stats import launch as ts  # noqa: E402

FAILS = []
SYNC_MODELS = True  # --no-sync-models: the sync check skips the agent step on a small model
NO_CENTER = (0.0, float("nan"))  # no outlier counted: the Triton path before a center is known


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def row_problems(a: torch.Tensor, b: torch.Tensor, *, rtol=1e-6, under_slack=None, m2_floor=0.0) -> str:
    """'' when the statistics rows ``a`` and ``b`` agree, else what differs: counts, amax, scale, histogram
    exactly (underflow within ``under_slack`` if given); mean, M3 and M4 to ``rtol`` of the data's scale; M2 to
    ``rtol`` of (M2 + ``m2_floor`` · n · scale²). Also the CPU tests' comparison (tests/agent/test_triton_stats.py)."""
    a, b = a.double().cpu(), b.double().cpu()
    exact = [ds.PARTS, ds.NUMEL, ds.N, ds.NONFINITE, ds.ZEROS, ds.NONZERO, ds.OUTLIERS, ds.OVERFLOW, ds.AMAX,
             ds.SCALE, ds.AMAX_HISTORY_MAX] + list(range(ds.HIST, ds.WIDTH))
    if under_slack is None:
        exact.append(ds.UNDERFLOW)
    bad = []
    for i in exact:
        x, y = a[..., i], b[..., i]
        same = (x == y) | (x.isnan() & y.isnan())
        if not bool(same.all()):
            where = (~same).flatten().nonzero().flatten()[:4].tolist()  # the differing rows, not the first ones
            diff = ", ".join(f"[{j}] {x.flatten()[j].item()!r} vs {y.flatten()[j].item()!r}" for j in where)
            bad.append(f"{ds.FIELDS[i] if i < ds.HIST else 'hist'}: {diff}")
    if under_slack is not None:
        d = (a[..., ds.UNDERFLOW] - b[..., ds.UNDERFLOW]).abs()
        if bool((d > under_slack).any()):
            bad.append(f"underflow {a[..., ds.UNDERFLOW].tolist()} vs {b[..., ds.UNDERFLOW].tolist()} (slack {under_slack})")
    n = b[..., ds.N].clamp(min=1)
    sd = (b[..., ds.M2] / n).sqrt()
    scale = b[..., ds.MEAN].abs() + sd
    tol = {ds.MEAN: rtol * scale, ds.M2: rtol * (b[..., ds.M2].abs() + m2_floor * n * scale**2) + 1e-300,
           ds.M3: rtol * n * sd**3 + 1e-300, ds.M4: rtol * b[..., ds.M4].abs() + 1e-300}
    for i, t in tol.items():
        x, y = a[..., i], b[..., i]
        ok = ((x - y).abs() <= t) | (x.isnan() & y.isnan())
        if not bool(ok.all()):
            bad.append(f"{ds.FIELDS[i]}: {x.flatten()[:3].tolist()} vs {y.flatten()[:3].tolist()}")
    return "; ".join(bad)


def rows_close(a: torch.Tensor, b: torch.Tensor, *, rtol=1e-6, under_slack=None) -> tuple[bool, str]:
    """``row_problems`` as (ok, detail), M2 with a floor of 1e-9 · n · scale² (large-mean tensors on the GPU)."""
    problems = row_problems(a, b, rtol=rtol, under_slack=under_slack, m2_floor=1e-9)
    return not problems, problems


def adversarial(device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    big = r(300_001)
    big[::9973] = float("nan")
    big[5::7919] = float("inf")
    big[7::7919] = -float("inf")
    cases = {
        "gaussian fp32 1M": r(1 << 20),
        "gaussian bf16 3M+5": r(3 * (1 << 20) + 5).to(torch.bfloat16),
        "fp16 odd": (r(100_003) * 10).half(),
        "nan/inf": big,
        "zeros": torch.zeros(70_000),
        "one element": torch.tensor([3.5]),
        "empty": torch.zeros(0),
        "all equal 0.1": torch.full((200_000,), 0.1),
        "large mean": r(500_000) * 1e-3 + 1e4,
        "subnormal range": r(100_000) * 1e-39,
        "huge": r(100_000) * 1e30,
        "heavy tail": r(400_000) ** 5,
        "first tile zeros then 1000": torch.cat([torch.zeros(8192), r(200_000) + 1000.0]),
        "non-contiguous": r(512, 768).t(),
        "tiny gradients": r(300_000) * 1e-12,
        # bf16 with the histogram takes the word loop and the shared-memory table: every binade, zeros and
        # subnormals in one tensor, and a non-finite one (the careful path's histogram)
        "bf16 every binade": (r(700_001) * torch.exp2(torch.randint(-140, 60, (700_001,), generator=g).float()))
        .to(torch.bfloat16),
        "bf16 nan/inf": big.to(torch.bfloat16),
    }
    return {k: v.to(device) for k, v in cases.items()}


def check_standalone(device) -> None:
    check_bf16_pairs(device)
    check_far_first_partial(device)
    check_deferred_into_one_row(device)
    cases = adversarial(device)
    for name, x in cases.items():
        for hist in (True, False):
            kw = dict(fmt="e4m3", scale=torch.tensor(3.0, device=device))
            got = ts.partials(x, **kw, hist=hist)
            want = ds.partials(x, **kw, hist=hist, outlier_center=NO_CENTER)
            ok, why = rows_close(got, want)
            report(f"standalone {name} hist={hist} scale", ok, why)
        got = ts.partials(x, fmt="e5m2", amax_history_max=torch.tensor(2.5, device=device))
        want = ds.partials(x, fmt="e5m2", amax_history_max=torch.tensor(2.5, device=device), outlier_center=NO_CENTER)
        report(f"standalone {name} delayed e5m2", *rows_close(got, want))
        got = ts.partials(x, fmt="e4m3")
        want = ds.partials(x, fmt="e4m3", outlier_center=NO_CENTER)
        binade = got[ds.HIST:].max().item() if x.numel() else 0  # documented bound: one binade's count
        report(f"standalone {name} current e4m3", *rows_close(got, want, under_slack=binade))
        x32 = x.float()
        fin = x32[torch.isfinite(x32)].double()
        c = (fin.mean().item(), fin.std(unbiased=False).item()) if fin.numel() else (0.0, float("nan"))
        got = ts.partials(x, center=torch.tensor(c, dtype=torch.float64, device=device))
        want = ds.partials(x, outlier_center=c)
        report(f"standalone {name} outliers around its own mean", *rows_close(got, want))
        want_self = ds.partials(x)  # the center as the two-pass path computes it
        n = want_self[ds.N].clamp(min=1)
        own = torch.stack([want_self[ds.MEAN], (want_self[ds.M2] / n).sqrt()])
        got = ts.partials(x, center=own)
        same = got[ds.OUTLIERS].item() == want_self[ds.OUTLIERS].item() or not fin.numel()
        report(f"standalone {name} outliers = two-pass outliers", bool(same),
               f"{got[ds.OUTLIERS].item()} vs {want_self[ds.OUTLIERS].item()}")


def bf16_pairs(n: int, device) -> tuple[torch.Tensor, list]:
    """For the bf16 words path (two elements per word, bf16x2 instructions; with the histogram too, on hardware): a
    tensor of ``n`` elements with zeros of both signs, underflows, values on and just past bf16 outlier bounds, and
    the (center, k, keyword arguments) to try on it: a zero-width center, a scale under which some overflow (counted
    lazily on the careful path), delayed scaling, no format."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    x[::17] = 0.0
    x[5::29] = -0.0
    x[7::31] = 1e-6
    x[11::37] = 1.0
    x[13::41] = -1.0
    x[15::43] = 1.0078125  # the next bf16 above 1
    x[19::47] = -1.0078125
    kws = (dict(fmt="e4m3", scale=torch.tensor(3.0, device=device)), dict(fmt="e5m2", scale=1e4),
           dict(fmt="e4m3", amax_history_max=0.75), dict())
    centers = (((0.0, 0.5), 2.0), ((0.1, 0.37), 2.0), ((0.0, 0.0), 6.0), ((0.25, 0.125), 6.0))
    return x.to(device), [(c, k, kw) for c, k in centers for kw in kws]


def check_far_first_partial(device) -> None:
    """The merge shifts the partials to partial 0's mean; an fp32 tensor (mean 1e4, std 1) whose first chunk is all
    NaN leaves it empty, far from the grand mean: the merge must take the moments about the grand mean again."""
    n = 3 << 20
    x = torch.randn(n, device=device, dtype=torch.float64) + 1e4
    x[: ts._chunk_elems([n], torch.device(device), ts.MAXNREG_FP32)] = float("nan")  # the launch's first chunk
    x = x.float()
    report("standalone far first partial (first chunk all NaN)",
           *rows_close(ts.partials(x, hist=False), ds.partials(x, hist=False, outlier_center=NO_CENTER)))


def check_bf16_pairs(device) -> None:
    x, cases = bf16_pairs(300_001, device)
    for center, k, kw in cases:
        for hist in (False, True):
            got = ts.partials(x, center=center, outlier_k=k, hist=hist, **kw)
            want = ds.partials(x, outlier_center=center, outlier_k=k, hist=hist, **kw)
            report(f"standalone bf16 pairs center {center} k {k} {sorted(kw)} hist={hist}", *rows_close(got, want))


def check_deferred_into_one_row(device) -> None:
    """Two tensors deferred into one row, the second merged into the first (two micro-batches' rows of one site, in
    one flush): a large one, whose last program finishes late, then a small one. In one launch the small one's merge
    could read the row before the large one wrote it."""
    g = torch.Generator(device="cpu").manual_seed(9)
    a = (torch.randn(48 << 20 if device.type == "cuda" else 100_000, generator=g) * 2).to(torch.bfloat16).to(device)
    b = (torch.randn(3000, generator=g) * 5 + 1).to(torch.bfloat16).to(device)
    for later in (False, True):
        rows = torch.zeros(1, ds.WIDTH, dtype=torch.float64, device=device)
        ts.defer(a, ts.Target(rows, 0, False, (0.0, 2.0), 6.0, True, None, "e4m3"))
        ts.defer(b, ts.Target(rows, 0, True, (0.0, 2.0), 6.0, True, None, "e4m3"))
        if later:  # as a current-scaled cast's launch takes them, its rows merged by the next merge_later
            ts._launch_items(ts._take_deferred(device), device, later=True)
        ts.flush_deferred()
        want = ds.merge(ds.partials(a, fmt="e4m3", outlier_center=(0.0, 2.0))[None],
                        ds.partials(b, fmt="e4m3", outlier_center=(0.0, 2.0))[None])
        binade = want[0, ds.HIST:].nan_to_num(0).max().item()  # current scaling's underflow: the histogram's bound
        report(f"deferred into one row, the second merged{' later' if later else ''}",
               *rows_close(rows[0], want[0], under_slack=binade))


def check_multi(device) -> None:
    g = torch.Generator(device="cpu").manual_seed(2)
    xs = []
    for i in range(60):
        n = int(torch.randint(1, 300_000, (1,), generator=g))
        dt = (torch.bfloat16, torch.float32, torch.float16)[i % 3]
        xs.append((torch.randn(n, generator=g) * (i + 1) + i).to(dt).to(device))
    xs[7][3] = float("nan")
    fmts = [("e4m3", "e5m2", None)[i % 3] for i in range(len(xs))]
    scales = [None if f is None else torch.tensor(1.0 + i, device=device) for i, f in enumerate(fmts)]
    got = ts.rows(xs, fmt=fmts, scale=scales)
    want = torch.stack([ts.partials(x, fmt=f, scale=s) for x, f, s in zip(xs, fmts, scales)])
    # chunks are sized to the launch's total (whole waves of programs), so a tensor's programs, and the rounding
    # of their fp32 sums, differ between the two: the fp32 tolerance of the other checks, not equality
    report("multi-tensor launch = per-tensor launches", *rows_close(got, want))
    want_t = torch.stack([ds.partials(x, fmt=f, scale=s, outlier_center=NO_CENTER) for x, f, s in zip(xs, fmts, scales)])
    report("multi-tensor launch = torch path", *rows_close(got, want_t))
    # merged into existing rows, at scattered indices: = device_stats.merge
    base = torch.stack([ds.partials(x[: x.numel() // 2 + 1], fmt=f, scale=s, outlier_center=NO_CENTER) for x, f, s in zip(xs, fmts, scales)])
    out = torch.zeros(2 * len(xs), ds.WIDTH, dtype=torch.float64, device=device)
    idx = list(range(1, 2 * len(xs), 2))
    out[idx] = base
    ts.rows(xs, fmt=fmts, scale=scales, out=out, index=idx, merge=True)
    report("multi-tensor merge into rows = device_stats.merge", *rows_close(out[idx], ds.merge(base, want_t)))


def sync_free(name: str, fn) -> None:
    """Run ``fn`` under torch's sync debug mode; FAIL with the Python stack of every host sync it does."""
    import traceback
    import warnings

    torch.cuda.synchronize()
    stacks = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "ynchroniz" in str(message) and "prototype feature" not in str(message):
            stacks.append(f"{str(message).splitlines()[0]} at {filename}:{lineno}\n"
                          + "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    report(f"no host sync: {name}", not stacks, f"{len(stacks)} syncs; first:\n{stacks[0]}" if stacks else "")


def check_no_sync(device) -> None:
    if device.type != "cuda":
        return
    from fp8mon.trainer.kernels import quantize, quantize_transpose

    xs = [torch.randn(1000 + 70_000 * i, device=device).to((torch.bfloat16, torch.float32)[i % 2]) for i in range(5)]
    scale = torch.tensor(2.0, device=device)
    center = torch.zeros(2, dtype=torch.float64, device=device)
    out = torch.zeros(8, ds.WIDTH, dtype=torch.float64, device=device)

    ahm = torch.tensor(3.0, device=device)

    def standalone():
        for i in range(30):
            ts.rows(xs, fmt="e4m3", scale=scale, center=center)
            ts.rows(xs, fmt=["e4m3", None, "e5m2", "e4m3", None], out=out, index=[0, 2, 4, 6, 7], merge=i > 0)
            ts.partials(xs[1], fmt="e5m2", amax_history_max=ahm, center=(0.0, 1.0))

    standalone()  # warm: compiles, grows the staging ring
    sync_free("triton_stats.rows (multi-tensor, device scale/center, merge, delayed)", standalone)

    x = torch.randn(4096, 768, device=device, dtype=torch.bfloat16)
    rowsbuf = torch.zeros(4, ds.WIDTH, dtype=torch.float64, device=device)

    def fused():
        for i in range(10):
            quantize_transpose(x, "e4m3", stats=ts.Target(rowsbuf, 0, i > 0, center))
            quantize_transpose(x, "e5m2", scale=scale, accum=torch.zeros((), device=device),
                               stats=ts.Target(rowsbuf, 1, False, (0.1, 2.0)))
            quantize(x, "e4m3", stats=ts.Target(rowsbuf, 2, False, None))
        ts.flush_deferred()  # (the current-scaled casts' rows, merged later)

    fused()
    sync_free("fused quantize / quantize_transpose statistics", fused)

    from fp8mon.trainer.kernels import fp8_gemm

    qa, qb = x.to(torch.float8_e4m3fn), x[:512].to(torch.float8_e5m2)
    qt = qa.t().contiguous()  # a wgrad-like (768, 768, K=4096) product, split in 4

    def gemm():
        for impl in ("ptr", "tma"):
            fp8_gemm(qa, qb, scale, scale, stats=ts.Target(rowsbuf, 3, False, center, fmt="e5m2"), impl=impl)
            fp8_gemm(qt, qt, scale, scale, torch.float32, stats=ts.Target(rowsbuf, 3, True, (0.1, 2.0)),
                     impl=impl, split_k=4)

    gemm()
    sync_free("fp8_gemm epilogue statistics (ptr, tma, split-K)", gemm)
    if not SYNC_MODELS:
        return

    # a full agent reporting step of a small real model (trainer/model.py, tiny) in fp8 and bf16: hooks,
    # fused rows, the step buffer, centers, the device-to-host copy and the collector job
    from fp8mon.agent import Agent
    from fp8mon.trainer.config import get_config
    from fp8mon.trainer.model import Transformer, autocast

    cfg = get_config("tiny", vocab_size=512)
    for precision in ("fp8", "bf16"):
        torch.manual_seed(0)
        model = Transformer(cfg, "llama", precision, None).to(device)
        idx = torch.randint(0, 512, (4, cfg.seq_len), device=device)
        agent = Agent(transport=NullTransport(), every=1, modules=r"^blocks\.").watch(model)
        step = [0]

        def train(n):
            for _ in range(n):
                with autocast(precision, device):
                    loss = model(idx, idx)
                loss.backward()
                model.zero_grad(set_to_none=True)
                agent.log(step[0], loss=loss.detach())
                step[0] += 1

        train(3)
        sync_free(f"agent reporting step, trainer tiny llama {precision} (every=1, all five sites)", lambda: train(3))
        agent.close()
        report(f"agent {precision} no errors", agent.errors == 0, str(agent.last_error))


def check_fused(device) -> None:
    import importlib

    from fp8mon.trainer.kernels import quantize, quantize_transpose

    QT = importlib.import_module("fp8mon.trainer.kernels.quantize_transpose")

    g = torch.Generator(device="cpu").manual_seed(3)
    shapes = [(256, 384), (1000, 777), (4096, 768), (1, 5)]
    for (m, n) in shapes:
        for dt, fmt in ((torch.bfloat16, "e4m3"), (torch.float32, "e5m2")):
            if True:
                x = (torch.randn(m, n, generator=g) * 3).to(dt).to(device)
                if m > 10:
                    x[3, 4] = float("nan")
                    x[5, 1] = 0.0
                for delayed in (False, True):
                    scale = torch.tensor(7.0, device=device) if delayed else None
                    center = torch.tensor([0.1, 2.0], dtype=torch.float64, device=device)
                    ref_q = quantize_transpose(x, fmt, scale=scale, accum=torch.zeros((), device=device) if delayed else None)
                    # current scaling: the row from the standalone kernel in place of the amax pass, or from the cast
                    # (its row merged by a later launch, or by the launch's last program: ts.CAST_MERGE)
                    for mode in ("row",) if delayed else ("row", "row-last", "cast"):
                        QT.CURRENT_STATS, ts.CAST_MERGE = mode.split("-")[0], "last" if mode == "row-last" else "later"
                        for hist in (True, False):  # without the histogram bf16 inputs take the word loop
                            tgt = ts.Target(ts.Target.new(device).rows, 0, False, center, 6.0, hist, None)
                            acc = torch.zeros((), device=device) if delayed else None
                            r = quantize_transpose(x, fmt, scale=scale, accum=acc, stats=tgt)
                            ts.flush_deferred()
                            want = ts.partials(x, fmt=fmt, scale=r.scale, center=center, hist=hist)
                            ok, why = rows_close(tgt.rows[0], want)
                            same_q = torch.equal(r.data.view(torch.uint8), ref_q.data.view(torch.uint8)) and \
                                torch.equal(r.data_t.view(torch.uint8), ref_q.data_t.view(torch.uint8)) and \
                                torch.equal(r.meta[int(delayed):], ref_q.meta[int(delayed):])
                            report(f"fused quantize_transpose {m}x{n} {dt} {fmt} delayed={delayed} hist={hist}"
                                   + ("" if delayed else f" current_stats={mode}"),
                                   ok and same_q, why + ("" if same_q else " fp8 data or meta differs"))
                    QT.CURRENT_STATS, ts.CAST_MERGE = "row", "later"
                    tgt1 = ts.Target(ts.Target.new(device).rows, 0, False, center, 6.0, True, None)
                    quantize(x, fmt, scale=scale, accum=torch.zeros((), device=device) if delayed else None,
                             stats=tgt1)
                    ok, why = rows_close(tgt1.rows[0], ts.partials(x, fmt=fmt, scale=r.scale, center=center))
                    report(f"fused quantize {m}x{n} {dt} {fmt} delayed={delayed}", ok, why)


class NullTransport:
    def set_run_meta(self, **kw):
        pass

    def send_tensors(self, block):
        pass

    def send_scalars(self, block):
        pass

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        return True


def agent_rows(model, make_input, steps: int, device, watch=None, micro_batches: int = 2,
               **agent_kw) -> list[torch.Tensor]:
    """The packed rows the agent ships at each step (training ``micro_batches`` per step); ``watch``: the module
    watched, when ``make_input`` runs the model itself (``model`` is then applied to its output)."""
    from fp8mon.agent import Agent

    agent = Agent(transport=NullTransport(), every=1, **{"hist_every": 1, **agent_kw}).watch(watch or model)
    shipped = []
    agent._ship = lambda step, rows, values: shipped.append(None if rows is None else rows.clone())
    for step in range(steps):  # step 0 has no outlier center yet; the later ones use the previous step's
        (watch or model).zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            y = model(make_input(step, micro))
            y.float().square().mean().backward()
        agent.log(step)
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0, agent.last_error
    return shipped, keys


def check_fp8_linear_agent(device) -> None:
    from fp8mon.trainer.fp8_linear import Fp8Linear, Fp8Recipe

    for recipe in (Fp8Recipe(),):  # (the hooks cannot see a delayed scale as it was before the call)
        torch.manual_seed(4)
        model = torch.nn.Sequential(Fp8Linear(256, 512, recipe=recipe), torch.nn.GELU(),
                                    Fp8Linear(512, 256, recipe=recipe)).to(device)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator(device="cpu").manual_seed(5)
        xs = [torch.randn(8, 64, 256, generator=g).to(device) * (1 + i) for i in range(8)]
        make = lambda step, micro: xs[2 * step + micro]  # noqa: E731
        got, keys = agent_rows(model, make, 3, device, fused=True)
        model.load_state_dict(state)  # the same training again, every site through the hooks
        want, keys2 = agent_rows(model, make, 3, device, fused=False)
        assert keys == keys2 or sorted(keys) == sorted(keys2)
        order = [keys2.index(k) for k in keys]
        for step in range(3):
            a, b = got[step], want[step][order]
            fused_sites = torch.tensor([k[1] in Fp8Linear.fp8mon_reported_sites for k in keys])
            # the hooks emulate current scaling (fp64 max/amax, underflow from the histogram); the kernel's
            # current scale is reciprocal(amax) * max in fp32: an ulp apart at most, underflow within a binade
            slack = b[:, ds.HIST:].max().item()
            a2, b2 = a.clone(), b.clone()
            if recipe.scaling == "current":
                rel = ((a[:, ds.SCALE] - b[:, ds.SCALE]).abs() / b[:, ds.SCALE].abs()).nan_to_num(0)
                report(f"Fp8Linear+Agent {recipe.scaling} scales within an ulp, step {step}", bool((rel < 2.5e-7).all()),
                       str(rel.max().item()))
                a2[:, ds.SCALE] = b2[:, ds.SCALE]
            ok, why = rows_close(a2, b2, rtol=1e-6, under_slack=slack if recipe.scaling == "current" else None)
            report(f"Fp8Linear+Agent {recipe.scaling} fused rows = hook rows, step {step} "
                   f"({int(fused_sites.sum())} fused of {len(keys)})", ok, why + ("" if ok else f"; rows {keys}"))


def check_agent_backends(device) -> None:
    """The hooks' rows on the Triton path (merged later, at the step's end) against the torch path, for a bf16
    autocast step and an fp32 one, with the first linear frozen in one run: its grad_output waits for a
    grad_weight that never comes and must still be merged into its own step (``_launch_pending``)."""
    for autocast, frozen in ((True, False), (True, True), (False, True)):
        torch.manual_seed(6)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).to(device)
        if frozen:
            for p in model[0].parameters():
                p.requires_grad_(False)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator(device="cpu").manual_seed(7)
        xs = [(torch.randn(8, 256, 1024, generator=g) * (1 + i)).to(device).requires_grad_(frozen)
              for i in range(6)]

        def make(step, micro):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                return model(xs[2 * step + micro])

        rows = {}
        for backend in ("triton", "torch"):
            model.load_state_dict(state)
            rows[backend] = agent_rows(torch.nn.Identity(), make, 3, device, stats_backend=backend, watch=model)
        (tri, keys), (tor, keys2) = rows["triton"], rows["torch"]
        order = [keys2.index(k) for k in keys]
        for step in range(3):
            a, b = tri[step].clone(), tor[step][order].clone()
            a[:, ds.OUTLIERS] = b[:, ds.OUTLIERS] = 0  # the Triton path counts them against the last step's center
            present = int((b[:, ds.NUMEL] > 0).sum())
            ok, why = rows_close(a, b, under_slack=b[:, ds.HIST:].max().item())
            report(f"agent triton rows = torch rows, autocast={autocast} frozen={frozen} step {step} "
                   f"({present} rows)", ok and present == (9 if frozen else 10), why)


def check_gemm(device) -> None:
    from fp8mon.trainer.kernels import fp8_gemm

    g = torch.Generator(device="cpu").manual_seed(6)
    center = (0.05, 3.0)
    for M, N, K, od, bias, split in ((1000, 777, 512, torch.bfloat16, True, None), (4096, 4096, 1024, torch.bfloat16,
                                     False, None), (768, 768, 16384, torch.float32, False, None),
                                     (300, 200, 8192, torch.float32, True, 3), (1, 5, 16, torch.float32, False, None)):
        a = torch.randn(M, K, generator=g).to(device).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, generator=g) * 2).to(device).to(torch.float8_e5m2)
        sa, sb = torch.tensor(0.5, device=device), torch.tensor(0.01, device=device)
        bv = torch.randn(N, generator=g).to(device) if bias else None
        for impl in ("ptr", "tma"):
            for fmt in (None, "e5m2"):
                tgt = ts.Target.new(device, center=center, fmt=fmt)
                c = fp8_gemm(a, b, sa, sb, od, bv, impl=impl, split_k=split, stats=tgt)
                plain = fp8_gemm(a, b, sa, sb, od, bv, impl=impl, split_k=split)
                want = ds.partials(c, fmt=fmt, outlier_center=center)
                slack = want[ds.HIST:].max().item() if fmt else None
                ok, why = rows_close(tgt.rows[0], want, under_slack=slack)
                same = torch.equal(c.view(torch.uint8), plain.view(torch.uint8))
                report(f"gemm epilogue stats {impl} {M}x{N}x{K} {od} bias={bias} split={split} fmt={fmt}",
                       ok and same, why + ("" if same else " C differs with stats on"))


def check_rmsnorm(device) -> None:
    """trainer/kernels/rmsnorm.py on the GPU: y, dx and dw against torch's ops (``rms_norm_torch``), and the row of y
    against the fp64 oracle's of y as returned, at the 124M and 1.5B pre-norms' shapes (768 in chunks:
    ``rmsnorm.CHUNKS``), in bf16 (at 768 with and without the histogram), and with a NaN."""
    from fp8mon.trainer.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator(device="cpu").manual_seed(10)
    for shape, dt, nan, hist in (((16, 1024, 768), torch.float32, False, True),
                                 ((16, 1024, 768), torch.float32, False, False),
                                 ((4, 2048, 2048), torch.float32, False, True),
                                 ((4, 1000, 1600), torch.bfloat16, False, True),
                                 ((16, 1024, 768), torch.bfloat16, False, False),
                                 ((16, 1024, 768), torch.bfloat16, False, True),
                                 ((3, 77, 768), torch.bfloat16, True, False),
                                 ((3, 77, 768), torch.float32, True, True)):
        x0 = (torch.randn(*shape, generator=g) * 3 + 0.5).to(dt)
        if nan:
            x0[1, 5, 7] = float("nan")
        x0, w0 = x0.to(device), (torch.randn(shape[-1], generator=g) + 1.0).to(device)
        gy = torch.randn(*shape, generator=g).to(dt).to(device)
        (x1, w1), (x2, w2) = [(x0.clone().requires_grad_(), w0.clone().requires_grad_()) for _ in range(2)]
        tgt = ts.Target.new(device, center=(0.5, 3.0), fmt="e4m3", hist=hist)
        y1, y2 = rms_norm(x1, w1, 1e-6, stats=tgt), rms_norm_ref(x2, w2, 1e-6)
        y1.backward(gy)
        y2.backward(gy)
        ts.flush_deferred()
        tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        bad = [f"{w} max difference {float((a.float() - b.float()).abs().max())}"
               for w, a, b in (("y", y1.detach(), y2.detach()), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad))
               if not torch.allclose(a.float(), b.float(), equal_nan=True, **tol)]
        want = ds.partials(y1.detach(), fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist)
        ok, why = rows_close(tgt.rows[0], want, under_slack=want[ds.HIST:].nan_to_num(0).max().item())
        report(f"rmsnorm {shape} {dt} nan={nan} hist={hist}", ok and not bad, why + "; ".join(bad))


def check_consumers(device) -> None:
    """The consumer kernels on the GPU. trainer/kernels/swiglu.py: forward and backward against torch's autograd of
    F.silu(gate) * up (bf16: at most one unit in the last place, on under 1% of the elements; fp32 close), the
    forward's rows of y and h (bf16: the words path and the fp32 one) and the backward's of dy (bf16: both paths too)
    against the fp64 oracle's. trainer/kernels/residual.py: x + b and its gradients equal torch's, its rows of b and of
    b's gradient the oracle's. trainer/kernels/rope.py: ``check_rope``."""
    import importlib

    from fp8mon.trainer.kernels.residual import residual_add
    from fp8mon.trainer.kernels.swiglu import swiglu, swiglu_ref
    from fp8mon.trainer.kernels.words import words_path

    sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")  # the module (trainer.kernels.swiglu is the function)

    g = torch.Generator(device="cpu").manual_seed(9)
    for xd in (torch.float32, torch.bfloat16):
        x0 = torch.randn(4, 1000, 2048, generator=g).to(xd).to(device)
        b0 = (torch.randn(4, 1000, 2048, generator=g) * 4).to(torch.bfloat16).to(device)
        x1, b1 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
        tgt = ts.Target.new(device, center=(0.0, 4.0), fmt="e4m3")
        tgt_g = ts.Target.new(device, center=(0.0, 1.0), fmt="e5m2")
        out = residual_add(x1, b1, stats=tgt, grad_stats=lambda: tgt_g)
        dout = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
        out.backward(dout)
        ts.flush_deferred()  # (the consumer kernels' rows are merged later: triton_stats.FUSED_MERGE)
        same = torch.equal(out.detach(), x0 + b0) and torch.equal(x1.grad, dout.to(xd)) and \
            torch.equal(b1.grad, dout.to(torch.bfloat16))
        want = ds.partials(b0, fmt="e4m3", outlier_center=(0.0, 4.0))
        ok, why = rows_close(tgt.rows[0], want, under_slack=want[ds.HIST:].max().item())
        want_g = ds.partials(b1.grad, fmt="e5m2", outlier_center=(0.0, 1.0))
        ok_g, why_g = rows_close(tgt_g.rows[0], want_g, under_slack=want_g[ds.HIST:].max().item())
        report(f"residual add {xd} + bf16", ok and ok_g and same,
               why + why_g + ("" if same else " sum or gradients differ"))

    g = torch.Generator(device="cpu").manual_seed(8)
    for shape, dt in (((4, 1000, 2 * 1536), torch.bfloat16), ((777, 2 * 300), torch.float32)):
        y0 = (torch.randn(*shape, generator=g) * 3).to(dt).to(device)
        dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dt).to(device)
        y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
        h1, h2 = swiglu(y1), swiglu_ref(y2)
        h1.backward(dh)
        h2.backward(dh)
        for what, a, b in (("h", h1.detach(), h2.detach()), ("dy", y1.grad, y2.grad)):
            if dt == torch.bfloat16:
                ulp = (a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -7 + 1e-30
                off = float((a != b).float().mean())
                ok, why = bool(ulp.all()) and off < 0.01, f"{off:.3%} of elements differ"
            else:
                ok = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                why = f"max difference {float((a - b).abs().max())}"
            report(f"swiglu {what} {shape} {dt}", ok, "" if ok else why)
        for fmt, hist in (("e4m3", True), (None, False)):
            # current scaling's underflow comes from the histogram: exact up to the threshold's binade
            slack = (lambda row: row[ds.HIST:].nan_to_num(0).max().item() if fmt else None)
            want = ds.partials(y0, fmt=fmt, outlier_center=(0.0, 3.0), hist=hist)
            # bf16 y: the words path (the default on a GPU; the interpreter's 4 programs put ~12000 elements into each
            # lane's fp32 sums, M4 1.1e-6 off here, bench/RESULTS.md) and the fp32 one; h the same to the bit
            paths = (True, False) if dt == torch.bfloat16 and device.type == "cuda" else (False,)
            hs = []
            # on the words path h's row in the kernel (WORDS_H, the default; with the histogram deferred) and deferred
            for words, words_h in ((True, False), (True, True), (False, False)) if paths[0] else ((False, False),):
                tgt = ts.Target.new(device, center=(0.0, 3.0), hist=hist, fmt=fmt)
                tgt_h = ts.Target.new(device, center=(0.0, 1.0), hist=hist, fmt=fmt)
                with words_path(sw, on=words), words_path(sw, on=words_h, switch="WORDS_H"):
                    h = swiglu(y0, stats=tgt, h_stats=tgt_h)
                ts.flush_deferred()  # a deferred row of h waits for the next statistics launch
                hs.append(h)
                # against the fp64 oracle: on heavy-tailed h the standalone kernel's fp32 sums were 1.4e-6 off in M4
                want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
                ok, why = rows_close(tgt.rows[0], want, under_slack=slack(want))
                ok_h, why_h = rows_close(tgt_h.rows[0], want_h, under_slack=slack(want_h))
                same = torch.equal(h, hs[0])
                report(f"swiglu rows of y and h {shape} {dt} fmt={fmt} hist={hist}{' words' if words else ''}"
                       f"{' + h' if words_h else ''}",
                       ok and ok_h and same, why + why_h + ("" if same else " h differs between the paths"))
            # dy's row (fc1's grad_output, a plain fc1's) from the backward; bf16 also through dy's words (the default)
            for words in paths:
                tgt_dy = ts.Target.new(device, center=(0.0, 1.0), hist=hist, fmt="e5m2" if fmt else None)
                y3 = y0.clone().requires_grad_()
                with words_path(sw, on=words, switch="BWD_WORDS"):
                    swiglu(y3, dy_stats=lambda: tgt_dy).backward(dh)
                ts.flush_deferred()
                want_dy = ds.partials(y3.grad, fmt=tgt_dy.fmt, outlier_center=(0.0, 1.0), hist=hist)
                ok, why = rows_close(tgt_dy.rows[0], want_dy, under_slack=slack(want_dy))
                same = torch.equal(y3.grad, y1.grad)
                report(f"swiglu row of dy {shape} {dt} fmt={tgt_dy.fmt} hist={hist}{' words' if words else ''}",
                       ok and same, why + ("" if same else " dy differs with the row"))
    check_rope(device)
    check_heads(device)
    check_rmsnorm(device)
    check_weight_cast(device)


def check_weight_cast(device) -> None:
    """trainer/kernels/residual.py's ``weight_cast``: w.to(bf16) and the gradient cast back equal torch's, the row of w's
    own fp32 values against the fp64 oracle's; the same of ``weight_casts``, several weights in one launch; and a bf16
    llama under autocast whose linears take their weights' rows
    and (one micro-batch a step) their gradients' rows from those casts (``trainer.layers.FUSED_WEIGHT``) ships the
    rows the hooks ship without them, with one micro-batch a step and with two."""
    from fp8mon.trainer import layers, model as tm
    from fp8mon.trainer.config import get_config
    from fp8mon.trainer.kernels.residual import weight_cast
    from fp8mon.trainer.kernels.weight_casts import casts_with_rows

    g = torch.Generator(device="cpu").manual_seed(11)
    for shape in ((3072, 768), (2048, 2048), (77, 33)):
        w0 = (torch.randn(*shape, generator=g) * 0.02 + 0.001).to(device)
        w = w0.clone().requires_grad_()
        tgt = ts.Target.new(device, center=(0.0, 0.02), hist=True, fmt="e4m3")
        wb = weight_cast(w, torch.bfloat16, tgt)
        gy = torch.randn(*shape, generator=g).to(device, torch.bfloat16)
        wb.backward(gy)
        ts.flush_deferred()
        want = ds.partials(w0, fmt="e4m3", outlier_center=(0.0, 0.02), hist=True)
        ok, why = rows_close(tgt.rows[0], want, under_slack=want[ds.HIST:].nan_to_num(0).max().item())
        same = torch.equal(wb.detach(), w0.to(torch.bfloat16)) and torch.equal(w.grad, gy.float())
        report(f"weight cast {shape}", ok and same, why + ("" if same else " values differ from torch's"))
    shapes = ((3072, 768), (768, 768), (2048, 2048), (77, 33))
    ws = [(torch.randn(*shape, generator=g) * 0.02 + 0.001).to(device) for shape in shapes]
    ws[2][5, 7] = float("nan")  # that weight's programs take the careful path
    rows = torch.zeros(len(ws), ds.WIDTH, dtype=torch.float64, device=device)
    casts = casts_with_rows(ws, torch.bfloat16, [ts.Target(rows, i, False, (0.0, 0.02), 6.0, True, None, "e4m3")
                                                 for i in range(len(ws))])
    ts.flush_deferred()
    for i, (w, wb) in enumerate(zip(ws, casts)):
        want = ds.partials(w, fmt="e4m3", outlier_center=(0.0, 0.02), hist=True)
        ok, why = rows_close(rows[i], want, under_slack=want[ds.HIST:].nan_to_num(0).max().item())
        same = torch.equal(wb.float().nan_to_num(9), w.to(torch.bfloat16).float().nan_to_num(9))
        report(f"weight casts in one launch, {tuple(w.shape)}", ok and same,
               why + ("" if same else " values differ from torch's"))
    cfg = get_config("tiny", n_layer=2, d_model=256, n_head=4, d_ff=512, seq_len=128, vocab_size=512)
    idx = [torch.randint(0, 512, (4, 128), generator=g).to(device) for _ in range(4)]
    for micro_batches in (1, 2):
        got = {}
        for fused in (False, True):
            old, layers.FUSED_WEIGHT = layers.FUSED_WEIGHT, fused
            try:
                torch.manual_seed(12)
                net = tm.Transformer(cfg, "llama", "bf16").to(device)

                def make(step, micro):
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        return net(idx[2 * step + micro])

                got[fused] = agent_rows(torch.nn.Identity(), make, 2, device, stats_backend="triton", watch=net,
                                        modules=r"^blocks\.", micro_batches=micro_batches)
            finally:
                layers.FUSED_WEIGHT = old
        (hooks, keys), (cast, keys2) = got[False], got[True]
        weights = [k for k in keys2 if k[1] in ("weight", "grad_weight")]
        for step in range(2):
            a = cast[step][[keys2.index(k) for k in weights]]
            b = hooks[step][[keys.index(k) for k in weights]]
            ok, why = rows_close(a, b, under_slack=b[:, ds.HIST:].max().item())
            same = sorted(keys) == sorted(keys2)
            report(f"weight and gradient rows of a bf16 llama from its casts, {micro_batches} micro-batch(es), step "
                   f"{step} ({len(weights)} rows)", ok and same, why + ("" if same else " slots differ"))


def check_rope(device) -> None:
    """trainer/kernels/rope.py: q, k, v and qkv's gradient equal torch's (``rope_qkv_ref`` and its autograd), the
    forward's row of qkv and the backward's of its gradient against the fp64 oracle's, also with a NaN (the careful
    path), the first merged into on a second call."""
    from fp8mon.trainer.kernels.rope import rope_qkv, rope_qkv_ref
    from fp8mon.trainer.layers import Rotary

    g = torch.Generator(device="cpu").manual_seed(10)
    for (b, t, nh, hd), dt, nan in (((2, 1000, 16, 128), torch.bfloat16, False), ((3, 77, 4, 64), torch.float32, False),
                                    ((2, 256, 6, 128), torch.bfloat16, True)):
        rot = Rotary(hd, 2048).to(device)
        qkv0 = (torch.randn(b, t, 3 * nh * hd, generator=g) * 2 + 0.25).to(dt).to(device)
        if nan:
            qkv0[1, 7, 5] = float("nan")
        grads = [torch.randn(b, nh, t, hd, generator=g).to(dt).to(device) for _ in range(3)]
        a, r = qkv0.clone().requires_grad_(), qkv0.clone().requires_grad_()
        tgt = ts.Target.new(device, center=(0.25, 2.0), hist=True, fmt="e4m3")
        tgt_g = ts.Target.new(device, center=(0.0, 1.0), hist=True, fmt="e5m2")
        got = rope_qkv(a, rot.cos, rot.sin, nh, stats=tgt, grad_stats=lambda: tgt_g)
        ref = rope_qkv_ref(r, rot.cos, rot.sin, nh)
        torch.autograd.backward(got, grads)
        torch.autograd.backward(ref, grads)
        ts.flush_deferred()
        problems = []
        for what, x, y in (("q", got[0], ref[0]), ("k", got[1], ref[1]), ("v", got[2], ref[2]), ("dqkv", a.grad, r.grad)):
            x, y = x.detach().float().nan_to_num(7.0), y.detach().float().nan_to_num(7.0)
            if x.shape != y.shape:
                problems.append(f"{what} shape {tuple(x.shape)} vs {tuple(y.shape)}")
            elif not torch.equal(x, y):
                problems.append(f"{what}: {float((x != y).float().mean()):.4%} of elements differ, at most by "
                                f"{float((x - y).abs().max())}")
        want = ds.partials(qkv0, fmt="e4m3", outlier_center=(0.25, 2.0), hist=True)
        ok, why = rows_close(tgt.rows[0], want, under_slack=want[ds.HIST:].nan_to_num(0).max().item())
        tgt.merge = True
        rope_qkv(qkv0 * 2, rot.cos, rot.sin, nh, stats=tgt)
        ts.flush_deferred()
        both = ds.merge(want, ds.partials(qkv0 * 2, fmt="e4m3", outlier_center=(0.25, 2.0), hist=True))
        ok2, why2 = rows_close(tgt.rows[0], both, under_slack=both[ds.HIST:].nan_to_num(0).max().item())
        want_g = ds.partials(a.grad, fmt="e5m2", outlier_center=(0.0, 1.0), hist=True)
        ok3, why3 = rows_close(tgt_g.rows[0], want_g, under_slack=want_g[ds.HIST:].nan_to_num(0).max().item())
        report(f"rope {(b, t, nh, hd)} {dt} nan={nan}", ok and ok2 and ok3 and not problems,
               why + why2 + why3 + "; ".join(problems))


def check_heads(device) -> None:
    """trainer/kernels/heads.py: the heads merged for the projection equal torch's copy (and the gradient torch's), from
    the attention's own output and from a contiguous layout, and the row of the result the fp64 oracle's, with and
    without the histogram, also with a NaN (the careful path)."""
    import torch.nn.functional as F

    from fp8mon.trainer.kernels.heads import merge_heads, merge_heads_ref

    g = torch.Generator(device="cpu").manual_seed(13)
    for (b, nh, t, hd), dt, sdpa, nan in (((16, 12, 1024, 64), torch.bfloat16, True, False),
                                          ((4, 16, 512, 128), torch.bfloat16, True, True),
                                          ((3, 5, 77, 32), torch.float32, False, False)):
        q, k, v = (torch.randn(b, nh, t, hd, generator=g).to(dt).to(device) for _ in range(3))
        y0 = F.scaled_dot_product_attention(q, k, v, is_causal=True) if sdpa else q * 2 + 0.25
        if nan:
            y0[1, 2, 7, 5] = float("nan")
        for fmt, hist in (("e4m3", True), (None, False)):  # (current scaling's underflow is the histogram's)
            a, r = y0.clone().requires_grad_(), y0.clone().requires_grad_()
            tgt = ts.Target.new(device, center=(0.0, 1.0), hist=hist, fmt=fmt)
            got, ref = merge_heads(a, stats=tgt), merge_heads_ref(r)
            grad = torch.randn(b, t, nh * hd, generator=g).to(dt).to(device)
            got.backward(grad)
            ref.backward(grad)
            ts.flush_deferred()
            same = torch.equal(got.detach().nan_to_num(7.0), ref.detach().nan_to_num(7.0)) and \
                torch.equal(a.grad, r.grad)
            want = ds.partials(ref.detach(), fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
            ok, why = rows_close(tgt.rows[0], want, under_slack=want[ds.HIST:].nan_to_num(0).max().item() if fmt
                                 else None)
            report(f"heads {(b, nh, t, hd)} {dt} strides {tuple(y0.stride())} nan={nan} hist={hist}", ok and same,
                   why + ("" if same else " values or gradient differ from torch's"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=["sync", "standalone", "multi", "fused", "agent", "gemm", "consumers"],
                   default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-sync-models", action="store_true", help="sync check: skip the agent step on a small model")
    args = p.parse_args()
    global SYNC_MODELS
    SYNC_MODELS = not args.no_sync_models
    device = torch.device(args.device)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for name, fn in (("sync", check_no_sync), ("standalone", check_standalone), ("multi", check_multi),
                     ("fused", check_fused), ("agent", check_fp8_linear_agent), ("agent", check_agent_backends),
                     ("gemm", check_gemm),
                     ("consumers", check_consumers)):
        if args.only in (None, name):
            try:
                fn(device)
            except Exception as exc:  # a crash is a failure, the other checks still run
                import traceback
                traceback.print_exc()
                report(f"{fn.__name__} raised", False, repr(exc))
    print(f"{'ALL PASS' if not FAILS else f'{len(FAILS)} FAILED'}")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
