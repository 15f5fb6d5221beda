"""Gradients that wait for a launch: a layer's grad_output waits for its grad_weight, and grad_weights wait for the
next launch of their backward pass, so that tensors of one backward share a statistics launch.

* A layer whose hooks observe both its grad_output and its grad_weight (a *pair*): the grad_output, which autograd
  produces right before the grad_weight in the same backward node, waits for it; one launch takes both. At most one
  waits: another's arrival releases it alone.
* The other layers' grad_weights wait, as (layer, site) -> parameter, for the next statistics launch of the same
  backward pass or for its end (a launch costs host time, and a layer's ``.grad`` is final for the pass once its
  accumulate hook has run): an FP8 model's grad_weights, whose other sites come from its fused kernels, are one
  launch per step instead of one per layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class GradPairing:
    """``observe(layer, site, tensor)`` observes one tensor alone; ``observe_items(items)`` observes
    ``(layer, site, tensor, once, replace)`` items in one launch."""

    def __init__(self, observe: Callable, observe_items: Callable, error: Callable):
        self._observe, self._observe_items, self._error = observe, observe_items, error
        self.pairs: set[str] = set()  # layers whose hooks observe both
        self._waiting: tuple[str, torch.Tensor] | None = None
        self._waiting_lock = threading.Lock()  # backward hooks may run on several device threads
        self._after: dict[tuple[str, str], torch.Tensor] = {}
        self._after_queued = False  # the end-of-pass callback is queued
        self._after_lock = threading.Lock()

    # ---- grad_output waiting for its grad_weight ------------------------------------------------------------------

    def hold(self, layer: str, grad: torch.Tensor) -> None:
        """``layer``'s grad_output waits for its grad_weight; one waiting before it is observed alone."""
        with self._waiting_lock:
            before, self._waiting = self._waiting, (layer, grad)
        if before is not None:  # its grad_weight did not follow
            self._observe(before[0], "grad_output", before[1])

    def waiting(self) -> bool:
        return self._waiting is not None

    def take(self, layer: str) -> torch.Tensor | None:
        """``layer``'s waiting grad_output, no longer waiting (None: none waits)."""
        with self._waiting_lock:
            if self._waiting is None or self._waiting[0] != layer:
                return None
            grad, self._waiting = self._waiting[1], None
            return grad

    def release(self) -> None:
        """Observe a waiting grad_output alone (its grad_weight did not follow)."""
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._observe(waiting[0], "grad_output", waiting[1])

    def drop(self) -> None:
        self._waiting = None

    # ---- grad_weights waiting for the pass's next launch ----------------------------------------------------------

    def after_backward(self, layer: str, site: str, param: torch.Tensor) -> None:
        """``param.grad`` waits for the next launch of this backward pass or its end, whichever comes first."""
        with self._after_lock:
            self._after[(layer, site)] = param
            if self._after_queued:
                return
            self._after_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_pass)
        except Exception:  # not within a backward pass (queue_callback refuses): now
            self.end_of_pass()

    def take_after(self, device) -> list:
        """The waiting grad_weights on ``device`` (all, for None) as observe items; they no longer wait."""
        if not self._after:
            return []
        with self._after_lock:
            taken = [(key, p) for key, p in self._after.items() if device is None or p.device == device]
            for key, _ in taken:
                del self._after[key]
        return [(layer, site, p.grad, False, True) for (layer, site), p in taken if p.grad is not None]

    def end_of_pass(self) -> None:
        """The end of a backward pass (autograd calls this; it must not raise): the grad_weights still waiting."""
        try:
            with self._after_lock:
                self._after_queued = False
            items = self.take_after(None)
            if items:
                self._observe_items(items)
        except Exception as exc:
            self._error("hook grad_weight", exc)
