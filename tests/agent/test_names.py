"""Layer names are the user's module names whatever wrapper surrounds the modules (DDP and FSDP1 on two ranks:
tests/agent/test_sharded.py)."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fp8mon.agent import Agent
from fp8mon.agent.hooks import select_modules
from tests.agent.capture import CaptureTransport


class Block(nn.Module):
    """A user's block whose own submodule is called ``module``: that name is the user's and stays."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.module(x))


def names(model, pattern=None, prefix=""):
    return [name for name, _ in select_modules(model, pattern, prefix)]


def test_wrappers_leave_no_trace_in_the_names():
    model = nn.Sequential(Block(), nn.Linear(4, 2))
    plain = ["0.module", "0.out", "1"]
    assert names(model) == plain
    assert names(nn.DataParallel(model)) == plain
    assert names(torch.compile(model)) == plain
    wrapped = nn.Sequential(checkpoint_wrapper(Block()), nn.Linear(4, 2))
    assert [n for n, _ in wrapped.named_modules()][2] == "0._checkpoint_wrapped_module"
    assert names(wrapped) == plain
    assert names(torch.compile(nn.DataParallel(wrapped)), prefix="lm.") == ["lm." + n for n in plain]


def test_the_module_pattern_matches_the_users_names():
    model = torch.compile(nn.DataParallel(nn.Sequential(Block(), nn.Linear(4, 2))))
    assert names(model, r"^0\.") == ["0.module", "0.out"]
    assert names(model, "_orig_mod") == []


def test_two_layers_with_one_name_are_an_error():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(2, 2))
    model.add_module("_checkpoint_wrapped_module", nn.Sequential())
    model._checkpoint_wrapped_module.add_module("a", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'a' and '_checkpoint_wrapped_module.a' both have the layer name 'a'"):
        Agent(transport=CaptureTransport()).watch(model)


def test_a_compiled_model_reports_under_the_users_names():
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    cap = CaptureTransport()
    agent = Agent(transport=cap, sites=["weight"]).watch(torch.compile(model, backend="eager"))
    model(torch.randn(2, 4)).sum().backward()
    agent.log(0)
    agent.close()
    assert agent.errors == 0
    assert {layer for _, layer, _, _ in cap.records()} == {"0", "2"}


def test_a_bare_linear_is_named_by_its_class():
    from fp8mon.agent.hooks import select_modules

    assert [name for name, _ in select_modules(nn.Linear(2, 2), None)] == ["Linear"]
    assert [name for name, _ in select_modules(nn.Linear(2, 2), None, prefix="head")] == ["head"]
