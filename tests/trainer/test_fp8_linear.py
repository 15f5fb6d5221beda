"""Fp8Linear: interface, FP8 numerics against fp32 nn.Linear, scaling recipes, what the forward saves,
the amax/scale exposed for the statistics, and (on a GPU) no host sync.

On the CPU the module runs its torch reference path (torch float8 casts + a dequantized fp32 GEMM); the Triton
path is compared with it in Triton's interpreter by tests/trainer/test_kernels.py.

Tolerance: relative Frobenius error ‖Δ‖/‖ref‖ against fp32 nn.Linear < 0.06 for the forward output
(two E4M3 operands: ~0.037 measured) and < 0.1 for dx and dW (an E5M2 operand: ~0.059 measured).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fp8mon.agent.formats import E4M3, E5M2, current_scale, delayed_scale
from fp8mon.agent.hooks import is_linear
from fp8mon.trainer.fp8_linear import Fp8Linear, Fp8Recipe, cache_fp8_weights
from fp8mon.trainer.kernels import fp8_gemm_ref

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def pair(recipe=None, bias=False, fin=96, fout=80, seed=0):
    torch.manual_seed(seed)
    m = Fp8Linear(fin, fout, bias=bias, recipe=recipe or Fp8Recipe())
    ref = nn.Linear(fin, fout, bias=bias)
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if k in ("weight", "bias")})
    return m, ref


def test_interface():
    r = Fp8Recipe()
    assert (r.scaling, r.amax_history_len, r.margin, r.fast_accum_fwd) == ("current", 1024, 0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 1
    with pytest.raises(ValueError):
        Fp8Recipe(scaling="dynamic")
    m = Fp8Linear(64, 32)
    assert Fp8Linear.fp8mon_linear is True and is_linear(m)
    assert isinstance(m.weight, nn.Parameter) and m.weight.dtype == torch.float32 and m.weight.shape == (32, 64)
    assert m.bias is None and Fp8Linear(64, 32, bias=True).bias.shape == (32,)
    assert "scaling=current" in repr(m)
    assert not any("history" in k for k in m.state_dict())  # current scaling keeps no state


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_close_to_fp32_linear(scaling, bias):
    m, ref = pair(Fp8Recipe(scaling=scaling, amax_history_len=8), bias=bias)
    for step in range(3):
        # delayed scaling casts with the amax of earlier steps: keep the distribution steady (a growing one
        # saturates, see test_delayed_stale_scale_saturates)
        x = torch.randn(3, 17, 96) * (1 + step if scaling == "current" else 2)
        xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, yr = m(xm), ref(xr)
        assert y.shape == yr.shape == (3, 17, 80) and y.dtype == torch.float32
        g = torch.randn_like(y)
        y.backward(g)
        yr.backward(g)
        assert rel(y, yr) < 0.06
        assert rel(xm.grad, xr.grad) < 0.1
        assert rel(m.weight.grad, ref.weight.grad) < 0.1
        assert m.weight.grad.dtype == torch.float32
        if bias:
            assert rel(m.bias.grad, ref.bias.grad) < 1e-6  # the bias gradient is a plain fp32 sum
        m.zero_grad()
        ref.zero_grad()


def test_dtypes_and_autocast():
    m = Fp8Linear(64, 48)
    x32 = torch.randn(5, 64, requires_grad=True)
    assert m(x32).dtype == torch.float32
    xb = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    yb = m(xb)
    assert yb.dtype == torch.bfloat16
    yb.sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x32)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x32.grad.dtype == torch.float32


def test_forward_saves_only_fp8_tensors_and_scales():
    m = Fp8Linear(64, 48)
    saved = []
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = m(x)
    assert saved, "nothing saved?"
    for t in saved:
        assert t.dtype in FP8 or (t.dtype == torch.float32 and t.numel() == 1), (t.dtype, t.shape)
    y.sum().backward()


def test_grads_only_where_needed_and_inference():
    m = Fp8Linear(32, 16)
    x = torch.randn(4, 32)  # no grad wanted for x: only the weight gradient
    m(x).sum().backward()
    assert m.weight.grad is not None
    m.weight.requires_grad_(False)
    xg = torch.randn(4, 32, requires_grad=True)
    m(xg).sum().backward()
    assert xg.grad is not None
    with torch.no_grad():
        assert m(torch.randn(2, 32)).shape == (2, 16)


def test_amax_and_scale_exposed_current():
    m = Fp8Linear(64, 48)
    x = torch.randn(10, 64) * 3
    x[0, 0] = float("nan")  # amax is over finite elements
    y = m(x.requires_grad_())
    for site in ("input", "weight"):
        assert m.fp8_amax[site].shape == () and m.fp8_amax[site].dtype == torch.float32
    finite = x.detach().nan_to_num(0.0)
    assert float(m.fp8_amax["input"]) == float(finite.abs().max())
    assert float(m.fp8_amax["weight"]) == float(m.weight.detach().abs().max())
    assert torch.equal(m.fp8_scale["input"], current_scale(m.fp8_amax["input"], E4M3))
    g = torch.randn_like(y)
    y.backward(g)
    assert float(m.fp8_amax["grad_output"]) == float(g.abs().max())
    assert torch.equal(m.fp8_scale["grad_output"], current_scale(m.fp8_amax["grad_output"], E5M2))


def test_delayed_history_rolls_and_scale():
    H, margin = 4, 1
    m = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=H, margin=margin))
    assert {"amax_history_input", "scale_input", "amax_history_grad_output"} <= set(m.state_dict())
    assert not any("accum" in k for k in m.state_dict())  # the Triton accumulator is scratch, not state
    amaxes = []
    for step in range(6):
        x = torch.randn(8, 32) * (step + 1)
        used = m.scale_input.clone()
        m(x.clone().requires_grad_()).sum().backward()
        amaxes.insert(0, float(x.abs().max()))
        assert float(m.fp8_scale["input"]) == float(used)  # this call's cast used the scale from before it
        expect_hist = (amaxes + [0.0] * H)[:H]
        assert m.amax_history_input.tolist() == pytest.approx(expect_hist, rel=0, abs=0)
        assert torch.equal(m.scale_input, delayed_scale(m.amax_history_input, E4M3, margin))
        assert float(m.amax_history_grad_output[0]) == 1.0  # d(sum)/dy = 1
    assert float(Fp8Linear(8, 8, recipe=Fp8Recipe(scaling="delayed")).scale_weight) == 1.0  # empty history


def test_delayed_stale_scale_saturates():
    m = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=2))
    m(torch.randn(8, 32))  # history: amax ~3
    x = torch.randn(8, 32) * 1000  # far above what the stale scale allows
    y = m(x)
    assert torch.isfinite(y).all()
    s = m.fp8_scale["input"]
    assert float((x * s).abs().max()) > E4M3.max  # values were clamped to +-448, not cast to NaN
    # the output equals the GEMM of the saturated operand
    qx = (x * s).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    sw = m.fp8_scale["weight"]
    qw = (m.weight.detach() * sw).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    expect = fp8_gemm_ref(qx, qw, 1 / s, 1 / sw, torch.float32)
    assert rel(y, expect) < 1e-5


def test_without_saturation_an_overflow_of_a_stale_scale_is_nan_in_the_output_and_the_gradient():
    m = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=2, saturate=False))
    saturating = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=2))
    saturating.load_state_dict(m.state_dict())
    x0 = torch.randn(8, 32).clamp(-2, 2)
    m(x0), saturating(x0)  # history: amax 2
    x = torch.randn(8, 32).clamp(-1.9, 1.9)
    assert torch.equal(m(x), saturating(x))  # inside the range: the same as the saturating cast
    x[3, 5] = 1000.0  # one element past what the stale scale allows
    x.requires_grad_()
    y = m(x)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[[0, 1, 2, 4, 5, 6, 7]]).all()  # E4M3 has no Inf: NaN
    g = torch.full((8, 16), 1e6)  # an E5M2 gradient past its stale scale becomes +-Inf
    m2 = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=2, saturate=False))
    xx = torch.randn(8, 32, requires_grad=True)
    m2(xx).backward(torch.ones(8, 16))  # history of grad_output: amax 1
    xx.grad = None
    m2(xx).backward(g)
    assert not torch.isfinite(xx.grad).all()


def test_a_frozen_delayed_scale_stops_following_the_history_after_n_steps():
    recipe = Fp8Recipe(scaling="delayed", amax_history_len=4, freeze_scale_after=3)
    m = Fp8Linear(32, 16, recipe=recipe)
    assert "scale_updates_input" in m.state_dict()  # saved: a resumed run stays frozen
    scales = []
    for step in range(6):
        x = torch.randn(8, 32) * (step + 1)
        m(x)
        scales.append(float(m.scale_input))
    assert scales[0] > scales[1] > scales[2]  # refreshed from the growing amax while step < 3
    assert scales[2] == scales[3] == scales[4] == scales[5]  # then frozen ...
    assert float(m.amax_history_input[0]) == float(x.abs().max())  # ... while the history rolls on
    assert float(m.scale_input) > float(delayed_scale(m.amax_history_input, E4M3, 0))


def test_recipes_the_triton_kernels_cannot_run_are_refused_there_and_validated():
    from fp8mon.trainer.fp8_linear import _resolve_backend

    with pytest.raises(ValueError, match="delayed scaling only"):
        Fp8Recipe(freeze_scale_after=10)
    with pytest.raises(ValueError, match=">= 0"):
        Fp8Recipe(scaling="delayed", freeze_scale_after=-1)
    with pytest.raises(ValueError, match="torch backend"):
        _resolve_backend("triton", torch.device("cpu"), Fp8Recipe(saturate=False))
    assert _resolve_backend("auto", torch.device("cpu"), Fp8Recipe(saturate=False)) == "torch"


def test_cpu_reference_gemm_dequantizes(monkeypatch):
    """On the CPU the reference GEMM is the fp32 product of the dequantized operands (every FP8 product is exact
    in fp32); it never calls torch._scaled_mm, whose CPU kernel took ~1 s for a small product on some CPUs."""
    a = torch.randn(20, 48).to(torch.float8_e5m2)
    b = torch.randn(24, 48).to(torch.float8_e5m2)
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)

    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    got = fp8_gemm_ref(a, b, sa, sb, torch.float32)
    assert rel(got, a.double() @ b.double().t()) < 1e-6
    bias = torch.randn(24)
    got = fp8_gemm_ref(a, b, sa, sb, torch.bfloat16, bias=bias)
    assert got.dtype == torch.bfloat16 and rel(got.float(), a.float() @ b.float().t() + bias) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_no_host_sync_cuda(scaling):
    m = Fp8Linear(256, 512, recipe=Fp8Recipe(scaling=scaling, amax_history_len=16), device="cuda")
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    for _ in range(2):  # compile, autotune and pick variants first (those synchronize)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.backward(torch.ones_like(y))
        _ = [v * 1 for v in m.fp8_amax.values()]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert set(m.fp8_amax) == {"input", "weight", "grad_output"}


def test_with_weight_caching_the_fp8_weight_is_cast_once_per_optimizer_step():
    """Micro-batches of one optimizer step reuse the FP8 weight (delayed scaling: its history rolls once);
    after the optimizer's step it is cast again, even by an optimizer that writes the weight without bumping
    its version counter (as torch's fused AdamW does on CUDA)."""
    m = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=4))

    class DataSGD(torch.optim.Optimizer):
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.data.mul_(2)  # .data: the parameter's version counter stays

    opt = DataSGD(m.parameters(), {})
    assert cache_fp8_weights(m, opt) == 1
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(3):  # one step: the first cast (empty history, scale 1) is not reused, the second is
        m(x).sum().backward()
    amax = float(m.weight.detach().abs().max())
    assert m.amax_history_weight.tolist() == pytest.approx([amax, amax, 0, 0])
    assert m.amax_history_input.tolist()[:3] == pytest.approx([float(x.detach().abs().max())] * 3)
    opt.step()
    y = m(x)
    assert m.amax_history_weight.tolist() == pytest.approx([2 * amax, amax, amax, 0])
    qw = (m.weight.detach() * m.fp8_scale["weight"]).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    qx = (x.detach() * m.fp8_scale["input"]).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    assert rel(y, fp8_gemm_ref(qx, qw, 1 / m.fp8_scale["input"], 1 / m.fp8_scale["weight"], torch.float32)) < 1e-5
    with torch.no_grad():
        m.weight.copy_(m.weight / 4)  # a checkpoint load: in place, version bumped, no optimizer step
    m(x)
    assert m.amax_history_weight.tolist() == pytest.approx([amax / 2, 2 * amax, amax, amax])


def test_without_weight_caching_every_forward_casts_the_weight():
    m = Fp8Linear(32, 16, recipe=Fp8Recipe(scaling="delayed", amax_history_len=4))
    x = torch.randn(8, 32)
    m(x), m(x)
    amax = float(m.weight.detach().abs().max())
    assert m.amax_history_weight.tolist() == pytest.approx([amax, amax, 0, 0])
