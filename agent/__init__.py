"""fp8mon's in-trainer agent: ``from fp8mon import Agent``.

Imported lazily, so that ``agent.wire`` (the wire contract the monitor shares) does not pull in torch.
"""

__all__ = ["Agent"]


def __getattr__(name):
    if name == "Agent":
        from .core import Agent

        return Agent
    raise AttributeError(f"module 'fp8mon.agent' has no attribute {name!r}")
