"""The Triton FP8 kernels on the CPU, in Triton's interpreter, against their torch references.

``TRITON_INTERPRET=1`` only takes effect for kernels decorated after it is set: the ``interpreted`` fixture imports
fp8mon afresh with it (tests/trainer/trainer_interpreter.py).

What the interpreter cannot do, and how it is handled: Triton 3.9's interpreter gets fp32 -> fp8 casts
wrong (rounding carries into the exponent are dropped, fp8 subnormals truncated, ties rounded away,
NaN -> 0x7c in E4M3) and drops the carry in fp32 -> bf16 too. Under the interpreter the kernels
therefore encode FP8 (and round bf16) in integer arithmetic (``SOFT_ROUND``, see
trainer/kernels/quantize.py); so the quantizers are checked bit-exactly here, and the hardware cast
itself is checked bit-exactly on a GPU by the GPU tests. FP8 loads and ``tl.dot`` on FP8
operands (any e4m3/e5m2 mix) work in the interpreter as they are. ``max_num_imprecise_acc`` (fast vs
precise accumulation) has no effect there: the interpreter accumulates in fp32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("interpreted")


def _same(a, b) -> bool:
    import torch

    nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all())


def _inputs(shape, dtype, seed):
    """Values across the FP8 ranges (subnormal, normal, saturating after scaling), plus NaN/Inf/-0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])
    flat = x.view(-1)
    flat[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, -1e-30])
    return x.to(dtype)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_quantize_current():
    from fp8mon.agent.formats import E4M3, E5M2
    from fp8mon.trainer.kernels import quantize, quantize_ref

    fmts, dtypes = (E4M3, E5M2), (torch.float32, torch.bfloat16)
    for fmt in fmts:
        for dt in dtypes:
            x = _inputs((37, 300), dt, 1)
            r = quantize_ref(x, fmt)
            q = quantize(x, fmt, block=1024)
            assert _same(q.data, r.data), (fmt.name, dt)
            assert torch.equal(q.meta, r.meta), (q.meta, r.meta)

def test_quantize_transpose_current():
    from fp8mon.agent.formats import E4M3, E5M2
    from fp8mon.trainer.kernels import quantize_transpose, quantize_transpose_ref

    fmts, dtypes = (E4M3, E5M2), (torch.float32, torch.bfloat16)
    for fmt in fmts:
        for dt in dtypes:
            x = _inputs((70, 200), dt, 2)  # partial tiles in both dimensions
            r = quantize_transpose_ref(x, fmt)
            for mode in (None, 0, 2):  # None: the per-dtype default (TRANS_MODE)
                q = quantize_transpose(x, fmt, bm=32, bn=64, trans_mode=mode)
                assert q.data_t.is_contiguous() and q.data_t.shape == (200, 70)
                assert _same(q.data, r.data) and _same(q.data_t, r.data_t), (fmt.name, dt, mode)
                assert torch.equal(q.meta, r.meta)

def test_quantize_transpose_partial_outputs():
    from fp8mon.agent.formats import E5M2
    from fp8mon.trainer.kernels import quantize_transpose, quantize_transpose_ref

    x = _inputs((40, 96), torch.bfloat16, 3)
    r = quantize_transpose_ref(x, E5M2)
    only_t = quantize_transpose(x, E5M2, write_q=False, bm=32, bn=32)
    only_q = quantize_transpose(x, E5M2, write_qt=False, bm=32, bn=32)
    assert only_t.data is None and only_q.data_t is None
    assert _same(only_t.data_t, r.data_t) and _same(only_q.data, r.data)

def test_amax_ignores_nonfinite():
    from fp8mon.agent.formats import E4M3, current_scale
    from fp8mon.trainer.kernels import quantize, quantize_transpose

    x = torch.tensor([[1.0, -3.0, float("nan"), float("inf")], [2.0, -float("inf"), 0.5, -2.5]])
    q = quantize_transpose(x, E4M3, bm=32, bn=32)
    assert float(q.amax) == 3.0 and torch.equal(q.scale, current_scale(torch.tensor(3.0), E4M3))
    zero = quantize(torch.zeros(10), E4M3)
    assert float(zero.amax) == 0.0 and float(zero.scale) == 1.0  # amax 0 -> scale 1 (agent.formats)

def test_delayed_history_and_saturation():
    from fp8mon.agent.formats import E4M3, E5M2
    from fp8mon.trainer.kernels import delayed_update, delayed_update_ref, quantize_ref, quantize_transpose

    fmts = (E4M3, E5M2)
    H, margin = 3, 1
    for fmt in fmts:
        hist, scale, accum = torch.zeros(H), torch.ones(()), torch.zeros(())
        hist_r, scale_r = torch.zeros(H), torch.ones(())
        amaxes = []
        for step, mult in enumerate((1.0, 2.0, 0.5, 1000.0, 1.0)):
            x = torch.randn(50, 70, generator=torch.Generator().manual_seed(step)) * mult
            used = scale.clone()
            q = quantize_transpose(x, fmt, scale=scale, accum=accum, bm=32, bn=32)
            delayed_update(accum, hist, scale, q.meta, fmt, margin)
            r = quantize_ref(x, fmt, scale=scale_r)
            delayed_update_ref(r.amax, hist_r, scale_r, fmt, margin)
            amaxes.insert(0, float(x.abs().max()))
            assert _same(q.data, r.data) and _same(q.data_t, r.data.t()), (fmt.name, step)
            assert torch.equal(q.meta, r.meta) and float(q.scale) == float(used)
            assert torch.equal(hist, hist_r) and torch.equal(scale, scale_r) and float(accum) == 0.0
            assert hist.tolist() == pytest.approx((amaxes + [0.0] * H)[:H], rel=0, abs=0)  # rolled, newest first
            expect = fmt.max / max(amaxes[:H]) / 2**margin
            assert float(scale) == pytest.approx(expect, rel=1e-6)
            if mult == 1000.0:  # stale scale: saturates at +-max, never Inf/NaN
                v = q.data.float()
                assert bool(torch.isfinite(v).all()) and float(v.abs().max()) == fmt.max
                assert float((x * used).abs().max()) > fmt.max

def _gemm_cases(impl, split_k=None):
    from fp8mon.trainer.kernels import fp8_gemm, fp8_gemm_ref

    cfg = {"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 2}
    cases = [(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, True, False, (70, 48, 192)),
             (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, False, False, (33, 64, 160)),
             (torch.float8_e5m2, torch.float8_e4m3fn, torch.float32, False, True, (64, 40, 208)),
             (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, True, False, (20, 24, 72))]  # K%16 != 0
    worst = 0.0
    for i, (da, db, od, fast, with_bias, (M, N, K)) in enumerate(cases):
        g = torch.Generator().manual_seed(10 + i)
        a = (torch.randn(M, K, generator=g) * 8).to(da)
        b = (torch.randn(N, K, generator=g) * 8).to(db)
        sa, sb = torch.tensor(0.37), torch.tensor(1.9)
        bias = torch.randn(N, generator=g) if with_bias else None
        c = fp8_gemm(a, b, sa, sb, out_dtype=od, bias=bias, fast_accum=fast, impl=impl, config=cfg,
                     split_k=split_k)
        ref = fp8_gemm_ref(a, b, sa, sb, out_dtype=od, bias=bias)
        assert c.dtype == od and c.shape == (M, N)
        e = _rel(c, ref)
        # fp32: accumulation order only; bf16: at most a rounding flip here and there
        assert e < (1e-6 if od == torch.float32 else 4e-3), (impl, i, e)
        worst = max(worst, e)

def test_gemm_ptr():

    _gemm_cases("ptr")

def test_gemm_tma():

    _gemm_cases("tma")

def test_gemm_ws_fallback():

    # impl "ws" (fp8_gemm_ws, Gluon, sm90 only: no interpreter) falls back to the Triton kernels off sm90
    _gemm_cases("ws")

def test_gemm_split_k():

    _gemm_cases("ptr", split_k=3)
    _gemm_cases("tma", split_k=2)

def test_gemm_e5m2_e5m2():
    from fp8mon.trainer.kernels import fp8_gemm

    a = torch.randn(32, 64).to(torch.float8_e5m2)
    b = torch.randn(48, 64).to(torch.float8_e5m2)
    one = torch.tensor(1.0)
    c = fp8_gemm(a, b, one, one, out_dtype=torch.float32, impl="ptr", config={"BM": 32, "BN": 16, "BK": 32,
                                                                                "GROUP_M": 1})
    assert _rel(c, a.float() @ b.float().t()) < 1e-6

def test_fp8_linear_triton_vs_torch():

    from fp8mon.trainer.fp8_linear import Fp8Linear, Fp8Recipe

    out = []
    for recipe in (Fp8Recipe(), Fp8Recipe(scaling="delayed", amax_history_len=4, margin=1)):
        torch.manual_seed(0)
        tri = Fp8Linear(96, 80, bias=True, recipe=recipe)
        ref = Fp8Linear(96, 80, bias=True, recipe=recipe)
        ref.load_state_dict(tri.state_dict())
        tri.backend, ref.backend = "triton", "torch"
        for step in range(3):
            x = torch.randn(2, 19, 96) * (1 + step)
            xs = [x.clone().requires_grad_() for _ in range(2)]
            ys = [m(xi) for m, xi in zip((tri, ref), xs)]
            g = torch.randn_like(ys[0])
            for y in ys:
                y.backward(g)
            errs = [_rel(ys[0], ys[1]), _rel(xs[0].grad, xs[1].grad), _rel(tri.weight.grad, ref.weight.grad),
                    _rel(tri.bias.grad, ref.bias.grad)]
            assert max(errs) < 1e-5, (recipe.scaling, step, errs)
            for site in ("input", "weight", "grad_output"):
                assert torch.equal(tri.fp8_amax[site], ref.fp8_amax[site]), site
                assert torch.equal(tri.fp8_scale[site], ref.fp8_scale[site]), site
            for (k, v), (k2, v2) in zip(tri.state_dict().items(), ref.state_dict().items()):
                assert k == k2 and torch.equal(v, v2), k
            tri.zero_grad()
            ref.zero_grad()
        out.append(recipe.scaling)
