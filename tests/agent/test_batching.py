"""The hooks' tensors share statistics launches (agent/batching.py): rows as the model left each tensor when its hook
saw it, whatever the training loop does to it before the step ends."""

import math

import pytest
import torch
from torch import nn

from fp8mon.agent import Agent
from fp8mon.agent.batching import MAX_ITEMS
from fp8mon.agent.stats import launch as ts
from tests.agent.capture import CaptureTransport, rows_counting


@pytest.fixture
def launches(monkeypatch):
    """``stats.launch.rows`` replaced by the torch path, as if on a GPU; the tensors of each launch, in order."""
    calls = []
    monkeypatch.setattr(ts, "rows", rows_counting(calls))
    return calls

def _agent(model, **kw):
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=1, **kw).watch(model)
    agent._sink._triton_for = lambda x: True
    return agent, cap


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def test_a_steps_tensors_go_out_in_few_launches(launches):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(10)])
    agent, cap = _agent(model)
    model(torch.randn(4, 8)).sum().backward()
    agent.log(0)
    agent.close()
    assert agent.errors == 0
    assert sum(launches) == 10 * 5 and len(launches) == -(-50 // MAX_ITEMS)
    assert len(cap.records()) == 50


def test_an_output_changed_in_place_loses_one_row_loudly_then_is_read_right_after_the_layer(launches):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    seen = []
    model[0].register_forward_hook(lambda m, a, y: seen.append(y.detach().clone()))
    agent, cap = _agent(model, sites=("output",))
    for step in range(2):
        model(torch.randn(32, 8)).sum().backward()
        agent.log(step)
    agent.close()
    records = cap.records()
    assert agent.errors == 1 and "changed in place" in agent.last_error
    assert (0, "0", "output", 0) not in records and (0, "2", "output", 0) in records
    assert math.isclose(records[(1, "0", "output", 0)]["rms"], _rms(seen[1]), rel_tol=1e-9)


def test_gradients_and_weights_changed_before_log_are_read_as_the_backward_left_them(launches):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    agent, cap = _agent(model, sites=("weight", "grad_weight"))
    model(torch.randn(16, 8)).pow(2).sum().backward()
    grads = [m.weight.grad.clone() for m in model]
    weights = [m.weight.detach().clone() for m in model]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # in place
    opt.step()  # in place
    agent.log(0)
    agent.close()
    records = cap.records()
    assert agent.errors == 0
    for i in range(2):
        assert math.isclose(records[(0, str(i), "grad_weight", 0)]["rms"], _rms(grads[i]), rel_tol=1e-9)
        assert math.isclose(records[(0, str(i), "weight", 0)]["rms"], _rms(weights[i]), rel_tol=1e-9)


def test_a_compiled_graphs_tensors_wait_as_copies(launches):
    """A compiled graph may reuse a tensor's memory right after handing it over, without a version change."""
    model = nn.Linear(8, 8)
    agent, cap = _agent(model, sites=("output",))
    y = torch.randn(16, 8)
    want = _rms(y)
    with agent._sink.waiting.copies():
        agent._sink.observe("Linear", "output", y)
    y.data.zero_()  # reused memory: y's version counter does not change
    agent.log(0)
    agent.close()
    assert launches == [1] and agent.errors == 0
    assert math.isclose(cap.records()[(0, "Linear", "output", 0)]["rms"], want, rel_tol=1e-9)


def test_a_large_tensor_of_a_compiled_graph_is_read_at_once_not_copied(launches, monkeypatch):
    from fp8mon.agent import batching

    monkeypatch.setattr(batching, "MAX_COPY_BYTES", 16 * 8 * 4 - 1)
    model = nn.Linear(8, 8)
    agent, cap = _agent(model, sites=("output",))
    y = torch.randn(16, 8)
    with agent._sink.waiting.copies():
        agent._sink.observe("Linear", "output", y)
    assert launches == [1]  # at once
    agent.log(0)
    agent.close()
    assert math.isclose(cap.records()[(0, "Linear", "output", 0)]["rms"], _rms(y), rel_tol=1e-9)


def test_rows_with_their_layers_cast_scale_wait_and_a_changed_scale_loses_its_row(launches):
    """A layer's own FP8 cast (torchao's) gives its row a scale: the row still waits for a shared launch, with that
    scale tensor; a scale changed in place before the launch loses the row loudly, as a changed tensor does."""
    from fp8mon.agent.formats import E4M3

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    agent, cap = _agent(model, sites=("input",))
    scales = {name: torch.tensor(1.0) for name in ("0", "1", "2", "3")}
    for name, scale in scales.items():
        agent._sink.casts[(name, "input")] = lambda x, s=scale: (x, E4M3, s)
    model(torch.randn(16, 8)).sum().backward()
    agent.log(0)
    agent.flush(timeout=30)
    assert launches == [4] and agent.errors == 0 and len(cap.records()) == 4
    model[3].register_forward_hook(lambda m, a, y: scales["1"].mul_(2.0) and None)
    model(torch.randn(16, 8)).sum().backward()
    agent.log(1)
    agent.close()
    assert agent.errors == 1 and "changed in place" in agent.last_error
    assert (1, "1", "input", 0) not in cap.records() and (1, "2", "input", 0) in cap.records()
