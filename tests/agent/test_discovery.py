"""``Agent.watch`` on a model where it finds no layer to watch: a warning that says why, and no error."""

import logging

import pytest
from torch import nn
from transformers import GPT2Config, GPT2Model

from fp8mon.agent import Agent
from fp8mon.agent.transport import NullTransport


def watch(model, caplog, **kw) -> Agent:
    agent = Agent(transport=NullTransport(), **kw)
    with caplog.at_level(logging.WARNING, logger="fp8mon.agent"):
        agent.watch(model)
    agent.close()
    assert agent.errors == 0, agent.last_error
    return agent


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "fp8mon.agent"]


def test_a_regex_that_matches_no_linear_names_them(caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    agent = Agent(transport=NullTransport(), modules=r"^blocks\.")
    with caplog.at_level(logging.WARNING, logger="fp8mon.agent"):
        agent.watch(model, prefix="mlp.")  # the regex is searched in the prefixed names
    agent.close()
    (message,) = warnings_of(caplog)
    assert r"modules=r'^blocks\.' matched none of the model's 2 nn.Linear layers (mlp.0, mlp.2)" in message
    assert agent.errors == 0


def test_linear_like_layers_of_other_classes_are_listed(caplog):
    # GPT-2's projections are transformers' Conv1D (a linear layer with a transposed weight), not nn.Linear
    gpt2 = GPT2Model(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16))
    watch(nn.ModuleDict({"gpt2": gpt2, "mix": nn.Bilinear(4, 4, 4)}), caplog)
    (message,) = warnings_of(caplog)
    assert "has no nn.Linear layer" in message
    assert "Conv1D ×8, Bilinear ×1" in message and "Embedding" not in message and "LayerNorm" not in message


@pytest.mark.parametrize("model", [nn.Sequential(nn.Conv2d(1, 2, 3), nn.Embedding(5, 3)), nn.Module()],
                         ids=["convolution", "empty"])
def test_a_model_without_linear_layers_says_so(model, caplog):
    watch(model, caplog)
    (message,) = warnings_of(caplog)
    assert message.endswith("has no nn.Linear layer")


def test_no_warning_when_something_is_watched(caplog):
    watch(nn.Sequential(nn.Linear(4, 4)), caplog, modules="0")
    assert warnings_of(caplog) == []
