"""What the callbacks share: the Agent a callback makes (or is given) and watches the model with, its run name and
metadata, closing it once (also at interpreter exit, as "failed", where the framework never says that training
stopped), and the agent rule for the callbacks' own code: an exception is logged once and counted in
``agent.errors``, training goes on."""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import re
import weakref

from fp8mon.agent.wire import MAX_RUN_NAME

log = logging.getLogger("fp8mon.integrations")

_NOT_IN_RUN_NAMES = re.compile(r"[^A-Za-z0-9._:@+/=-]+")


def run_name(*candidates) -> str | None:
    """The first non-empty candidate, made a valid run name (other characters become "-")."""
    for candidate in candidates:
        if candidate is None:
            continue
        name = _NOT_IN_RUN_NAMES.sub("-", str(candidate)).lstrip("._:@+/=-")[:MAX_RUN_NAME]
        if name:
            return name
    return None


def _json_value(value):
    """``value`` if JSON holds it as it is (lists and dicts filtered likewise), else ``_DROP``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _DROP
    if isinstance(value, (list, tuple)):
        return [v for v in (_json_value(x) for x in value) if v is not _DROP]
    if isinstance(value, dict):
        return json_safe(value)
    return _DROP


_DROP = object()


def json_safe(mapping) -> dict:
    """The entries of ``mapping`` with string keys whose values JSON holds as they are."""
    out = {}
    for key, value in dict(mapping).items():
        value = _json_value(value)
        if isinstance(key, str) and value is not _DROP:
            out[key] = value
    return out


class Attachment:
    """The agent of one callback: ``start`` at train begin (where torch.distributed is up and the model is final),
    ``finish`` at train end."""

    def __init__(self, framework: str, agent, agent_kwargs: dict):
        if agent is not None and agent_kwargs:
            raise TypeError(f"pass agent= or the Agent's keyword arguments, not both (got {sorted(agent_kwargs)})")
        self.framework = framework
        self.given = agent
        self.kwargs = agent_kwargs
        self.agent = None  # the agent of the training in progress or of the last one
        self.live = False  # it is open: between train begin and train end
        self._exit = None

    def start(self, model, run: str | None, config: dict):
        """The agent, watching ``model``: the one given, or a new one with the callback's arguments, whose run name
        defaults to $FP8MON_RUN, then ``run``; ``config`` and the framework's name go under the user's."""
        # A second training with the same callback gets a new agent (a given one serves once); the last one is open
        # still if its training never ended (an exception the framework did not report).
        self.finish("failed")
        if self.given is not None:
            if self.agent is self.given:
                raise RuntimeError("the agent= given to Fp8monCallback was closed when its training ended: a new "
                                   "training needs a new agent (or pass the Agent's arguments instead)")
            self.agent = self.given
            if not self.agent._layers:  # a given agent that watches nothing yet
                self.agent.watch(model)
        else:
            from fp8mon.agent import Agent

            kwargs = dict(self.kwargs)
            kwargs["run"] = kwargs.get("run") or os.environ.get("FP8MON_RUN") or run
            kwargs["config"] = {**config, **(kwargs.get("config") or {})}
            kwargs["tags"] = {"framework": self.framework, **(kwargs.get("tags") or {})}
            self.agent = Agent(**kwargs).watch(model)
        self.live = True
        self._exit = _close_at_exit(self)
        return self.agent

    def finish(self, status: str) -> None:
        if self._exit is not None:
            atexit.unregister(self._exit)
            self._exit = None
        if self.live:
            self.live = False
            self.agent.close(status=status)


def _close_at_exit(attachment: Attachment):
    ref = weakref.ref(attachment)

    def close():
        live = ref()
        if live is not None:
            live.finish("failed")  # the interpreter ends before training did: an exception, a kill

    atexit.register(close)
    return close


def guarded(method):
    """A callback method that never raises into the training loop: an exception is the agent's (logged once per
    kind, counted in ``agent.errors``), or logged when there is no agent."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            agent = self._attachment.agent
            if agent is not None:
                agent._error(f"callback {method.__name__}", exc)
            else:
                log.exception("fp8mon: callback %s failed; training continues", method.__name__)
        return None

    return run
