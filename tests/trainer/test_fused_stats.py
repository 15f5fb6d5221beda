"""Statistics fused into the trainer's quantize kernels, on the CPU in Triton's interpreter (the ``interpreted``
fixture): the row that ``quantize``/``quantize_transpose`` write with ``stats=`` equals the standalone kernel's row
(``agent.stats.launch``) and the torch path's (``quantize.stats_ref``) with the scale actually used, the FP8 data is
bit-identical with and without statistics, and an agent watching ``Fp8Linear`` layers reports the same rows from the
fused kernels as from its own hooks (no hook reads input, weight or grad_output)."""

from __future__ import annotations

import pytest
import torch
from trainer_rows import agent_rows, row_problems

pytestmark = pytest.mark.usefixtures("interpreted")

# the fused kernels: quantize; quantize_transpose, whose current-scaled row comes from the standalone statistics kernel
# in place of the amax pass and is merged later (delayed scaling has no amax pass: its cast takes the row itself)
KERNELS = ["quantize", "quantize_transpose"]
SCALINGS = [(k, delayed) for k in KERNELS for delayed in (False, True)]


def _kernel(monkeypatch, name: str):
    from fp8mon.trainer import kernels

    return kernels.quantize if name == "quantize" else kernels.quantize_transpose


def _same_bits(a, b) -> bool:
    return a is None and b is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check(*problems: str) -> None:
    bad = [p for p in problems if p]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "e4m3"), (torch.float32, "e5m2")])
@pytest.mark.parametrize("shape", [(130, 70), (1, 3)])
@pytest.mark.parametrize("kernel,delayed", SCALINGS)
def test_a_casts_row_is_the_standalone_kernels_and_the_torch_paths(monkeypatch, kernel, shape, dtype, fmt, delayed):
    """With a NaN and a zero (the careful path); the FP8 data and scale are the same with and without the row."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer.kernels.quantize import stats_ref

    fn = _kernel(monkeypatch, kernel)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    if shape[0] > 2:
        x[1, 2] = float("nan")
        x[2, 1] = 0.0
    scale = torch.tensor(7.0) if delayed else None
    center = torch.tensor([0.1, 2.0], dtype=torch.float64)
    acc = (lambda: torch.zeros(())) if delayed else (lambda: None)
    tgt = ts.Target.new("cpu", center=center, amax_history_max=torch.tensor(1.5) if delayed else None)
    tgt.rows.fill_(float("nan"))  # a row not merged into is overwritten, whatever it held
    r = fn(x, fmt, scale=scale, accum=acc(), stats=tgt)
    plain = fn(x, fmt, scale=scale, accum=acc())
    assert _same_bits(r.data, plain.data) and _same_bits(r.data_t, plain.data_t)
    assert torch.equal(r.meta[int(delayed):], plain.meta[int(delayed):])
    ts.flush_deferred()  # a current-scaled cast's row may be merged later
    standalone = ts.partials(x, fmt=fmt, scale=r.scale, center=center, amax_history_max=tgt.amax_history_max)
    ref = ts.Target.new("cpu", center=(0.1, 2.0), amax_history_max=tgt.amax_history_max)
    _check(row_problems(tgt.rows[0], standalone), row_problems(tgt.rows[0], stats_ref(x, fmt, r.scale, ref)))


@pytest.mark.parametrize("hist", [True, False])
@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "e4m3"), (torch.float32, "e5m2")])
@pytest.mark.parametrize("kernel,delayed", SCALINGS)
def test_the_fast_path_counts_zeros_underflows_overflows_and_outliers(monkeypatch, kernel, dtype, fmt, delayed, hist):
    """Finite inputs (the fast path), with and without the histogram, on full and edge tiles: every count of the row
    is the torch path's, and a delayed cast accumulates the amax."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels.quantize import stats_ref

    fn = _kernel(monkeypatch, kernel)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(130, 260, generator=g) * 3 + 0.5
    x[::7, ::5] = 0.0
    x[3, :40] = 1e-10  # below half the smallest subnormal at every scale used: underflows
    x[5, 7] = 40.0  # an outlier
    x = x.to(dtype)
    scale = torch.tensor(20.0 if fmt == "e4m3" else 6000.0) if delayed else None  # stale: overflows
    acc = torch.zeros(()) if delayed else None
    tgt = ts.Target.new("cpu", center=(0.5, 3.0), hist=hist)
    r = fn(x, fmt, scale=scale, accum=acc, stats=tgt)
    ref = stats_ref(x, fmt, r.scale, ts.Target.new("cpu", center=(0.5, 3.0), hist=hist))
    ts.flush_deferred()
    counts = {k: float(ref[i]) for k, i in (("zeros", ds.ZEROS), ("under", ds.UNDERFLOW), ("over", ds.OVERFLOW),
                                            ("outliers", ds.OUTLIERS))}
    assert counts["zeros"] > 0 and counts["outliers"] > 0 and counts["under"] > 0
    assert counts["over"] > 0 or not delayed
    if delayed:
        assert float(acc) == float(x.float().abs().max())
    _check(row_problems(tgt.rows[0], ref))


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_a_second_cast_into_the_same_row_merges(monkeypatch, kernel):
    """Micro-batches: the second call merges into the row as stats.torch_path.merge does, its underflows included."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds

    fn = _kernel(monkeypatch, kernel)
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(40, 60, generator=g), torch.randn(40, 60, generator=g) * 5 + 1
    x2[0, :5] = 1e-9  # underflows at x2's scale
    tgt = ts.Target.new("cpu")
    r1 = fn(x1, "e4m3", stats=tgt)
    tgt.merge = True
    r2 = fn(x2, "e4m3", stats=tgt)
    want = ds.merge(ts.partials(x1, fmt="e4m3", scale=r1.scale), ts.partials(x2, fmt="e4m3", scale=r2.scale))
    ts.flush_deferred()
    assert float(want[ds.UNDERFLOW]) >= 5
    _check(row_problems(tgt.rows[0], want))


# ---- Fp8Linear watched by an agent -----------------------------------------------------------------------------------

def _fp8_mlp(seed: int, d_in=32, hidden=64, layers=1, underflowing_weights=False):
    from fp8mon.trainer.fp8_linear import Fp8Linear

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (Fp8Linear(d_in, hidden), torch.nn.GELU(),
                                                                      Fp8Linear(hidden, d_in))])
    for m in model:
        if isinstance(m, Fp8Linear):
            m.backend = "triton"  # the Triton kernels, in the interpreter
            if underflowing_weights:
                with torch.no_grad():
                    m.weight[0, :8] = 1e-9  # underflows in E4M3 at the weight's scale: the cast counts them
    return model


def _inputs(n=4, t=16):
    xs = [torch.randn(2, t, 32, generator=torch.Generator().manual_seed(50 + i)) * (1 + i) for i in range(n)]
    return lambda step, micro: xs[2 * step + micro]


def _assert_like_the_hooks(got, want, keys, keys2):
    """The fused rows equal the hooks' (the scales at most an ulp apart: the kernel's reciprocal(amax) * max in fp32
    against the hooks' fp64 emulation; the hooks' underflow from the histogram)."""
    from fp8mon.agent.stats import torch_path as ds

    order = [keys2.index(k) for k in keys]
    for step in range(len(got)):
        a, b = got[step].clone(), want[step][order].clone()
        rel = ((a[:, ds.SCALE] - b[:, ds.SCALE]).abs() / b[:, ds.SCALE]).nan_to_num(0)
        assert float(rel.max()) <= 2.5e-7, f"step {step}: scale differs by {float(rel.max())}"
        a[:, ds.SCALE] = b[:, ds.SCALE]
        _check(row_problems(a, b, under_slack=float(b[:, ds.HIST:].max())))


@pytest.mark.parametrize("mode", ["epilogue", "deferred"])
def test_fp8_linears_report_the_rows_their_hooks_would(monkeypatch, mode):
    """Two steps of two micro-batches (step 0 without outlier centers, step 1 with step 0's), the output row taken by
    the GEMM's epilogue (eagerly) or deferred to the next statistics launch (as under CUDA graphs): the rows equal the
    hooks', each output joins a cast's launch when deferred, and each step's weight rows come in one launch."""
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats.engine import Engine, engine
    from fp8mon.trainer import fp8_linear, kernels

    model = _fp8_mlp(4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fused_calls, deferred, launches, weight_batches = [], [], [], []
    real_gemm, real_defer, real_launch, real_cast_rows = kernels.fp8_gemm, ts.defer, Engine.launch, ts.cast_rows
    with monkeypatch.context() as m:
        m.setattr(fp8_linear, "output_stats_mode", lambda: mode)
        m.setattr(kernels, "fp8_gemm", lambda *a, stats=None, **kw: (fused_calls.append(stats is not None),
                                                                     real_gemm(*a, stats=stats, **kw))[1])
        m.setattr(ts, "defer", lambda x, target: (deferred.append(x.shape), real_defer(x, target))[1])
        m.setattr(Engine, "launch", lambda self, tensors, *a, **kw: (launches.append(len(tensors)),
                                                                     real_launch(self, tensors, *a, **kw))[1])
        m.setattr(ts, "cast_rows", lambda items, device: (weight_batches.append(len(items)),
                                                          real_cast_rows(items, device))[1])
        got, keys = agent_rows(model, _inputs(), 2, fused=True, stats_backend="triton")
    assert any(fused_calls) == (mode == "epilogue")
    if mode == "deferred":  # 2 steps x 2 micro-batches x 2 layers, each output in a cast's launch
        assert len(deferred) == 8 and sum(n > 1 for n in launches) >= 8 and not engine("cpu")._deferred
    assert weight_batches == [2, 2]  # each step: both layers' weights in its first weight cast's launch
    model.load_state_dict(state)
    want, keys2 = agent_rows(model, _inputs(), 2, fused=False, stats_backend="triton")
    _assert_like_the_hooks(got, want, keys, keys2)
    from trainer_rows import NullTransport

    from fp8mon.agent import Agent

    agent = Agent(transport=NullTransport(), every=1).watch(model)
    hooked = [h.sites for h in agent._layers]
    agent.close()
    # grad_weight is the one site Fp8Linear leaves to the hooks (weight.grad after accumulation, see fp8_linear)
    assert len(keys) == 10 and hooked == [("grad_weight",)] * 2


def test_a_gemm_whose_statistics_epilogue_fails_leaves_the_row_to_a_read(monkeypatch):
    """A GEMM variant with fused statistics that cannot compile or launch must not stop training: Fp8Linear computes
    the output row apart from then on, and the agent gets the same rows."""
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer import fp8_linear, kernels

    real = kernels.fp8_gemm

    def failing(*args, stats=None, **kw):
        if stats is not None:
            raise RuntimeError("out of resource: shared memory")
        return real(*args, **kw)

    model = _fp8_mlp(5, hidden=48)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    make = lambda step, micro: torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))  # noqa: E731
    monkeypatch.setattr(kernels, "fp8_gemm", failing)
    monkeypatch.setattr(fp8_linear, "output_stats_mode", lambda: "epilogue")
    monkeypatch.setitem(fp8_linear._GEMM_STATS, "ok", True)
    got, keys = agent_rows(model, make, 1, fused=True, stats_backend="triton")
    assert not fp8_linear._GEMM_STATS["ok"], "the failure was not noticed"
    monkeypatch.undo()
    model.load_state_dict(state)
    want, keys2 = agent_rows(model, make, 1, fused=False, stats_backend="triton")
    assert {"output", "grad_weight"} <= {k[1] for k in keys}
    order = [keys2.index(k) for k in keys]
    a, b = got[0].clone(), want[0][order].clone()
    a[:, ds.SCALE] = b[:, ds.SCALE]  # the quantize kernels' scale vs the hooks' emulation: an ulp apart
    _check(row_problems(a, b, under_slack=float(b[:, ds.HIST:].max())))


def test_cached_fp8_weights_give_the_same_rows():
    """With weight caching (micro-batches reuse the step's first FP8 weight) the rows equal those without it: a weight
    whose row the step's batch took still casts once, adding its underflow count to that row."""
    from fp8mon.trainer.fp8_linear import cache_fp8_weights

    model = _fp8_mlp(5, underflowing_weights=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain, keys = agent_rows(model, _inputs(), 2, fused=True, stats_backend="triton")
    model.load_state_dict(state)
    cache_fp8_weights(model, torch.optim.SGD(model.parameters(), lr=0.0))
    cached, keys2 = agent_rows(model, _inputs(), 2, fused=True, stats_backend="triton")
    assert keys == keys2
    for step in range(2):
        assert torch.equal(plain[step].nan_to_num(-1.0), cached[step].nan_to_num(-1.0)), step


def test_rows_merged_later_all_land_when_the_buffer_grows():
    """On a model whose 20 slots outgrow the agent's first step buffer (16 rows) in the middle of its first step, the
    rows waiting for their merge land before the buffer moves: every slot equals the hooks' row of the same tensor."""
    model = _fp8_mlp(6, hidden=48, layers=2)
    (fused, keys) = agent_rows(model, _inputs(t=8), 1, fused=True, stats_backend="triton")
    (hooked, keys2) = agent_rows(model, _inputs(t=8), 1, fused=False, stats_backend="triton")
    assert sorted(keys) == sorted(keys2) and len(keys) == 20  # (the weights' slots may be claimed in another order)
    _assert_like_the_hooks(fused, hooked, keys, keys2)


def test_clipping_takes_the_watched_gradients_norms_from_the_agents_rows():
    """Gradient clipping with the norms from the agent's grad_weight rows (trainer.clip) equals torch's clip_grad_norm_
    (norm and clipped gradients), takes those rows only on reporting steps and for gradients unchanged since, and gives
    NaN for a NaN gradient."""
    from trainer_rows import NullTransport

    from fp8mon.agent import Agent
    from fp8mon.trainer.clip import clip_grad_norm

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    params = list(model.parameters())
    agent = Agent(transport=NullTransport(), every=2, stats_backend="triton").watch(model)
    for step in range(3):  # steps 0 and 2 report; step 2's input holds a NaN
        x = torch.randn(4, 16) * (1 + step)
        if step == 2:
            x[1, 3] = float("nan")
        model.zero_grad(set_to_none=True)
        for _ in range(2):  # two micro-batches: the rows of the last backward pass's gradients count
            model(x).square().mean().backward()
        if step == 0:  # changed in place after its row was taken (as an AMP unscale does): read again
            model[0].weight.grad.mul_(2.0)
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for r, p in zip(ref, params):
            r.grad = p.grad.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 0.05)
        covered = sum(agent.grad_sq_norms([p.grad for p in params])[1])
        got = clip_grad_norm(params, 0.05, agent)
        assert covered == (1, 0, 2)[step]  # the weights, on reporting steps (step 0: one changed since its row)
        if step == 2:
            assert torch.isnan(got)
        else:
            assert abs(float(got) - float(want)) <= 1e-6 * float(want)
            for r, p in zip(ref, params):
                assert torch.allclose(p.grad, r.grad, rtol=1e-6, atol=0)
        agent.log(step)
    agent.close()
    assert agent.errors == 0, agent.last_error
