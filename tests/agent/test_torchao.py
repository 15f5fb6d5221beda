"""torchao float8 training (``convert_to_float8_training``) under the agent: every site's underflow, overflow and scale
are those of the casts torchao's Float8Linear really does, captured from the layer itself during the step (each cast's
float8 bits and scale) and compared with the rows the agent ships."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from fp8mon.agent import Agent
from fp8mon.agent.formats import E4M3, by_name
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.transport import NullTransport
from fp8mon.agent.wire import SITES

float8 = pytest.importorskip("torchao.float8")
float8_linear = pytest.importorskip("torchao.float8.float8_linear")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402

from fp8mon.agent import torchao_sites  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DIMS = (32, 64, 48, 16)  # distinct in and out features: a cast's tensor shape tells its layer
LAYERS = ("0", "2", "4")
OPERANDS = {GemmInputRole.INPUT: "input", GemmInputRole.WEIGHT: "weight", GemmInputRole.GRAD_OUTPUT: "grad_output"}


def _model(recipe: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2], bias=False), nn.ReLU(),
                          nn.Linear(DIMS[2], DIMS[3]))
    with torch.no_grad():  # output features of very different magnitudes: per-tensor casts flush the small ones
        model[2].weight[: DIMS[2] // 2] *= 2.0**-20
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    assert all(type(model[int(i)]) is float8_linear.Float8Linear for i in LAYERS)
    return model


def _binades(shape, lo: float, hi: float, seed: int) -> torch.Tensor:
    """Random signs and mantissas in [0.5, 1) times 2**-k, k uniform in [lo, hi] per element."""
    g = torch.Generator().manual_seed(seed)
    mag = (torch.rand(shape, generator=g) * 0.5 + 0.5) * torch.exp2(-(lo + (hi - lo) * torch.rand(shape, generator=g)))
    return torch.where(torch.rand(shape, generator=g) < 0.5, -mag, mag)


def _rows_apart(batch: int, tokens: int, features: int, seed: int) -> torch.Tensor:
    """Rows (tokens) whose magnitudes lie 2**0 .. 2**-30 apart: one scale for the tensor flushes the small rows."""
    x = _binades((batch, tokens, features), 0, 1, seed)
    return x * torch.exp2(-torch.linspace(0, 30, batch * tokens)).reshape(batch, tokens, 1)


class _CastSpy:
    """Every cast that torchao's Float8Linear does (``hp_tensor_to_float8_dynamic``): operand, its high-precision
    tensor, the float8 bits and the scale, attributed to a layer by the tensor's shape."""

    def __init__(self, monkeypatch):
        self.casts: list[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = float8_linear.hp_tensor_to_float8_dynamic

        def spy(hp, dtype, *args, **kwargs):
            out = real(hp, dtype, *args, **kwargs)
            operand = OPERANDS[kwargs["gemm_input_role"]]
            self.casts.append((self._layer(operand, hp), operand, hp.detach().clone(), out._data.clone(),
                               out._scale.clone()))
            return out

        monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", spy)

    @staticmethod
    def _layer(operand: str, hp: torch.Tensor) -> str:
        if operand == "weight":  # weight.t(): [in, out]
            return LAYERS[DIMS.index(hp.shape[0])]
        return LAYERS[DIMS.index(hp.shape[-1]) - (operand == "grad_output")]

    def oracle(self, layer: str, operand: str, fmt) -> tuple[int, int, int, float]:
        """(underflow, overflow, nonzero, smallest scale) of ``layer``'s casts of ``operand`` in one micro-batch:
        an element counts once when any of its casts flushes it to zero (underflow) or saturates it (overflow)."""
        casts = [c for c in self.casts if c[:2] == (layer, operand)]
        assert casts, f"torchao cast nothing for {layer} {operand}"
        canon = (lambda t: t.t()) if operand == "weight" else (lambda t: t.reshape(-1, t.shape[-1]))
        x = canon(casts[0][2]).float()
        nonzero = (x != 0) & x.isfinite()
        under = torch.zeros_like(nonzero)
        over = torch.zeros_like(nonzero)
        for _, _, hp, bits, scale in casts:
            assert bits.dtype == fmt.dtype, f"{layer} {operand}: torchao casts to {bits.dtype}, the agent says {fmt}"
            under |= canon(bits).float() == 0
            over |= canon((hp.float() * scale).abs()) > fmt.overflow_threshold
        smallest = min(float(c[4].min()) for c in casts)
        return int((under & nonzero).sum()), int(over.sum()), int(nonzero.sum()), smallest


def _step(model, inputs, grad_of_output, spy=None, backend="torch"):
    """One training step of micro-batches ``inputs`` under an agent: {(layer, site): the row it ships}, and with a
    ``spy`` the casts of each micro-batch. d(loss)/d(output of the last layer) is ``grad_of_output``."""
    agent = Agent(transport=NullTransport(), every=1, stats_backend=backend).watch(model)
    shipped = []
    agent._ship = lambda step, rows, values: shipped.append(rows.clone())
    per_micro = []
    for x in inputs:
        if spy is not None:
            spy.casts.clear()
        (model(x) * grad_of_output).sum().backward()
        if spy is not None:
            per_micro.append(list(spy.casts))
    agent.log(0)
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0, agent.last_error
    rows = dict(zip(keys, shipped[0]))
    return rows if spy is None else (rows, per_micro)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_site_is_torchaos_cast(recipe, monkeypatch):
    """Two micro-batches of one step: each site's underflow, overflow and smallest scale equal what torchao's casts of
    that tensor lost, summed over the micro-batches (the weight: read once per step); output and grad_weight, which
    torchao never casts to FP8, carry no format."""
    model = _model(recipe)
    spy = _CastSpy(monkeypatch)
    inputs = [_rows_apart(2, 8, DIMS[0], seed) for seed in (1, 2)]
    grad = _rows_apart(2, 8, DIMS[-1], 3)
    rows, per_micro = _step(model, inputs, grad, spy=spy)
    casts = torchao_sites.site_casts(model[0])
    assert set(rows) == {(layer, site) for layer in LAYERS for site in SITES}
    flushed = 0
    for layer in LAYERS:
        for site in ("input", "weight", "grad_output"):
            fmt = casts[site].fmt
            want = [0, 0, 0, float("inf")]
            for casts_of_micro in per_micro[:1] if site == "weight" else per_micro:
                spy.casts = casts_of_micro
                u, o, nz, s = spy.oracle(layer, site, fmt)
                want = [want[0] + u, want[1] + o, want[2] + nz, min(want[3], s)]
            row = rows[(layer, site)]
            got = [int(row[ds.UNDERFLOW]), int(row[ds.OVERFLOW]), int(row[ds.NONZERO]), float(row[ds.SCALE])]
            assert got == want, f"{recipe} {layer} {site}: agent {got}, torchao's casts {want}"
            flushed += want[0]
        for site in ("output", "grad_weight"):
            row = rows[(layer, site)]
            assert row[ds.UNDERFLOW].isnan() and row[ds.SCALE].isnan() and row[ds.N] > 0, (layer, site)
    assert flushed > 0  # the data makes some cast of every recipe flush


def test_formats_and_granularity_follow_the_recipe():
    """The FP8 format and the casts of each site, from the layer's Float8LinearConfig."""
    want = {
        "tensorwise": {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"},
        "rowwise": {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
        "rowwise_with_gw_hp": {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
    }
    for recipe, formats in want.items():
        layer = _model(recipe)[0]
        casts = torchao_sites.site_casts(layer)
        assert {s: c.fmt.name for s, c in casts.items() if c.fmt is not None} == formats, recipe
        assert casts["output"].fmt is None and casts["grad_weight"].fmt is None
        text = torchao_sites.describe(layer)
        assert text["output"].startswith("not cast") and text["grad_weight"].startswith("not cast")
        if recipe == "tensorwise":
            assert text["grad_output"] == "e5m2: tensorwise (grad_input GEMM), tensorwise (grad_weight GEMM)"
            assert len(casts["input"].casts) == 1  # both GEMMs cast the input alike: one scale
        if recipe == "rowwise_with_gw_hp":
            assert text["input"].startswith("e4m3: rowwise (output GEMM), high precision (grad_weight GEMM)")
            assert text["weight"].startswith("e4m3: rowwise (output GEMM), tensorwise (grad_input GEMM)")
    assert torchao_sites.site_casts(nn.Linear(16, 16)) == {} and torchao_sites.describe(nn.Linear(16, 16)) == {}


def test_rowwise_does_not_report_the_per_tensor_flush():
    """Tokens and features of very different magnitudes (2**0 .. 2**-14 each): one scale for the whole tensor flushes
    about a third of it, rowwise scales (per token for the forward GEMM, per feature for grad_weight's) flush nothing.
    The agent's per-tensor emulation reported the former for torchao's rowwise layers; it reports what torchao does."""
    tokens = torch.exp2(-torch.linspace(0, 14, 64)).reshape(4, 16, 1)
    features = torch.exp2(-torch.linspace(0, 14, DIMS[0]))
    x = _binades((4, 16, DIMS[0]), 0, 1, 5) * tokens * features
    per_tensor = ds.partials(x, fmt=E4M3)
    assert per_tensor[ds.UNDERFLOW] / per_tensor[ds.NONZERO] > 0.2
    grad = _binades((4, 16, DIMS[-1]), 0, 1, 6)

    rowwise = _step(_model("rowwise"), [x], grad)[("0", "input")]
    assert int(rowwise[ds.UNDERFLOW]) == 0 and int(rowwise[ds.NONZERO]) == x.numel()
    tensorwise = _step(_model("tensorwise"), [x], grad)[("0", "input")]
    assert int(tensorwise[ds.UNDERFLOW]) == int(per_tensor[ds.UNDERFLOW])  # there the flush is real


def test_rowwise_input_flushes_in_grad_weights_gemm_only():
    """Rows of very different magnitudes: rowwise scales keep them in the forward GEMM, but grad_weight's GEMM casts
    the input per feature, across the rows, and flushes the small ones; rowwise_with_gw_hp runs that GEMM in high
    precision and loses nothing."""
    x = _rows_apart(2, 8, DIMS[0], 7)
    grad = _binades((2, 8, DIMS[-1]), 0, 1, 8)
    rowwise = _step(_model("rowwise"), [x], grad)[("0", "input")]
    hp = _step(_model("rowwise_with_gw_hp"), [x], grad)[("0", "input")]
    from torchao.float8.float8_utils import tensor_to_scale

    flat = x.reshape(-1, DIMS[0])
    scale = tensor_to_scale(flat, torch.float8_e4m3fn, scaling_granularity=float8.ScalingGranularity.AXISWISE,
                            axiswise_dim=0, round_scales_to_power_of_2=True)
    flushed = int(((flat * scale).to(torch.float8_e4m3fn).float() == 0).sum())
    assert flushed > x.numel() // 5
    assert int(rowwise[ds.UNDERFLOW]) == flushed
    assert int(hp[ds.UNDERFLOW]) == 0


def test_agent_without_torchao_imports_none():
    """Watching a plain model does not import torchao (the agent works without it)."""
    code = ("import sys, torch\nfrom fp8mon.agent import Agent\nfrom fp8mon.agent.transport import NullTransport\n"
            "a = Agent(transport=NullTransport()).watch(torch.nn.Linear(4, 4))\nx = a._sink.casts\na.close()\n"
            "assert 'torchao' not in sys.modules and not x, sorted(m for m in sys.modules if 'torchao' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_per_row_scales_in_the_torch_path():
    """``partials`` with per-row scales, and with the scales of two casts: counts as the casts themselves do."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, 32, generator=g) * torch.exp2(-torch.linspace(0, 24, 16)).unsqueeze(1)
    fmt = by_name("e4m3")
    rows = E4M3.max / x.abs().amax(1, keepdim=True)
    cols = (E4M3.max / x.abs().amax(0, keepdim=True)) * 4  # 4x too large: some saturate
    cast = lambda s: (x * s).clamp(-fmt.max, fmt.max).to(fmt.dtype).float()  # noqa: E731
    row = ds.partials(x, fmt=fmt, scale=rows)
    assert int(row[ds.UNDERFLOW]) == int((cast(rows) == 0).sum()) == 0
    assert float(row[ds.SCALE]) == float(rows.min())
    both = ds.partials(x, fmt=fmt, scale=[rows, cols])
    lost = (cast(rows) == 0) | (cast(cols) == 0)
    assert int(both[ds.UNDERFLOW]) == int(lost.sum()) > 0
    assert int(both[ds.OVERFLOW]) == int(((x * cols).abs() > fmt.overflow_threshold).sum()) > 0
    with pytest.raises(ValueError, match="broadcast"):
        ds.partials(x, fmt=fmt, scale=rows.t())


def test_the_agent_adds_no_host_sync():
    """A rowwise step with the agent runs many more ops than without, and not one more that would make a CUDA host
    wait (torchao's scales and the per-row statistics stay on the device)."""
    from test_device_stats import OpRecorder

    def run(with_agent: bool) -> OpRecorder:
        model = _model("rowwise")
        agent = Agent(transport=NullTransport(), stats_backend="torch").watch(model) if with_agent else None
        rec = OpRecorder()
        with rec:
            (model(_rows_apart(2, 8, DIMS[0], 1)) * _rows_apart(2, 8, DIMS[-1], 2)).sum().backward()
            if agent is not None:
                agent.log(0)
        if agent is not None:
            agent.close()
            assert agent.errors == 0, agent.last_error
        return rec

    base, watched = run(False), run(True)
    assert len(watched.ops) > len(base.ops) + 200
    assert watched.syncs() == base.syncs()


def _triton_vs_torch_path() -> str:
    """In a worker whose Triton kernels run interpreted: the rows of a step on the Triton backend vs the torch backend,
    '' or what differs. Tensorwise: every site in the kernels, with torchao's scale; rowwise: output and grad_weight
    in the kernels, the per-row sites on the torch path, in the same hook calls."""
    from rowcheck import row_problems

    problems = []
    for recipe in ("tensorwise", "rowwise"):
        tri, tor = (torch.stack(list(_step(_model(recipe), [_rows_apart(2, 8, DIMS[0], 1)],
                                           _rows_apart(2, 8, DIMS[-1], 2), backend=backend).values()))
                    for backend in ("triton", "torch"))  # (_step fails on an agent error)
        # the Triton path counts no outlier before a step's center exists: the rows it took have none
        took = (tri[:, ds.OUTLIERS] == 0) & (tor[:, ds.OUTLIERS] > 0)
        if int(took.sum()) < (6 if recipe == "tensorwise" else 3):
            problems.append(f"{recipe}: the Triton path took {int(took.sum())} rows with outliers")
        kept = (tri[:, ds.OUTLIERS] == tor[:, ds.OUTLIERS]) & (tor[:, ds.OUTLIERS] > 0)  # the torch path's rows
        if int(kept.sum()) < (0 if recipe == "tensorwise" else 3):
            problems.append(f"{recipe}: the torch path took {int(kept.sum())} rows with outliers")
        tri[:, ds.OUTLIERS] = tor[:, ds.OUTLIERS] = 0
        # underflow exactly: every cast site has a given scale (the kernel derives it from the histogram only under
        # the agent's own current scaling, which no site of a Float8Linear uses)
        problem = row_problems(tri, tor, rtol=1e-5)  # fp32 sums in another order
        if problem:
            problems.append(f"{recipe}: {problem}")
    return "\n".join(problems)


@pytest.mark.timeout(120)
def test_triton_backend_takes_the_same_casts():
    """On the Triton backend (CUDA; here Triton's interpreter), tensorwise sites go to its kernels with torchao's scale,
    rowwise ones to the torch path: the rows equal the torch backend's."""
    import multiprocessing
    import os

    from test_triton_stats import _interpreter_runs_our_kernels

    _interpreter_runs_our_kernels()
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the worker, before it defines the kernels
    try:
        pool = multiprocessing.get_context("spawn").Pool(1)
    finally:
        del os.environ["TRITON_INTERPRET"]
    try:
        assert pool.apply(_triton_vs_torch_path) == ""
    finally:
        pool.terminate()
        pool.join()
