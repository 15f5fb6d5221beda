"""The trainer's fused kernels on a GPU (marked ``gpu``: skipped without CUDA): their statistics rows against the
fp64-tested torch path (``stats.torch_path.partials``) of the tensors they return or read, their results against
torch's, and no host sync. Each kernel runs in its default configuration."""

from __future__ import annotations

import pytest
import torch
from rowcheck import NullTransport, agent_rows, rows_close, sync_free

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats import torch_path as ds

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda")


def _check(problems: list[str]) -> None:
    failed = [p for p in problems if p]
    assert not failed, "\n".join(failed)


def _slack(row: torch.Tensor) -> float:
    """Current scaling's underflow comes from the histogram: exact up to the threshold's binade."""
    return row[ds.HIST:].nan_to_num(0).max().item()


def test_fused_kernels_do_no_host_sync(device):
    from fp8mon.trainer.kernels import fp8_gemm, quantize, quantize_transpose

    x = torch.randn(4096, 768, device=device, dtype=torch.bfloat16)
    scale = torch.tensor(2.0, device=device)
    center = torch.zeros(2, dtype=torch.float64, device=device)
    rowsbuf = torch.zeros(4, ds.WIDTH, dtype=torch.float64, device=device)
    qa, qb = x.to(torch.float8_e4m3fn), x[:512].to(torch.float8_e5m2)
    qt = qa.t().contiguous()  # a wgrad-like (768, 768, K=4096) product, split in 4

    def fused():
        for i in range(10):
            quantize_transpose(x, "e4m3", stats=ts.Target(rowsbuf, 0, i > 0, center))
            quantize_transpose(x, "e5m2", scale=scale, accum=torch.zeros((), device=device),
                               stats=ts.Target(rowsbuf, 1, False, (0.1, 2.0)))
            quantize(x, "e4m3", stats=ts.Target(rowsbuf, 2, False, None))
        ts.flush_deferred()  # (the current-scaled casts' rows, merged later)

    def gemm():
        for impl in ("ptr", "tma"):
            fp8_gemm(qa, qb, scale, scale, stats=ts.Target(rowsbuf, 3, False, center, fmt="e5m2"), impl=impl)
            fp8_gemm(qt, qt, scale, scale, torch.float32, stats=ts.Target(rowsbuf, 3, True, (0.1, 2.0)),
                     impl=impl, split_k=4)

    fused()
    gemm()
    _check([sync_free("fused quantize / quantize_transpose statistics", fused),
            sync_free("fp8_gemm epilogue statistics (ptr, tma, split-K)", gemm)])


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_an_agent_reporting_step_does_no_host_sync(device, precision):
    """A full reporting step of a small real model: hooks, fused rows, the step buffer, centers, the device-to-host
    copy and the collector job."""
    from fp8mon.agent import Agent
    from fp8mon.trainer.config import get_config
    from fp8mon.trainer.model import Transformer, autocast

    cfg = get_config("tiny", vocab_size=512)
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
    problem = sync_free(f"agent reporting step, tiny llama {precision}", lambda: train(3))
    agent.close()
    assert agent.errors == 0, agent.last_error
    _check([problem])


@pytest.mark.parametrize("shape", [(256, 384), (1000, 777), (4096, 768), (1, 5)])
@pytest.mark.parametrize("dt,fmt", [(torch.bfloat16, "e4m3"), (torch.float32, "e5m2")])
def test_fused_quantize_rows(device, shape, dt, fmt):
    from fp8mon.trainer.kernels import quantize, quantize_transpose

    g = torch.Generator(device="cpu").manual_seed(3)
    m, n = shape
    x = (torch.randn(m, n, generator=g) * 3).to(dt).to(device)
    if m > 10:
        x[3, 4] = float("nan")
        x[5, 1] = 0.0
    problems = []
    for delayed in (False, True):
        scale = torch.tensor(7.0, device=device) if delayed else None
        center = torch.tensor([0.1, 2.0], dtype=torch.float64, device=device)
        ref_q = quantize_transpose(x, fmt, scale=scale, accum=torch.zeros((), device=device) if delayed else None)
        for hist in (True, False):  # without the histogram bf16 inputs take the word loop
            tgt = ts.Target(ts.Target.new(device).rows, 0, False, center, 6.0, hist, None)
            r = quantize_transpose(x, fmt, scale=scale, accum=torch.zeros((), device=device) if delayed else None,
                                   stats=tgt)
            ts.flush_deferred()
            why = rows_close(tgt.rows[0], ts.partials(x, fmt=fmt, scale=r.scale, center=center, hist=hist))[1]
            same_q = torch.equal(r.data.view(torch.uint8), ref_q.data.view(torch.uint8)) and \
                torch.equal(r.data_t.view(torch.uint8), ref_q.data_t.view(torch.uint8)) and \
                torch.equal(r.meta[int(delayed):], ref_q.meta[int(delayed):])
            problems.append(f"quantize_transpose delayed={delayed} hist={hist}: {why}" if why else "")
            problems.append("" if same_q else f"quantize_transpose delayed={delayed}: fp8 data or meta differs")
        tgt1 = ts.Target(ts.Target.new(device).rows, 0, False, center, 6.0, True, None)
        quantize(x, fmt, scale=scale, accum=torch.zeros((), device=device) if delayed else None, stats=tgt1)
        why = rows_close(tgt1.rows[0], ts.partials(x, fmt=fmt, scale=r.scale, center=center))[1]
        problems.append(f"quantize delayed={delayed}: {why}" if why else "")
    _check(problems)


def test_fp8_linear_rows_from_its_kernels_equal_the_hooks_rows(device):
    from fp8mon.trainer.fp8_linear import Fp8Linear

    torch.manual_seed(4)
    model = torch.nn.Sequential(Fp8Linear(256, 512), torch.nn.GELU(), Fp8Linear(512, 256)).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cpu").manual_seed(5)
    xs = [torch.randn(8, 64, 256, generator=g).to(device) * (1 + i) for i in range(8)]
    make = lambda step, micro: xs[2 * step + micro]  # noqa: E731
    got, keys = agent_rows(model, make, 3, fused=True)
    model.load_state_dict(state)  # the same training again, every site through the hooks
    want, keys2 = agent_rows(model, make, 3, fused=False)
    assert sorted(keys) == sorted(keys2)
    order = [keys2.index(k) for k in keys]
    problems = []
    for step in range(3):
        a, b = got[step].clone(), want[step][order].clone()
        # the hooks emulate current scaling (fp64 max/amax, underflow from the histogram); the kernel's current scale
        # is reciprocal(amax) * max in fp32: an ulp apart at most, underflow within a binade
        rel = ((a[:, ds.SCALE] - b[:, ds.SCALE]).abs() / b[:, ds.SCALE].abs()).nan_to_num(0)
        if not bool((rel < 2.5e-7).all()):
            problems.append(f"step {step}: scales {rel.max().item()} apart")
        a[:, ds.SCALE] = b[:, ds.SCALE]
        why = rows_close(a, b, rtol=1e-6, under_slack=b[:, ds.HIST:].max().item())[1]
        problems.append(why and f"step {step}: {why}; rows {keys}")
    _check(problems)


@pytest.mark.parametrize("M,N,K,od,bias,split", [(1000, 777, 512, torch.bfloat16, True, None),
                                                 (4096, 4096, 1024, torch.bfloat16, False, None),
                                                 (768, 768, 16384, torch.float32, False, None),
                                                 (300, 200, 8192, torch.float32, True, 3),
                                                 (1, 5, 16, torch.float32, False, None)])
def test_gemm_epilogue_rows(device, M, N, K, od, bias, split):
    from fp8mon.trainer.kernels import fp8_gemm

    g = torch.Generator(device="cpu").manual_seed(6)
    center = (0.05, 3.0)
    a = torch.randn(M, K, generator=g).to(device).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, generator=g) * 2).to(device).to(torch.float8_e5m2)
    sa, sb = torch.tensor(0.5, device=device), torch.tensor(0.01, device=device)
    bv = torch.randn(N, generator=g).to(device) if bias else None
    problems = []
    for impl in ("ptr", "tma"):
        for fmt in (None, "e5m2"):
            tgt = ts.Target.new(device, center=center, fmt=fmt)
            c = fp8_gemm(a, b, sa, sb, od, bv, impl=impl, split_k=split, stats=tgt)
            plain = fp8_gemm(a, b, sa, sb, od, bv, impl=impl, split_k=split)
            ts.flush_deferred()
            want = ds.partials(c, fmt=fmt, outlier_center=center)
            why = rows_close(tgt.rows[0], want, under_slack=_slack(want) if fmt else None)[1]
            problems.append(why and f"{impl} fmt={fmt}: {why}")
            problems.append("" if torch.equal(c.view(torch.uint8), plain.view(torch.uint8)) else
                            f"{impl} fmt={fmt}: C differs with statistics on")
    _check(problems)


@pytest.mark.parametrize("shape,dt,nan,hist", [((16, 1024, 768), torch.float32, False, True),
                                               ((16, 1024, 768), torch.float32, False, False),
                                               ((4, 2048, 2048), torch.float32, False, True),
                                               ((4, 1000, 1600), torch.bfloat16, False, True),
                                               ((16, 1024, 768), torch.bfloat16, False, False),
                                               ((16, 1024, 768), torch.bfloat16, False, True),
                                               ((3, 77, 768), torch.bfloat16, True, False),
                                               ((3, 77, 768), torch.float32, True, True)])
def test_rmsnorm(device, shape, dt, nan, hist):
    """y, dx and dw against torch's ops, and the row of y against the oracle's of y as returned."""
    from fp8mon.trainer.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator(device="cpu").manual_seed(10)
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
    problems = [f"{w} max difference {float((a.float() - b.float()).abs().max())}"
                for w, a, b in (("y", y1.detach(), y2.detach()), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad))
                if not torch.allclose(a.float(), b.float(), equal_nan=True, **tol)]
    want = ds.partials(y1.detach(), fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist)
    problems.append(rows_close(tgt.rows[0], want, under_slack=_slack(want))[1])
    _check(problems)


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16])
def test_residual_add(device, xd):
    """x + b and its gradients equal torch's, its rows of b and of b's gradient the oracle's."""
    from fp8mon.trainer.kernels.residual import residual_add

    g = torch.Generator(device="cpu").manual_seed(9)
    x0 = torch.randn(4, 1000, 2048, generator=g).to(xd).to(device)
    b0 = (torch.randn(4, 1000, 2048, generator=g) * 4).to(torch.bfloat16).to(device)
    x1, b1 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
    tgt = ts.Target.new(device, center=(0.0, 4.0), fmt="e4m3")
    tgt_g = ts.Target.new(device, center=(0.0, 1.0), fmt="e5m2")
    out = residual_add(x1, b1, stats=tgt, grad_stats=lambda: tgt_g)
    dout = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
    out.backward(dout)
    ts.flush_deferred()
    same = torch.equal(out.detach(), x0 + b0) and torch.equal(x1.grad, dout.to(xd)) and \
        torch.equal(b1.grad, dout.to(torch.bfloat16))
    want = ds.partials(b0, fmt="e4m3", outlier_center=(0.0, 4.0))
    want_g = ds.partials(b1.grad, fmt="e5m2", outlier_center=(0.0, 1.0))
    _check([rows_close(tgt.rows[0], want, under_slack=_slack(want))[1],
            rows_close(tgt_g.rows[0], want_g, under_slack=_slack(want_g))[1],
            "" if same else "sum or gradients differ"])


@pytest.mark.parametrize("shape,dt", [((4, 1000, 2 * 1536), torch.bfloat16), ((777, 2 * 300), torch.float32)])
def test_swiglu(device, shape, dt):
    """Forward and backward against torch's autograd of F.silu(gate) * up (bf16: at most one unit in the last place,
    on under 1% of the elements; fp32 close), the rows of y and h and the backward's row of dy the oracle's."""
    from fp8mon.trainer.kernels.swiglu import swiglu, swiglu_ref

    g = torch.Generator(device="cpu").manual_seed(8)
    y0 = (torch.randn(*shape, generator=g) * 3).to(dt).to(device)
    dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dt).to(device)
    y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
    h1, h2 = swiglu(y1), swiglu_ref(y2)
    h1.backward(dh)
    h2.backward(dh)
    problems = []
    for what, a, b in (("h", h1.detach(), h2.detach()), ("dy", y1.grad, y2.grad)):
        if dt == torch.bfloat16:
            ulp = (a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -7 + 1e-30
            off = float((a != b).float().mean())
            if not (bool(ulp.all()) and off < 0.01):
                problems.append(f"{what}: {off:.3%} of elements differ")
        elif not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            problems.append(f"{what}: max difference {float((a - b).abs().max())}")
    for fmt, hist in (("e4m3", True), (None, False)):
        slack = _slack if fmt else (lambda row: None)
        tgt = ts.Target.new(device, center=(0.0, 3.0), hist=hist, fmt=fmt)
        tgt_h = ts.Target.new(device, center=(0.0, 1.0), hist=hist, fmt=fmt)
        h = swiglu(y0, stats=tgt, h_stats=tgt_h)
        ts.flush_deferred()  # a deferred row of h waits for the next statistics launch
        want = ds.partials(y0, fmt=fmt, outlier_center=(0.0, 3.0), hist=hist)
        want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
        problems.append(rows_close(tgt.rows[0], want, under_slack=slack(want))[1])
        problems.append(rows_close(tgt_h.rows[0], want_h, under_slack=slack(want_h))[1])
        tgt_dy = ts.Target.new(device, center=(0.0, 1.0), hist=hist, fmt="e5m2" if fmt else None)
        y3 = y0.clone().requires_grad_()
        swiglu(y3, dy_stats=lambda t=tgt_dy: t).backward(dh)
        ts.flush_deferred()
        want_dy = ds.partials(y3.grad, fmt=tgt_dy.fmt, outlier_center=(0.0, 1.0), hist=hist)
        problems.append(rows_close(tgt_dy.rows[0], want_dy, under_slack=slack(want_dy))[1])
        problems.append("" if torch.equal(y3.grad, y1.grad) else "dy differs with the row")
    _check(problems)


def test_weight_casts(device):
    """``weight_cast``: w.to(bf16) and the gradient cast back equal torch's, the row of w's own fp32 values the
    oracle's; the same of ``casts_with_rows``, several weights (one with a NaN: the careful path) in one launch."""
    from fp8mon.trainer.kernels.residual import weight_cast
    from fp8mon.trainer.kernels.weight_casts import casts_with_rows

    g = torch.Generator(device="cpu").manual_seed(11)
    problems = []
    for shape in ((3072, 768), (2048, 2048), (77, 33)):
        w0 = (torch.randn(*shape, generator=g) * 0.02 + 0.001).to(device)
        w = w0.clone().requires_grad_()
        tgt = ts.Target.new(device, center=(0.0, 0.02), hist=True, fmt="e4m3")
        wb = weight_cast(w, torch.bfloat16, tgt)
        gy = torch.randn(*shape, generator=g).to(device, torch.bfloat16)
        wb.backward(gy)
        ts.flush_deferred()
        want = ds.partials(w0, fmt="e4m3", outlier_center=(0.0, 0.02), hist=True)
        problems.append(rows_close(tgt.rows[0], want, under_slack=_slack(want))[1])
        if not (torch.equal(wb.detach(), w0.to(torch.bfloat16)) and torch.equal(w.grad, gy.float())):
            problems.append(f"weight cast {shape}: values differ from torch's")
    ws = [(torch.randn(*shape, generator=g) * 0.02 + 0.001).to(device)
          for shape in ((3072, 768), (768, 768), (2048, 2048), (77, 33))]
    ws[2][5, 7] = float("nan")
    rows = torch.zeros(len(ws), ds.WIDTH, dtype=torch.float64, device=device)
    casts = casts_with_rows(ws, torch.bfloat16, [ts.Target(rows, i, False, (0.0, 0.02), 6.0, True, None, "e4m3")
                                                 for i in range(len(ws))])
    ts.flush_deferred()
    for i, (w, wb) in enumerate(zip(ws, casts)):
        want = ds.partials(w, fmt="e4m3", outlier_center=(0.0, 0.02), hist=True)
        problems.append(rows_close(rows[i], want, under_slack=_slack(want))[1])
        if not torch.equal(wb.float().nan_to_num(9), w.to(torch.bfloat16).float().nan_to_num(9)):
            problems.append(f"weight casts in one launch {tuple(w.shape)}: values differ from torch's")
    _check(problems)


@pytest.mark.parametrize("dims,dt,nan", [((2, 1000, 16, 128), torch.bfloat16, False),
                                         ((3, 77, 4, 64), torch.float32, False),
                                         ((2, 256, 6, 128), torch.bfloat16, True)])
def test_rope(device, dims, dt, nan):
    """q, k, v and qkv's gradient equal torch's, the forward's row of qkv and the backward's of its gradient the
    oracle's, the first merged into on a second call."""
    from fp8mon.trainer.kernels.rope import rope_qkv, rope_qkv_ref
    from fp8mon.trainer.layers import Rotary

    b, t, nh, hd = dims
    g = torch.Generator(device="cpu").manual_seed(10)
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
        if x.shape != y.shape or not torch.equal(x, y):
            problems.append(f"{what} differs from torch's")
    want = ds.partials(qkv0, fmt="e4m3", outlier_center=(0.25, 2.0), hist=True)
    problems.append(rows_close(tgt.rows[0], want, under_slack=_slack(want))[1])
    tgt.merge = True
    rope_qkv(qkv0 * 2, rot.cos, rot.sin, nh, stats=tgt)
    ts.flush_deferred()
    both = ds.merge(want, ds.partials(qkv0 * 2, fmt="e4m3", outlier_center=(0.25, 2.0), hist=True))
    problems.append(rows_close(tgt.rows[0], both, under_slack=_slack(both))[1])
    want_g = ds.partials(a.grad, fmt="e5m2", outlier_center=(0.0, 1.0), hist=True)
    problems.append(rows_close(tgt_g.rows[0], want_g, under_slack=_slack(want_g))[1])
    _check(problems)


@pytest.mark.parametrize("dims,dt,sdpa,nan", [((16, 12, 1024, 64), torch.bfloat16, True, False),
                                              ((4, 16, 512, 128), torch.bfloat16, True, True),
                                              ((3, 5, 77, 32), torch.float32, False, False)])
def test_merge_heads(device, dims, dt, sdpa, nan):
    """The heads merged for the projection equal torch's copy bit for bit (and the gradient torch's), from the
    attention's own output layout and from a contiguous one, NaN included."""
    import torch.nn.functional as F

    from fp8mon.trainer.kernels.heads import merge_heads, merge_heads_ref

    b, nh, t, hd = dims
    g = torch.Generator(device="cpu").manual_seed(13)
    q, k, v = (torch.randn(b, nh, t, hd, generator=g).to(dt).to(device) for _ in range(3))
    y0 = F.scaled_dot_product_attention(q, k, v, is_causal=True) if sdpa else q * 2 + 0.25
    if nan:
        y0[1, 2, 7, 5] = float("nan")
    a, r = y0.clone().requires_grad_(), y0.clone().requires_grad_()
    got, ref = merge_heads(a), merge_heads_ref(r)
    grad = torch.randn(b, t, nh * hd, generator=g).to(dt).to(device)
    got.backward(grad)
    ref.backward(grad)
    bits = torch.int16 if dt == torch.bfloat16 else torch.int32  # (NaN != NaN: compare the bits)
    assert torch.equal(got.detach().view(bits), ref.detach().view(bits))
    assert torch.equal(a.grad, r.grad) and got.is_contiguous()
