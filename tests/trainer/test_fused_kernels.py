"""The fused kernels around the linears, on the CPU in Triton's interpreter (the ``interpreted`` fixture): SwiGLU's
elementwise kernels (trainer/kernels/swiglu.py, with its bf16 words path), the residual add and the weight casts
(trainer/kernels/residual.py, weight_casts.py), RoPE on the qkv output (rope.py), the heads' merge (heads.py) and
RMSNorm (rmsnorm.py). Each equals torch's computation forward and backward (SwiGLU's bf16 to the last place, rarely one
unit off; RMSNorm to a few units: another order of the sum of squares), and the rows it takes equal the fp64 oracle's
(``stats.torch_path.partials``)."""

from __future__ import annotations

import pytest
import torch
from trainer_rows import hist_slack, row_problems

pytestmark = pytest.mark.usefixtures("interpreted")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most units in the last place between two bf16 tensors of finite values."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude to a monotone integer order
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().nan_to_num(7.0), b.detach().nan_to_num(7.0))


def _check(*problems: str) -> None:
    bad = [p for p in problems if p]
    assert not bad, "; ".join(bad)


# ---- SwiGLU ------------------------------------------------------------------------------------------------------

# (2, 20, 300): h of 40 x 150, tiles partial in both dimensions, several a program (6 tiles of 16 x 128 with a row)
SWIGLU_VALUES = [((2, 20, 2 * 150), torch.bfloat16), ((40, 2 * 200), torch.float32), ((1, 2), torch.bfloat16)]


def _swiglu_input(shape, dtype, seed=0, shifted=False, nan=False):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*shape, generator=g) * 3
    if shifted:  # the halves differ in mean (gate about 0, up about 5)
        y[..., shape[-1] // 2:] += 5.0
    if nan:  # the careful path
        y.view(-1)[7 * shape[-1] + 3] = float("nan")
    return y.to(dtype), torch.randn(*shape[:-1], shape[-1] // 2, generator=g)


@pytest.mark.parametrize("shape,dtype", SWIGLU_VALUES)
def test_swiglu_equals_torch_forward_and_backward(shape, dtype):
    from fp8mon.trainer.kernels.swiglu import swiglu, swiglu_ref

    y0, dh = _swiglu_input(shape, dtype)
    y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
    h1, h2 = swiglu(y1), swiglu_ref(y2)
    h1.backward(dh.to(dtype))
    h2.backward(dh.to(dtype))
    for a, b in ((h1.detach(), h2.detach()), (y1.grad, y2.grad)):
        assert a.shape == b.shape and a.dtype == b.dtype
        if dtype == torch.bfloat16:
            assert _ulps_apart(a, b) <= 1 and float((a != b).float().mean()) <= 0.01
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


STATS_VALUES = SWIGLU_VALUES + [("shifted", torch.bfloat16), ("nan", torch.float32)]


def _stats_input(case, dtype):
    if case == "shifted":
        return _swiglu_input((50, 2 * 90), dtype, seed=4, shifted=True)
    if case == "nan":
        return _swiglu_input((50, 2 * 90), dtype, seed=4, nan=True)
    return _swiglu_input(case, dtype)


@pytest.mark.parametrize("fmt,hist", [("e4m3", True), (None, False)])
@pytest.mark.parametrize("case,dtype", STATS_VALUES)
def test_swiglu_forward_rows_of_y_and_h_are_the_oracles_and_merge(case, dtype, fmt, hist):
    """The rows the forward takes of y and h equal the fp64 oracle's (a GEMM output's emulation: current scaling of
    the format, or none); h is the same with them; y's merges into a second call's. On bf16 y the words path runs."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.swiglu import swiglu

    y0, _ = _stats_input(case, dtype)
    center = (0.0, 3.0)
    tgt = ts.Target.new("cpu", center=center, hist=hist, fmt=fmt)
    tgt_h = ts.Target.new("cpu", center=(0.0, 1.0), hist=hist, fmt=fmt)
    tgt.rows.fill_(float("nan"))  # overwritten (merge False), whatever it held
    h = swiglu(y0, stats=tgt, h_stats=tgt_h)
    ts.flush_deferred()  # (h's row with the histogram on the words path waits for the next statistics launch)
    want = ds.partials(y0, fmt=fmt, outlier_center=center, hist=hist)
    want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
    slack = hist_slack if fmt else (lambda row: None)
    problems = [row_problems(tgt.rows[0], want, under_slack=slack(want)),
                row_problems(tgt_h.rows[0], want_h, under_slack=slack(want_h)),
                "" if _same(h, swiglu(y0)) else "h differs with statistics on"]
    tgt.merge = True
    swiglu(y0 * 2, stats=tgt)
    ts.flush_deferred()
    both = ds.merge(want, ds.partials(y0 * 2, fmt=fmt, outlier_center=center, hist=hist))
    _check(*problems, row_problems(tgt.rows[0], both, under_slack=slack(both)))


@pytest.mark.parametrize("fmt,hist", [("e5m2", True), (None, False)])
@pytest.mark.parametrize("case,dtype", STATS_VALUES)
def test_swiglu_backward_row_of_dy_is_the_oracles_asked_for_in_the_backward(case, dtype, fmt, hist):
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.swiglu import swiglu

    y0, dh = _stats_input(case, dtype)
    tgt = ts.Target.new("cpu", center=(0.0, 1.0), hist=hist, fmt=fmt)
    asked = []
    y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
    h1 = swiglu(y1, dy_stats=lambda: asked.append(1) or tgt)
    assert not asked, "the target was asked for in the forward"
    h1.backward(dh.to(dtype))
    swiglu(y2).backward(dh.to(dtype))
    ts.flush_deferred()
    want = ds.partials(y1.grad, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
    _check(row_problems(tgt.rows[0], want, under_slack=hist_slack(want) if fmt else None),
           "" if _same(y1.grad, y2.grad) else "dy differs with statistics on")


WORDS_CASES = [((48, 2 * 256), False), ((2, 20, 2 * 150), False), ((50, 2 * 90), True)]


def _launches(monkeypatch, module, kernel: str) -> list:
    """The grids ``module.<kernel>`` launches with, from now on."""
    launched, real = [], getattr(module, kernel)

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(module, kernel, Spy())
    return launched


@pytest.mark.parametrize("fmt", ["e4m3", None])
@pytest.mark.parametrize("shape,nan", WORDS_CASES)
def test_swiglu_words_path_takes_y_and_h_rows_without_deferring_h(monkeypatch, shape, nan, fmt):
    """bf16 y of even width, no histogram: the words kernel runs, h is the fp32 kernel's to the bit, and the rows of
    y and of h (from the words it stores, nothing deferred) equal the oracle's, on full tiles (bf16x2), partial ones
    and with a NaN (the careful path)."""
    import importlib

    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds

    sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")
    g = torch.Generator().manual_seed(12)
    y = (torch.randn(*shape, generator=g) * 3 + 1.0).to(torch.bfloat16)
    if nan:
        y[7, 3] = float("nan")
    tgt = ts.Target.new("cpu", center=(0.0, 3.0), hist=False, fmt=fmt)
    tgt_h = ts.Target.new("cpu", center=(0.0, 1.0), hist=False, fmt=fmt)
    deferred, real_defer = [], ts.defer
    monkeypatch.setattr(ts, "defer", lambda x, target: deferred.append(target) or real_defer(x, target))
    launched = _launches(monkeypatch, sw, "_swiglu_fwd_words_kernel")
    h = sw.swiglu(y, stats=tgt, h_stats=tgt_h)
    ts.flush_deferred()
    want = ds.partials(y, fmt=fmt, outlier_center=(0.0, 3.0), hist=False)
    want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=False)
    slack = hist_slack if fmt else (lambda row: None)
    assert launched, "the words kernel did not run"
    assert not any(t is tgt_h for t in deferred), "h's row was deferred"
    _check(row_problems(tgt.rows[0], want, under_slack=slack(want)),
           row_problems(tgt_h.rows[0], want_h, under_slack=slack(want_h)),
           "" if _same(h, sw.swiglu(y)) else "h differs from the fp32 kernel's")


@pytest.mark.parametrize("fmt", ["e5m2", None])
@pytest.mark.parametrize("shape,nan", WORDS_CASES)
def test_swiglu_backward_words_path_takes_dys_row(monkeypatch, shape, nan, fmt):
    import importlib

    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds

    sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")
    g = torch.Generator().manual_seed(14)
    y = (torch.randn(*shape, generator=g) * 3 + 1.0).to(torch.bfloat16)
    dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(torch.bfloat16)
    if nan:
        y[7, 3] = float("nan")
    plain = sw.swiglu_backward(y, dh)
    tgt = ts.Target.new("cpu", center=(0.0, 2.0), hist=False, fmt=fmt)
    launched = _launches(monkeypatch, sw, "_swiglu_bwd_words_kernel")
    dy = sw.swiglu_backward(y, dh, stats=tgt)
    ts.flush_deferred()
    want = ds.partials(dy, fmt=fmt, outlier_center=(0.0, 2.0), hist=False)
    assert launched, "the words kernel did not run"
    _check(row_problems(tgt.rows[0], want, under_slack=hist_slack(want) if fmt else None),
           "" if _same(dy, plain) else "dy differs from the fp32 kernel's")


# ---- the residual add and the weight casts ---------------------------------------------------------------------------

@pytest.mark.parametrize("xd,bd,nan", [(torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.bfloat16, False),
                                       (torch.float32, torch.bfloat16, True)])
def test_residual_add_equals_torch_and_takes_the_rows_of_the_branch_and_its_gradient(monkeypatch, xd, bd, nan):
    """Values (one rounding) and gradients (b's cast by the kernel that takes its row) are torch's x + b; the rows of b
    and of b's gradient equal the oracle's, merged by a later launch and (the NaN case) by the kernels' last program."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.residual import residual_add, residual_add_ref

    g = torch.Generator().manual_seed(9)
    x0 = torch.randn(2, 30, 70, generator=g).to(xd)  # 5 blocks of 1024 over 4 programs, the last partial
    b0 = (torch.randn(2, 30, 70, generator=g) * 4).to(bd)
    if nan:
        b0[1, 2, 3] = float("nan")
    dout = torch.randn(2, 30, 70, generator=g)
    x1, b1 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
    x2, b2 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
    tgt = ts.Target.new("cpu", center=(0.0, 4.0), fmt="e4m3")
    tgt_g = ts.Target.new("cpu", center=(0.0, 1.0), fmt="e5m2")
    o1 = residual_add(x1, b1, stats=tgt, grad_stats=lambda: tgt_g)
    o1.backward(dout.to(o1.dtype))
    o2 = residual_add_ref(x2, b2)
    o2.backward(dout.to(o2.dtype))
    ts.flush_deferred()
    assert o1.dtype == o2.dtype and _same(o1, o2)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(b1.grad, b2.grad)
    want = ds.partials(b0, fmt="e4m3", outlier_center=(0.0, 4.0))
    want_g = ds.partials(b2.grad, fmt="e5m2", outlier_center=(0.0, 1.0))
    _check(row_problems(tgt.rows[0], want, under_slack=hist_slack(want)),
           row_problems(tgt_g.rows[0], want_g, under_slack=hist_slack(want_g)))


@pytest.mark.parametrize("shape", [(48, 32), (3000,)])
def test_weight_cast_equals_torchs_casts_with_the_fp32_weights_row(shape):
    """``weight_cast`` is ``w.to(bf16)`` (its gradient ``g.float()``) with w's own row (the oracle's of the fp32
    values, not the cast's), also across a partial last block."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.residual import weight_cast

    g = torch.Generator().manual_seed(21)
    w0 = torch.randn(*shape, generator=g) * 0.02 + 0.003
    w = w0.clone().requires_grad_()
    tgt = ts.Target.new("cpu", center=(0.0, 0.02), fmt="e4m3")
    wb = weight_cast(w, torch.bfloat16, tgt)
    gy = torch.randn(*shape, generator=g).to(torch.bfloat16)
    wb.backward(gy)
    ts.flush_deferred()
    assert wb.dtype == torch.bfloat16 and torch.equal(wb.detach(), w0.to(torch.bfloat16))
    assert torch.equal(w.grad, gy.float())
    want = ds.partials(w0, fmt="e4m3", outlier_center=(0.0, 0.02))
    _check(row_problems(tgt.rows[0], want, under_slack=hist_slack(want)))


@pytest.mark.parametrize("to_bf16", [True, False], ids=["weights", "gradients"])
def test_casts_with_rows_casts_several_tensors_in_one_launch_each_with_its_row(to_bf16):
    """fp32 to bf16 (weights) and bf16 to fp32 (their gradients), of several sizes (one with a NaN: the careful path):
    torch's casts, and each row the oracle's about its own center (given, on the device, none)."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.weight_casts import casts_with_rows

    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(48, 32, generator=g) * 0.02 + 0.003, torch.randn(3000, generator=g),
          torch.randn(5, generator=g) * 7, torch.randn(2500, generator=g)]
    ws[3][1234] = float("nan")
    centers = [(0.0, 0.02), torch.tensor([0.0, 1.0], dtype=torch.float64), None, (0.1, 1.0)]
    xs, dtype = (ws, torch.bfloat16) if to_bf16 else ([w.to(torch.bfloat16) for w in ws], torch.float32)
    rows = torch.zeros(len(xs), ds.WIDTH, dtype=torch.float64)
    casts = casts_with_rows(xs, dtype, [ts.Target(rows, i, False, c, 6.0, True, None, "e4m3")
                                        for i, c in enumerate(centers)])
    ts.flush_deferred()
    problems = []
    for i, (x, c, xc) in enumerate(zip(xs, centers, casts)):
        if not (xc.dtype == dtype and torch.equal(xc.float().nan_to_num(9), x.to(dtype).float().nan_to_num(9))):
            problems.append(f"{i}: values differ from torch's cast")
        c = tuple(c.tolist()) if isinstance(c, torch.Tensor) else c
        want = ds.partials(x, fmt="e4m3", outlier_center=c)
        problems.append(row_problems(rows[i], want, under_slack=hist_slack(want)))
    _check(*problems)


# ---- RoPE and the heads --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dt,nan", [((2, 40, 1, 32), torch.bfloat16, False),
                                          ((1, 33, 2, 16), torch.float32, False),
                                          ((1, 40, 2, 32), torch.bfloat16, True)])
def test_rope_on_qkv_equals_torch_and_takes_qkvs_rows(shape, dt, nan):
    """q, k, v and qkv's gradient are torch's exactly (the interpreter contracts nothing into FMAs), with a partial
    tile of positions and heads of 16 and 32; the rows of qkv and of its gradient equal the oracle's, also with a NaN,
    the first merged into by two more calls before the rows are merged (the first merge goes first)."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.rope import rope_qkv, rope_qkv_ref
    from fp8mon.trainer.layers import Rotary

    b, t, nh, hd = shape
    g = torch.Generator().manual_seed(11)
    rot = Rotary(hd, 64)
    qkv0 = (torch.randn(b, t, 3 * nh * hd, generator=g) * 2 + 0.5).to(dt)
    if nan:
        qkv0[0, 3, 5] = float("nan")
    grads = [torch.randn(b, nh, t, hd, generator=g).to(dt) for _ in range(3)]
    a, r = qkv0.clone().requires_grad_(), qkv0.clone().requires_grad_()
    tgt = ts.Target.new("cpu", center=(0.5, 2.0), hist=True, fmt="e4m3")
    tgt_g = ts.Target.new("cpu", center=(0.0, 1.0), hist=True, fmt="e5m2")
    got = rope_qkv(a, rot.cos, rot.sin, nh, stats=tgt, grad_stats=lambda: tgt_g)
    ref = rope_qkv_ref(r, rot.cos, rot.sin, nh)
    torch.autograd.backward(got, grads)
    torch.autograd.backward(ref, grads)
    ts.flush_deferred()
    assert all(_same(x, y) for x, y in zip((*got, a.grad), (*ref, r.grad)))
    assert all(x.is_contiguous() for x in got)
    want = ds.partials(qkv0, fmt="e4m3", outlier_center=(0.5, 2.0), hist=True)
    want_g = ds.partials(a.grad, fmt="e5m2", outlier_center=(0.0, 1.0), hist=True)
    problems = [row_problems(tgt.rows[0], want, under_slack=hist_slack(want)),
                row_problems(tgt_g.rows[0], want_g, under_slack=hist_slack(want_g))]
    tgt.merge = True
    rope_qkv(qkv0 * 2, rot.cos, rot.sin, nh, stats=tgt)
    rope_qkv(qkv0 * 3, rot.cos, rot.sin, nh, stats=tgt)
    ts.flush_deferred()
    both = want
    for f in (2, 3):
        both = ds.merge(both, ds.partials(qkv0 * f, fmt="e4m3", outlier_center=(0.5, 2.0), hist=True))
    _check(*problems, row_problems(tgt.rows[0], both, under_slack=hist_slack(both)))


@pytest.mark.parametrize("shape,dt,bthd", [((2, 3, 50, 16), torch.bfloat16, True),
                                           ((1, 2, 33, 32), torch.float32, False),
                                           ((2, 2, 40, 8), torch.bfloat16, False)])
def test_merged_heads_equal_torchs_copy_and_its_gradient(shape, dt, bthd):
    """From the layout the attention returns (a transposed (B, T, NH, HD)) and from a contiguous one, with a partial
    tile of positions: the values and the gradient are torch's, the result contiguous."""
    from fp8mon.trainer.kernels.heads import merge_heads, merge_heads_ref

    b, nh, t, hd = shape
    g = torch.Generator().manual_seed(12)
    y0 = (torch.randn(b, t, nh, hd, generator=g) * 2 + 0.5).to(dt)
    y0 = y0.transpose(1, 2) if bthd else y0.transpose(1, 2).contiguous()
    a, r = y0.clone().requires_grad_(), y0.clone().requires_grad_()  # (clone keeps the strides)
    got, ref = merge_heads(a), merge_heads_ref(r)
    grad = torch.randn(b, t, nh * hd, generator=g).to(dt)
    got.backward(grad)
    ref.backward(grad)
    assert _same(got, ref) and _same(a.grad, r.grad) and got.is_contiguous()


# ---- RMSNorm -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dt,nan,learn,hist", [
    ((3, 50, 48), torch.float32, False, True, True), ((7, 64), torch.bfloat16, False, True, True),
    ((7, 64), torch.bfloat16, False, True, False), ((150, 40), torch.float32, True, False, True),
    ((5, 3, 96), torch.bfloat16, True, True, True), ((2, 40, 96), torch.bfloat16, False, True, False),
    ((2, 40, 96), torch.bfloat16, True, False, False), ((2, 40, 96), torch.bfloat16, False, False, True)])
def test_rmsnorm_equals_torch_and_takes_ys_row(shape, dt, nan, learn, hist):
    """y, x's and the weight's gradients are torch's to a few units in the last place, for fp32 and bf16 rows, widths
    that are and are not a power of two (48, 40 and 96 are cut into 3, 5 and 3 chunks), a partial last tile and a
    frozen weight; y's row equals the oracle's of y as returned, merged later, with a NaN by the careful path, and
    merged into by a second call."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(13)
    x0 = (torch.randn(*shape, generator=g) * 3 + 0.5).to(dt)
    if nan:
        x0.view(-1)[17] = float("nan")
    w0 = torch.randn(shape[-1], generator=g) + 1.0
    gy = torch.randn(*shape, generator=g).to(dt)
    (x1, w1), (x2, w2) = [(x0.clone().requires_grad_(), w0.clone().requires_grad_(learn)) for _ in range(2)]
    tgt = ts.Target.new("cpu", center=(0.5, 3.0), fmt="e4m3", hist=hist)
    y1, y2 = rms_norm(x1, w1, 1e-6, stats=tgt), rms_norm_ref(x2, w2, 1e-6)
    y1.backward(gy)
    y2.backward(gy)
    ts.flush_deferred()
    tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in ((y1.detach(), y2.detach()), (x1.grad, x2.grad), (w1.grad, w2.grad)):
        if a is None or b is None:
            assert a is None and b is None and not learn
        else:
            assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), equal_nan=True, **tol)
    want = ds.partials(y1.detach(), fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist)
    problems = [row_problems(tgt.rows[0], want, under_slack=hist_slack(want))]
    tgt.merge = True
    y3 = rms_norm(x0 * 2, w0, 1e-6, stats=tgt)
    ts.flush_deferred()
    both = ds.merge(want, ds.partials(y3, fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist))
    _check(*problems, row_problems(tgt.rows[0], both, under_slack=hist_slack(both)))


# ---- the other shapes the kernels' constants offer -----------------------------------------------------------------

@pytest.mark.parametrize("module,settings", [
    ("residual", {"STATS_BLOCK": 2048, "STATS_WARPS": 8, "STATS_PROGRAMS_PER_SM": 2}),
    ("rope", {"STATS_BT": 16, "STATS_PROGRAMS_PER_SM": 4}),
    ("rmsnorm", {"STATS_TILE": 4096, "STATS_WARPS": 8, "STATS_PROGRAMS_PER_SM": 2})])
def test_row_kernels_in_their_other_program_shape(monkeypatch, module, settings):
    """The residual, RoPE and RMSNorm kernels with a row in the other program shape their constants allow (8-warp
    programs; 16-position tiles), so that a change of those constants finds that shape checked."""
    import importlib

    mod = importlib.import_module(f"fp8mon.trainer.kernels.{module}")
    for name, value in settings.items():
        monkeypatch.setattr(mod, name, value)
    if module == "residual":
        test_residual_add_equals_torch_and_takes_the_rows_of_the_branch_and_its_gradient(
            pytest.MonkeyPatch(), torch.float32, torch.bfloat16, False)
    elif module == "rope":
        test_rope_on_qkv_equals_torch_and_takes_qkvs_rows((2, 40, 1, 32), torch.bfloat16, False)
    else:
        test_rmsnorm_equals_torch_and_takes_ys_row((2, 40, 96), torch.bfloat16, True, True, True)


def test_rms_norm_refuses_what_its_kernels_cannot_take_and_the_module_falls_back_to_torch():
    """rms_norm names what it needs (contiguous float rows of the weight's width); the RMSNorm module gives torch's
    result for such an x instead of calling it."""
    from fp8mon.trainer import torch_ops
    from fp8mon.trainer.kernels.rmsnorm import rms_norm
    from fp8mon.trainer.layers import RMSNorm

    for x, w in ((torch.randn(6, 4).t(), torch.ones(6)), (torch.randn(4, 6), torch.ones(5)),
                 (torch.zeros(0, 6), torch.ones(6))):
        with pytest.raises(ValueError, match="needs contiguous float rows"):
            rms_norm(x, w, 1e-6)
    norm = RMSNorm(6)
    x = torch.randn(6, 4).t()
    assert not norm.fused(x) and torch.equal(norm(x), torch_ops.rms_norm(x, norm.weight, norm.eps))


def test_casts_with_rows_names_the_tensors_it_cannot_take_and_launches_nothing():
    """A tensor that is not contiguous, 16-byte aligned, non-empty and of one floating dtype with the others, or targets
    that do not share one row buffer: a clear error before any launch (the batch of ``trainer.weight_rows`` leaves
    such weights to their own casts)."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer.kernels.weight_casts import castable, casts_with_rows, weight_casts

    target = ts.Target.new("cpu", fmt="e4m3")
    flat = torch.randn(1001)
    for x in (torch.randn(6, 4).t(), flat[1:], torch.zeros(0, 4), torch.randn(6, 4, dtype=torch.float64)):
        assert not castable(x)
        with pytest.raises(ValueError, match="needs contiguous, non-empty, 16-byte aligned tensors of one floating"):
            casts_with_rows([torch.randn(6, 4), x], torch.bfloat16, [target, target])
    with pytest.raises(ValueError, match="of one floating dtype"):
        casts_with_rows([torch.randn(6, 4), torch.randn(6, 4).bfloat16()], torch.bfloat16, [target, target])
    with pytest.raises(ValueError, match="must share rows"):
        casts_with_rows([torch.randn(6, 4)] * 2, torch.bfloat16, [target, ts.Target.new("cpu", fmt="e4m3")])
    with pytest.raises(ValueError, match="casts to fp32, bf16 or fp16"):
        casts_with_rows([torch.randn(6, 4)], torch.float64, [target])
    with pytest.raises(ValueError, match="casts fp32 weights"):
        weight_casts([torch.randn(6, 4).bfloat16()], torch.float16, [target], [None])
    assert not target.rows.any()
