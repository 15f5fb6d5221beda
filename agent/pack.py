"""The device side of a reporting step: one row per (layer, site) slot in one fp64 buffer, and the
per-slot amax history of delayed scaling. Only device ops: no host synchronisation."""

from __future__ import annotations

import threading

import torch

from .stats import launch
from .stats import torch_path as ds


class Slots:
    """(layer, site) -> row index, in registration order (the same on every rank for the same model)."""

    def __init__(self):
        self.keys: list[tuple[str, str]] = []
        self._index: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def get(self, layer: str, site: str) -> int:
        key = (layer, site)
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.keys)
            self.keys.append(key)
        return i


def _grown(t: torch.Tensor | None, rows: int, device, make) -> torch.Tensor:
    """``t`` with at least ``rows`` rows on ``device`` (doubling), new rows from ``make(k, device)``."""
    if t is None:
        return make(max(rows, 16), device)
    if t.device != device:
        t = t.to(device)
    if t.shape[0] < rows:
        t = torch.cat([t, make(max(rows, 2 * t.shape[0]) - t.shape[0], device)])
    return t


class StepPack:
    """The rows of the reporting step in progress. Hooks may run on autograd's device threads, hence
    the lock (uncontended on the training thread)."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self.rows: torch.Tensor | None = None
        self.written: set[int] = set()
        self.open = False
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            if self.written and self.rows is not None:
                self.rows.zero_()  # stream-ordered after the previous step's copy out of it
            self.written = set()
            self.open = True

    def grow(self, device) -> torch.Tensor:
        """The buffer with a row for every slot, on ``device`` (call with the lock held). Rows still waiting for a
        launch (``stats.launch.defer``) or a merge (``merge_later``) into the old buffer are written there before it
        is copied."""
        r = self.rows
        if r is not None and (r.shape[0] < len(self.slots) or r.device != torch.device(device)):
            launch.flush_deferred()
        self.rows = _grown(r, len(self.slots), device, ds.empty)
        return self.rows

    def add(self, slot: int, row: torch.Tensor, replace: bool = False) -> None:
        """Merge ``row`` into the slot (a further micro-batch or call), or overwrite it (``replace``)."""
        with self._lock:
            self.grow(row.device)
            if row.device != self.rows.device:
                row = row.to(self.rows.device, non_blocking=True)
            if slot in self.written and not replace:
                row = ds.merge(self.rows[slot], row)
            self.rows[slot].copy_(row)
            self.written.add(slot)

    def has(self, slot: int) -> bool:
        return slot in self.written

    def take(self, device) -> torch.Tensor:
        """Close the step: its ``[len(slots), WIDTH]`` rows (a view of the buffer; copy before reuse)."""
        with self._lock:
            self.open = False
            self.grow(device if self.rows is None else self.rows.device)
            return self.rows[: len(self.slots)]


class AmaxHistory:
    """Delayed scaling's per-slot amax history on the device (length H, algo max, margin), as in TE:
    a step's tensors are scaled from the history of the previous steps; the step's amax (max over its
    micro-batches) enters the history when the step ends."""

    def __init__(self, length: int, margin: float, slots: Slots):
        if length < 1:
            raise ValueError("the amax history needs a length >= 1")
        self.length, self.margin, self.slots = length, margin, slots
        self.history: torch.Tensor | None = None  # [slots, H] float32
        self.current: torch.Tensor | None = None  # [slots] this step's amax so far
        self.position = 0
        self.seen = False
        self._lock = threading.Lock()

    def _fit(self, device) -> None:
        n = len(self.slots)
        self.history = _grown(self.history, n, device,
                              lambda k, d: torch.zeros(k, self.length, dtype=torch.float32, device=d))
        self.current = _grown(self.current, n, device, lambda k, d: torch.zeros(k, dtype=torch.float32, device=d))

    def scale(self, slot: int, fmt, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, history max) of the slot for this step, as device tensors."""
        with self._lock:
            self._fit(device)
            hmax = self.history[slot].amax()
        return ds.scale_from_amax(hmax, fmt, self.margin), hmax

    def observe(self, slot: int, amax: torch.Tensor) -> None:
        with self._lock:
            self._fit(amax.device)
            cur = self.current[slot]
            torch.maximum(cur, amax.to(cur.device, torch.float32, non_blocking=True), out=cur)
            self.seen = True

    def roll(self) -> None:
        """End of step: this step's amaxes enter the history (the oldest leaves)."""
        with self._lock:
            if not self.seen:
                return
            self.history[:, self.position % self.length] = self.current[: self.history.shape[0]]
            self.current.zero_()
            self.position += 1
            self.seen = False
