"""Gradients read after everything else their backward pass ends with: with several ranks, the reduced gradient.

Under DistributedDataParallel the post-accumulate-grad hook of a weight sees the rank's own gradient: DDP all-reduces
it in buckets while the backward pass runs and writes the average across ranks into ``.grad`` in a callback at the
pass's end (its reducer's finalize, queued when the last bucket is ready). So with several ranks the agent reads a
hooked weight's gradient in a callback queued from the pass's end callbacks: it runs after every callback queued
before it, DDP's included, and sees the averaged gradient, the one the optimizer steps with. The same for FSDP2,
whose sharded gradients are reduce-scattered before its hooks run (the root's in its own end callback). Without
``no_sync``: under ``no_sync`` (gradient accumulation) a rank's gradient is its own, and so is its row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["LateGrads"]


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class LateGrads:
    """``add(layer, site, param)`` during a backward pass: ``param.grad`` is observed (``observe_items``, replacing)
    after the pass's other end callbacks, or at ``flush``. Off (``on`` False) on a single rank."""

    def __init__(self, observe_items: Callable, error: Callable, on: bool):
        self.on = on
        self._observe_items, self._error = observe_items, error
        self._waiting: dict[tuple[str, str], torch.Tensor] = {}
        self._queued = False
        self._lock = threading.Lock()

    def add(self, layer: str, site: str, param: torch.Tensor) -> None:
        with self._lock:
            self._waiting[(layer, site)] = param
            if self._queued:
                return
            self._queued = True
        try:
            _queue(self._requeue)
        except Exception:  # not within a backward pass (queue_callback refuses): now
            self.flush()

    def _requeue(self) -> None:
        """At the pass's end: queue the read behind the end callbacks queued so far (autograd runs a callback queued
        by a callback after those)."""
        try:
            _queue(self.flush)
        except Exception:
            self.flush()

    def flush(self) -> None:
        """Observe the waiting gradients (autograd calls this; it must not raise)."""
        try:
            with self._lock:
                waiting, self._waiting, self._queued = self._waiting, {}, False
            items = [(layer, site, p.grad, False, True) for (layer, site), p in waiting.items() if p.grad is not None]
            if items:
                self._observe_items(items)
        except Exception as exc:
            self._error("hook grad_weight", exc)
