"""The agent on models run under the real ``torch.compile`` (Inductor, on CPU): every site of every watched linear on
reporting steps, rows equal to the eager agent's, no graph break of the agent's, two compiled variants, and after
``close`` the graph without statistics. Each scenario compiles once (module-scoped) and records what the tests check.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx

from fp8mon.agent import Agent, compiled
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.transport import NullTransport
from fp8mon.agent.wire import SITES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 9
LINEARS = ("blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, 16)

    def forward(self, x):
        return self.head(self.blocks(x))


class Deep(nn.Module):
    def __init__(self, d=32, blocks=3):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(blocks)))

    def forward(self, x):
        return self.blocks(x)


class Inductor:
    """Inductor, counting the graphs Dynamo hands it."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)


def batch(step):
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(step))


def train(model, agent, steps):
    """Two micro-batches a step: a forward's saved tensors must outlive the next forward."""
    for step in steps:
        model.zero_grad(set_to_none=True)
        for micro in range(2):  # no optimizer: a step's rows depend on its batches alone
            model(batch(2 * step + micro)).square().mean().backward()
        agent.log(step)


def new_agent(every, hist_every):
    agent = Agent(transport=NullTransport(), every=every, hist_every=hist_every)
    agent.shipped = {}
    agent._ship = lambda step, rows, values: agent.shipped.__setitem__(step, None if rows is None else rows.clone())
    return agent


@dataclass
class Scenario:
    shipped: dict
    keys: list
    every: int
    hist_every: int
    graphs: list  # compiled after the agent's watch
    breaks: dict
    errors: int
    graphs_after_close: int = 0
    ops_after_close: int = 0


def run_scenario(base, compile_model, *, watch_first, every, hist_every=1):
    """Train under an agent watching before compiling, or after compiling and running a step (the graph compiled
    then knows no hook), then close it and run a few more steps."""
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(base)
    backend = Inductor()
    agent = new_agent(every, hist_every)
    if watch_first:
        agent.watch(model)
    target = compile_model(model, backend)
    if not watch_first:
        target(batch(100)).square().mean().backward()
        agent.watch(target)
    before = len(backend.graphs)
    train(target, agent, range(STEPS))
    keys = list(agent._slots.keys)
    agent.close()
    out = Scenario(agent.shipped, keys, every, hist_every, backend.graphs[before:], dict(counters["graph_break"]),
                   agent.errors)
    calls = []
    real = compiled._layer
    compiled._layer = lambda ident: calls.append(ident) or real(ident)
    try:
        for step in range(STEPS, STEPS + 3):
            target.zero_grad(set_to_none=True)
            target(batch(step)).square().mean().backward()
    finally:
        compiled._layer = real
    out.graphs_after_close, out.ops_after_close = len(backend.graphs) - before, len(calls)
    return out


def wrapper(model, backend):
    return torch.compile(model, backend=backend)


def in_place(model, backend):
    model.compile(backend=backend)
    return model


@pytest.fixture(scope="module", autouse=True)
def inductor_in_process():
    """Inductor compiles its kernels in this process: a worker pool costs more than it saves on two busy cores."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="module")
def eager(base):
    """The eager agent's rows of every step (every=1, histogram always), on the same weights and batches."""
    model = copy.deepcopy(base)
    agent = new_agent(1, 1).watch(model)
    train(model, agent, range(STEPS))
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0, agent.last_error
    return agent.shipped, keys


@pytest.fixture(scope="module")
def after_wrapper(base):
    return run_scenario(base, wrapper, watch_first=False, every=2, hist_every=2)


@pytest.fixture(scope="module")
def before_in_place(base):
    return run_scenario(base, in_place, watch_first=True, every=3)


def fp8mon_ops(gm) -> int:
    return sum(1 for n in gm.graph.nodes if "fp8mon" in str(n.target))


def rows_problems(got: torch.Tensor, want: torch.Tensor, keys, hist: bool) -> list[str]:
    """Counts exact; amax and scale to 1e-5; moments to 1e-4 of the data's scale; outliers, underflow, overflow and
    each histogram bin within 2 elements (Inductor's fused kernels round a little differently from eager's)."""
    bad = []
    for (layer, site), a, b in zip(keys, got, want):
        where = f"{layer}/{site}"
        for i in (ds.PARTS, ds.NUMEL, ds.N, ds.NONFINITE, ds.ZEROS, ds.NONZERO):
            if a[i] != b[i]:
                bad.append(f"{where} {ds.FIELDS[i]} {a[i].item()} vs {b[i].item()}")
        for i in (ds.AMAX, ds.SCALE):
            if not torch.allclose(a[i], b[i], rtol=1e-5, atol=0, equal_nan=True):
                bad.append(f"{where} {ds.FIELDS[i]} {a[i].item()} vs {b[i].item()}")
        n = b[ds.N].clamp(min=1)
        sd = (b[ds.M2] / n).sqrt()
        scale = b[ds.MEAN].abs() + sd
        tol = {ds.MEAN: scale, ds.M2: b[ds.M2].abs(), ds.M3: n * sd**3, ds.M4: b[ds.M4].abs()}
        for i, t in tol.items():
            if (a[i] - b[i]).abs() > 1e-4 * t + 1e-300:
                bad.append(f"{where} {ds.FIELDS[i]} {a[i].item()} vs {b[i].item()}")
        for i in (ds.OUTLIERS, ds.UNDERFLOW, ds.OVERFLOW):
            if not (torch.isnan(a[i]) & torch.isnan(b[i])) and not (a[i] - b[i]).abs() <= 2:
                bad.append(f"{where} {ds.FIELDS[i]} {a[i].item()} vs {b[i].item()}")
        if hist and not ((a[ds.HIST:] - b[ds.HIST:]).abs() <= 2).all():
            bad.append(f"{where} hist")
        if not hist and not a[ds.HIST:].isnan().all():
            bad.append(f"{where} a histogram on a step without one")
    return bad


def check_rows(scenario: Scenario, eager) -> None:
    want_rows, want_keys = eager
    assert scenario.errors == 0
    assert scenario.keys == want_keys == [(layer, site) for layer in LINEARS for site in SITES]
    reporting = [s for s in range(STEPS) if s % scenario.every == 0]
    assert [s for s, r in scenario.shipped.items() if r is not None] == reporting
    for step in reporting:
        rows = scenario.shipped[step]
        once = torch.tensor([site in ("weight", "grad_weight") for _, site in scenario.keys])
        assert rows[:, ds.PARTS].tolist() == torch.where(once, 1.0, 2.0).tolist(), f"step {step}: rows missing"
        hist = step % (scenario.every * scenario.hist_every) == 0
        problems = rows_problems(rows, want_rows[step], scenario.keys, hist)
        assert not problems, f"step {step}: {problems[:6]}"
        # the same tensors as in eager mode, bit for bit: the weights (the rest went through Inductor's kernels)
        for i, key in enumerate(scenario.keys):
            if key[1] == "weight":
                end = ds.WIDTH if hist else ds.HIST
                assert torch.equal(rows[i, :end].nan_to_num(-1), want_rows[step][i, :end].nan_to_num(-1)), key


def test_watching_a_compiled_model_already_run_records_every_site_as_the_eager_agent_does(after_wrapper, eager):
    check_rows(after_wrapper, eager)


def test_watching_before_compiling_in_place_records_every_site_as_the_eager_agent_does(before_in_place, eager):
    check_rows(before_in_place, eager)


@pytest.mark.parametrize("name", ["after_wrapper", "before_in_place"])
def test_no_graph_break_and_two_compiled_variants_one_with_the_statistics(name, request):
    scenario = request.getfixturevalue(name)
    assert scenario.breaks == {}
    assert len(scenario.graphs) == 2  # reporting or not, over 9 steps (with and without the histogram)
    assert sorted(fp8mon_ops(gm) for gm in scenario.graphs) == [0, len(LINEARS)]


@pytest.mark.parametrize("name", ["after_wrapper", "before_in_place"])
def test_after_close_the_model_runs_the_graph_without_statistics(name, request, base):
    scenario = request.getfixturevalue(name)
    assert scenario.graphs_after_close == len(scenario.graphs)  # no recompile
    assert scenario.ops_after_close == 0
    plain = next(gm for gm in scenario.graphs if not fp8mon_ops(gm))
    # the same ops as the model compiled without an agent
    torch._dynamo.reset()
    backend = Inductor()
    torch.compile(copy.deepcopy(base), backend=backend)(batch(0))
    assert [n.target for n in plain.graph.nodes if n.op == "call_function"] == \
        [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"]


def test_max_autotune_records_every_site_without_a_graph_break(base, eager):
    torch._dynamo.reset()
    counters.clear()
    target = torch.compile(copy.deepcopy(base), mode="max-autotune-no-cudagraphs")
    agent = new_agent(1, 1).watch(target)
    train(target, agent, range(2))
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0
    assert dict(counters["graph_break"]) == {}
    for step in range(2):
        problems = rows_problems(agent.shipped[step], eager[0][step], keys, hist=True)
        assert not problems, f"step {step}: {problems[:6]}"


def test_blocks_compiled_one_by_one_share_their_two_variants():
    """Blocks compiled apart (as with FSDP2): one compiled frame serves all blocks of a kind, with the agent too, and a
    block's backward runs after the next blocks' forwards."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(1)
    model = Deep()
    backend = Inductor()
    agent = new_agent(2, 1).watch(model)
    for block in model.blocks:
        block.compile(backend=backend)
    train(model, agent, range(4))
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0 and dict(counters["graph_break"]) == {}
    # the first block's input does not require grad, the others' does: two frames, each with and without statistics
    assert len(backend.graphs) == 4
    once = torch.tensor([site in ("weight", "grad_weight") for _, site in keys])
    for step in (0, 2):
        assert agent.shipped[step][:, ds.PARTS].tolist() == torch.where(once, 1.0, 2.0).tolist()


def blockwise(agent_kw, steps=4, patch=None):
    """A seeded Deep model, blocks compiled one by one, trained under an agent watching it before."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(2)
    model = Deep()
    backend = Inductor()
    agent = Agent(transport=NullTransport(), **agent_kw)
    agent.shipped = {}
    agent._ship = lambda step, rows, values: agent.shipped.__setitem__(step, None if rows is None else rows.clone())
    agent.watch(model)
    for block in model.blocks:
        block.compile(backend=backend)
    train(model, agent, range(steps))
    keys = list(agent._slots.keys)
    agent.close()
    return agent, keys, backend.graphs


def test_delayed_scaling_under_compile_keeps_the_amax_history_as_in_eager_mode():
    kw = dict(every=2, hist_every=1, scaling="delayed", amax_history_len=4)
    agent, keys, graphs = blockwise(kw)
    assert agent.errors == 0
    assert len(graphs) == 2  # every step observes (the history): one variant per frame
    torch.manual_seed(2)
    model = Deep()
    eager = Agent(transport=NullTransport(), **kw)
    eager.shipped = {}
    eager._ship = lambda step, rows, values: eager.shipped.__setitem__(step, None if rows is None else rows.clone())
    train(model, eager.watch(model), range(4))
    eager.close()
    for step in (0, 2):
        problems = rows_problems(agent.shipped[step], eager.shipped[step], keys, hist=True)
        assert not problems, f"step {step}: {problems[:6]}"
    scales = agent.shipped[2][:, ds.SCALE]
    assert scales.isfinite().any()  # step 2's inputs are scaled from the history of steps 0 and 1


def test_a_failing_statistic_inside_the_compiled_graph_is_counted_and_training_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("statistics exploded")

    monkeypatch.setattr(ds, "partials", broken)
    agent, keys, _ = blockwise(dict(every=1, hist_every=1), steps=2)
    # every site of every layer in each micro-batch of each step (the gradient after each backward), the weight once
    per_step = sum(1 if site == "weight" else 2 for _, site in keys)
    assert agent.errors == 2 * per_step
    assert "statistics exploded" in agent.last_error
