"""CUDA graphs: a step captured into a graph runs the hooks and the layers' launches once, at capture. ``capture``
records the rows that step writes (``StepRecord``); ``replayed`` declares them for the step in progress after each
replay (``trainer.graphs.StepGraphs`` does both). A graph belongs to one kind of step (reporting or not, with or
without the histogram) and to the agent's device buffers as they were at capture."""

from __future__ import annotations

import contextlib


class StepRecord:
    """What ``Agent.capture`` saw a captured step do on the host: the rows its launches write, per the kind of
    step it was."""

    def __init__(self, reporting: bool, hist: bool):
        self.reporting, self.hist = reporting, hist
        self.written: frozenset[int] = frozenset()
        self.seen: frozenset[int] = frozenset()
        self.history_seen = False
        self.buffers: tuple = ()


def buffers(agent) -> tuple:
    """Addresses of the device buffers a captured step writes or reads by address."""
    h = agent._history
    return tuple(0 if t is None else t.data_ptr() for t in (
        agent._pack.rows, agent._sink.centers, None if h is None else h.history, None if h is None else h.current))


@contextlib.contextmanager
def capture(agent):
    """``Agent.capture``."""
    pack, sink = agent._pack, agent._sink
    if agent.reporting and pack.written:  # (a step that does not report keeps the last report's set)
        raise RuntimeError("agent.capture(): this step already has rows; capture a whole step from its start")
    record = StepRecord(agent.reporting, agent.hist_now)
    before = buffers(agent)
    yield record
    sink.launch_pending()
    record.written = frozenset(pack.written) if agent.reporting else frozenset()
    record.seen = frozenset(sink.seen)
    record.history_seen = agent._history is not None and agent._history.seen
    record.buffers = buffers(agent)
    if record.buffers != before:  # launches captured before the move wrote the old buffer
        raise RuntimeError("the agent's device buffers grew during the capture: run a step of this kind eagerly "
                           "before capturing it")


def replayed(agent, record: StepRecord) -> None:
    """``Agent.replayed``."""
    if (agent.reporting, agent.hist_now) != (record.reporting, record.hist):
        raise ValueError(f"step {agent.current_step} (reporting={agent.reporting}, histogram={agent.hist_now}) is "
                         f"not the kind of step the graph captured (reporting={record.reporting}, "
                         f"histogram={record.hist})")
    if buffers(agent) != record.buffers:
        raise RuntimeError("the agent's device buffers moved since the graph was captured: capture it again")
    pack = agent._pack
    with pack._lock:
        if pack.written & record.written:
            raise RuntimeError("rows of this step were written before the replay; the graph would overwrite them")
        pack.written |= record.written
    agent._sink.seen |= record.seen
    if record.history_seen:
        agent._history.seen = True
