"""Whole optimizer steps as CUDA graphs (``fp8mon train --cuda-graph``).

A step launches hundreds of kernels, each costing the host tens of microseconds of Python and Triton binding,
and the agent's statistics add launches and bookkeeping of their own. Replaying a captured step costs the host
one call. ``StepGraphs`` captures one graph per kind of step (the Python decisions a step makes: whether the agent
reports, whether its rows carry the histogram, anything the caller adds) after a few eager steps of that kind
(Triton compiles and autotunes there, the optimizer builds its state, the agent grows its buffers), then replays
it at every later step of that kind. The graphs share one memory pool: every graph writes each of its
intermediates before reading it, and only its outputs (kept alive) are read between replays.

What the step function must do:
* read only static tensors: the caller copies each batch into the buffers the function reads;
* return its outputs as tensors (loss, grad norm, diagnostics): a replay returns the same tensors, refilled;
* make no Python decision that changes between steps of one kind (the learning rate goes in as a device tensor
  the caller fills, see ``tensor_lr``), and no host sync.
With an agent, the kind includes its ``reporting`` and ``hist_now``, and each replay is declared to it
(``Agent.replayed``), so ``agent.log`` after the step sends the rows the replay wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch

from fp8mon.agent.stats import launch as stats_launch


class StepGraphs:
    """``graphs(kind)`` runs one step of ``kind``: eagerly for its first ``warmup`` steps, then captured once and
    replayed. Returns ``step_fn``'s outputs (a replay's are the capture's tensors, refilled)."""

    def __init__(self, step_fn: Callable[[], Any], *, agent=None, warmup: int = 2):
        if warmup < 1:
            raise ValueError("warmup must be >= 1: a capture needs the step's kernels compiled and its buffers grown")
        self.step_fn, self.agent, self.warmup = step_fn, agent, warmup
        self._graphs: dict[Hashable, tuple] = {}  # kind -> (graph, outputs, agent record)
        self._eager: dict[Hashable, int] = {}
        self._pool = None

    @property
    def captured(self) -> int:
        """How many graphs (kinds of step) are captured."""
        return len(self._graphs)

    def __call__(self, kind: Hashable = None):
        if self.agent is not None:
            kind = (kind, self.agent.reporting, self.agent.hist_now)
        got = self._graphs.get(kind)
        captured_now = got is None
        if captured_now:
            if self._eager.get(kind, 0) < self.warmup:
                self._eager[kind] = self._eager.get(kind, 0) + 1
                return self.step_fn()
            got = self._graphs[kind] = self._capture()
        graph, outputs, record = got
        graph.replay()  # the capture ran nothing: its own step is this replay
        if record is not None and not captured_now:  # the capture declared its step's rows to the agent already
            self.agent.replayed(record)
        return outputs

    def _capture(self) -> tuple:
        graph = torch.cuda.CUDAGraph()
        record = None
        # thread_local: the agent's collector thread polls its copies' events while this thread captures; in the
        # default global mode captures with the agent were invalidated, which that polling explains (not traced)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            with (self.agent.capture() if self.agent is not None else contextlib.nullcontext()) as record:
                outputs = self.step_fn()
        self._pool = graph.pool()
        stats_launch.captured_copies_done()  # the captured statistics launches' tables, copied outside the graph
        return graph, outputs, record


def tensor_lr(optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
    """Make ``optimizer`` capturable with its learning rate a device tensor (one for all groups): a captured
    step reads the rate the caller ``fill_``s before each replay instead of the number it was captured with."""
    rates = {float(group["lr"]) for group in optimizer.param_groups}
    if len(rates) > 1:
        raise ValueError(f"tensor_lr: the parameter groups have different learning rates {sorted(rates)}")
    lr = torch.tensor(rates.pop(), dtype=torch.float32, device=device)
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["capturable"] = True
    return lr
