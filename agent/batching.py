"""Hooked tensors waiting for one shared statistics launch (``PendingRows``).

In an eager model every launch costs host time (a Triton launch, its table's copy): a step of a 12-layer GPT-2 with
one launch per layer's forward and one per its backward is host-bound. The hooks' tensors whose rows need no amax
history read back (delayed scaling's) therefore wait here and go out together, in one launch per ``MAX_ITEMS``
tensors; a row with a scale (a layer's own FP8 cast, torchao's) waits with its scale tensor.

A waiting tensor must not change before its launch. Forward inputs cannot (autograd saved them), weights and
gradients can only after the backward pass, so everything waiting is launched at the latest at the end of each
backward pass and before any optimizer step (a global pre-hook), besides the step's end. A layer output can be
changed in place by the model (an in-place activation): each tensor's version (and its scale's) is checked at the
launch; a changed one loses that step's row (counted as an agent error, with the reason) and its (layer, site) is
launched at once from then on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

MAX_ITEMS = 64  # tensors per shared launch
MAX_BYTES = 1 << 30  # bytes waiting at most: a larger wait would hold memory the model has freed (the logits)
MAX_COPY_BYTES = 1 << 28  # a larger tensor of a compiled graph is read at once rather than copied (``copies``)


class PendingRows:
    """Items ``(slot, tensor, fmt, scale, ahm, emulated, replace, site)`` of ``sink.HookSink``, launched by
    ``launch(items)`` together. ``error(where, exc)`` counts a lost row."""

    def __init__(self, launch: Callable[[list], None], error: Callable[[str, BaseException], None]):
        self._launch, self._error = launch, error
        self._items: list[tuple] = []
        self._versions: list[int] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self._callback_queued = False
        self.immediate: set[int] = set()  # slots whose tensor was changed in place while it waited once
        self._copying = 0
        self._unhook = _optimizer_pre_hook(self)

    def can_wait(self, slot: int, x: torch.Tensor) -> bool:
        if self._copying and x.numel() * x.element_size() > MAX_COPY_BYTES:
            return False  # its launch costs little host time beside its read; a copy, much memory
        return slot not in self.immediate and not _capturing(x)

    @contextlib.contextmanager
    def copies(self):
        """Within, a tensor waits as a private copy (a weight as itself): a compiled graph's memory planning may reuse
        a tensor's memory right after handing it over, which no version counter shows. A copy costs a device copy
        (little host time); a launch of its own would cost much more host time."""
        self._copying += 1
        try:
            yield
        finally:
            self._copying -= 1

    def add(self, items: list[tuple]) -> None:
        """Queue ``items``; launch everything when enough waits."""
        if self._copying:
            items = [it if it[7] == "weight" else (it[0], it[1].detach().clone(), *it[2:]) for it in items]
        with self._lock:
            self._items.extend(items)
            self._versions.extend(_versions(it) for it in items)
            self._bytes += sum(it[1].numel() * it[1].element_size() for it in items)
            full = len(self._items) >= MAX_ITEMS or self._bytes >= MAX_BYTES
            queue = not full and not self._callback_queued and torch._C._current_graph_task_id() != -1
            if queue:
                self._callback_queued = True
        if full:
            self.flush()
        elif queue:  # within a backward pass: launched at its end at the latest
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)

    def flush(self) -> None:
        """Launch everything waiting (nothing raises: failures are counted)."""
        with self._lock:
            items, versions = self._items, self._versions
            self._items, self._versions, self._bytes = [], [], 0
        if not items:
            return
        fresh = []
        for item, version in zip(items, versions):
            if _versions(item) == version:
                fresh.append(item)
                continue
            self.immediate.add(item[0])
            self._error(f"hook {item[7]}", RuntimeError(
                f"the {item[7]} tensor (or its scale) was changed in place before its statistics were read (an in-place op after "
                "the layer?); this step's row is lost, later steps read it right after the layer"))
        if fresh:
            self._launch(fresh)

    def close(self) -> None:
        self.flush()
        self._unhook()

    def _end_of_pass(self) -> None:
        with self._lock:
            self._callback_queued = False
        try:
            self.flush()
        except Exception as exc:  # autograd's callback must not raise
            self._error("hook launch", exc)


def _capturing(x: torch.Tensor) -> bool:
    # under CUDA-graph capture the hooks' launches are recorded at once (the capture ends with the step)
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _optimizer_pre_hook(pending: PendingRows) -> Callable[[], None]:
    """A global optimizer-step pre-hook that launches what waits (an optimizer changes weights and may free grads in
    place); weak, so that a pending list that is gone costs nothing. Returns its remover."""
    ref = weakref.ref(pending)

    def hook(optimizer, args, kwargs) -> None:
        p = ref()
        if p is not None and p._items:
            p.flush()

    handle = register_optimizer_step_pre_hook(hook)
    return handle.remove


def _versions(item: tuple) -> tuple[int, int | None]:
    """The version counters of an item's tensor and of its scale (a tensor, or a number that cannot change)."""
    scale = item[3]
    return item[1]._version, (scale._version if isinstance(scale, torch.Tensor) else None)
