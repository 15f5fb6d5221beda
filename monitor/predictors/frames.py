"""Ingest batches cut into per-step frames: the statistics of every (layer, site) as numpy rows indexed by
a slot number, plus the step's scalars.

Slots are numbered in order of first appearance (the agent reports layers in model order), so "the first
slot" that shows something is the first layer/site in the model. A layer that appears late gets the next
slot; arrays of the signals grow with `SlotTable.width`.

Rank choice, per step: the records reduced over all ranks (rank -1) when the step has any, else rank 0's;
other ranks are ignored (they would double count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fp8mon.monitor.wire import IngestBatch

# Statistics the predictors read; the rest of a record is ignored.
USED_STATS = ("amax", "kurtosis", "underflow_frac", "overflow_frac", "nonfinite", "scale", "amax_history_max")
NAN_CHECKED = ("amax", "kurtosis")
BAD = "_nonfinite"  # derived row: 1.0 where the record shows non-finite values
# FP8 format max of the sites an FP8 GEMM casts (E4M3 forward operands, E5M2 output gradient); NaN: the
# site is not cast (the agent may still report a hypothetical scale for grad_weight, nothing saturates there).
FORMAT_MAX = {"input": 448.0, "weight": 448.0, "output": np.nan, "grad_output": 57344.0, "grad_weight": np.nan}


class SlotTable:
    """(layer, site) -> slot index, in order of first appearance."""

    def __init__(self):
        self.index: dict[tuple[str, str], int] = {}
        self.layers: list[str] = []
        self.sites: list[str] = []
        self.format_max = np.zeros(0)
        self.site_list: list[str] = []  # distinct sites, first seen first
        self.site_code = np.zeros(0, dtype=np.int64)  # per slot: index into site_list
        self._last: tuple[list, list, np.ndarray] | None = None  # the agent sends the same keys every step
        self._masks: dict[tuple[str, ...], np.ndarray] = {}

    def site_mask(self, sites: tuple[str, ...]) -> np.ndarray:
        """Bool per slot: its site is one of `sites` (cached until a slot is added)."""
        mask = self._masks.get(sites)
        if mask is None:
            mask = self._masks[sites] = np.isin(np.array(self.sites, dtype=object), sites)
        return mask

    def slots(self, layers: list[str], sites: list[str]) -> np.ndarray:
        last = self._last
        if last is not None and last[0] == layers and last[1] == sites:
            return last[2]
        out = self._lookup(layers, sites)
        self._last = (layers, sites, out)
        return out

    @property
    def width(self) -> int:
        return len(self.layers)

    def _lookup(self, layers: list[str], sites: list[str]) -> np.ndarray:
        index = self.index
        out = np.empty(len(layers), dtype=np.int64)
        added = False
        for i, key in enumerate(zip(layers, sites)):
            slot = index.get(key)
            if slot is None:
                slot = index[key] = len(self.layers)
                self.layers.append(key[0])
                self.sites.append(key[1])
                added = True
            out[i] = slot
        if added:
            self.format_max = np.array([FORMAT_MAX.get(s, np.nan) for s in self.sites])
            self.site_list = list(dict.fromkeys(self.sites))
            self.site_code = np.array([self.site_list.index(s) for s in self.sites], dtype=np.int64)
            self._masks.clear()
        return out

    def name(self, slot: int) -> tuple[str, str]:
        return self.layers[slot], self.sites[slot]


@dataclass
class StepFrame:
    step: int
    # statistic -> float64 row over all slots (NaN where not reported at this step); empty when the step
    # carries no tensor records
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    present: np.ndarray | None = None  # bool row: slot reported at this step
    scalars: dict[str, float] = field(default_factory=dict)

    @property
    def has_tensors(self) -> bool:
        return self.present is not None and bool(self.present.any())


def _nonfinite_records(raw: dict[str, list], columns: dict[str, np.ndarray], idx: np.ndarray | None,
                       n: int) -> np.ndarray:
    """1.0 where a record counts non-finite elements or reports a NaN/Inf statistic (null = not reported
    is not a NaN), else 0.0. The NaN kurtosis of a tensor of zeros only (amax 0, no non-finite element) is
    0/0, not a non-finite value: a gradient that underflows entirely (delayed scaling's first step, before
    any amax is in the history) reports it. `n`: the records kept (a batch may carry none of the statistics
    read here)."""
    bad = np.zeros(n, dtype=bool)
    counts = columns.get("nonfinite")
    if counts is not None:
        bad |= counts > 0  # NaN (null) compares False
    amax = columns.get("amax")
    all_zeros = (amax == 0) & (counts == 0) if amax is not None and counts is not None else np.zeros(n, dtype=bool)
    for name in NAN_CHECKED:
        values = columns.get(name)
        if values is None:
            continue
        odd = ~np.isfinite(values)
        if name == "kurtosis":
            odd &= ~all_zeros
        if odd.any():  # rare: only then tell a reported NaN from a null
            positions = range(len(raw[name])) if idx is None else idx.tolist()
            reported = np.array([raw[name][i] is not None for i in positions])
            bad |= odd & reported
    return bad.astype(np.float64)


def _column(value, n: int) -> np.ndarray:
    return np.full(n, value, dtype=np.int64) if isinstance(value, int) else np.asarray(value, dtype=np.int64)


def _preferred_rank(steps: np.ndarray, rank_column, n: int) -> np.ndarray:
    """Mask of the records to use: rank -1 where the step has any, else rank 0."""
    if isinstance(rank_column, int) or len(set(rank_column)) == 1:  # the usual batch: one rank
        rank = rank_column if isinstance(rank_column, int) else rank_column[0]
        return np.full(n, rank in (0, -1))
    ranks = np.asarray(rank_column, dtype=np.int64)
    reduced_steps = np.unique(steps[ranks == -1])
    has_reduced = np.isin(steps, reduced_steps)
    return np.where(has_reduced, ranks == -1, ranks == 0)


def split_steps(batch: IngestBatch, slots: SlotTable) -> list[StepFrame]:
    """The batch's steps in ascending order, one frame each."""
    frames: dict[int, StepFrame] = {}
    block = batch.tensors
    if block is not None and len(block):
        n = len(block)
        steps = _column(block.step, n)
        keep = _preferred_rank(steps, block.rank, n)
        if keep.all():
            idx = None
            slot = slots.slots(block.layer, block.site)
        elif keep.any():
            idx = np.flatnonzero(keep)
            slot = slots.slots([block.layer[i] for i in idx.tolist()], [block.site[i] for i in idx.tolist()])
            steps = steps[idx]
        if keep.any():
            columns = {}
            for name in USED_STATS:
                if name in block.stats:
                    col = np.array(block.stats[name], dtype=np.float64)
                    columns[name] = col if idx is None else col[idx]
            columns[BAD] = _nonfinite_records(block.stats, columns, idx, n if idx is None else len(idx))
            width = slots.width
            single = isinstance(block.step, int)
            for step in ([block.step] if single else np.unique(steps).tolist()):
                at = slice(None) if single else steps == step
                frame_slots = slot[at]
                present = np.zeros(width, dtype=bool)
                present[frame_slots] = True
                stats = {}
                for name, col in columns.items():
                    row = np.full(width, np.nan)
                    row[frame_slots] = col[at]
                    stats[name] = row
                frames[step] = StepFrame(step, stats, present)
    block = batch.scalars
    if block is not None and len(block):
        n = len(block)
        steps = _column(block.step, n)
        keep = _preferred_rank(steps, block.rank, n)
        for i in np.flatnonzero(keep).tolist():
            step = int(steps[i])
            value = block.value[i]
            if value is None:  # not reported
                continue
            frame = frames.get(step) or frames.setdefault(step, StepFrame(step))
            frame.scalars[block.name[i]] = float(value)
    return [frames[s] for s in sorted(frames)]
