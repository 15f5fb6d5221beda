"""Vectorised per-column state of streaming series (one column per slot): smoothed level, running minimum
since warm-up, rate of change, and a robust z-score for scalar streams. Constant memory per column."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from fp8mon.monitor.predictors.schedule import Warmup, as_warmup


def grown(array: np.ndarray, width: int, fill=np.nan) -> np.ndarray:
    """`array` with its last axis padded to `width` with `fill`."""
    if array.shape[-1] >= width:
        return array
    pad = np.full(array.shape[:-1] + (width - array.shape[-1],), fill, dtype=array.dtype)
    return np.concatenate([array, pad], axis=-1)


class LevelTracker:
    """EWMA level of each column, its minimum over the steps after the warm-up (the baseline), and its
    rate of change per training step over the last `window` updates. `warmup`: a `schedule.Warmup` shared
    with the run's other signals, or a fixed first step.

    With `baseline_steps` the baseline is the minimum over only the last `baseline_steps` training steps
    (from warm-up on), kept as the minima of 8 buckets of steps, so slow drift over a long run does not add
    up into a rise.

    With `alpha_steps` the EWMA weight `alpha` is per `alpha_steps` training steps, not per update: an update
    dt steps after the previous one weighs 1 - (1 - alpha) ** (dt / alpha_steps), so the smoothing spans the
    same number of training steps whatever the reporting interval.

    `since_warmup` (with `baseline_steps` and `long_baseline`): the minimum since the warm-up too, the long-horizon baseline that a
    slow creep rises above (`long_rise`).

    Baselines follow `warmup.baselines_open`, and are forgotten when an event begins (`warmup.epoch`)."""

    BUCKETS = 8

    def __init__(self, alpha: float, window: int, warmup: Warmup | int, width: int = 0,
                 baseline_steps: int | None = None, alpha_steps: int | None = None, trend_steps: int | None = None,
                 long_baseline: bool = False):
        self.alpha, self.warmup, self.alpha_steps = alpha, as_warmup(warmup), alpha_steps
        self.trend_steps = trend_steps
        if trend_steps is not None:
            window = max(window, trend_steps + 1)  # room for one update per step over the trend
        self.level = np.full(width, np.nan)
        self.baseline = np.full(width, np.nan)
        self.since_warmup = np.full(width, np.nan) if long_baseline and baseline_steps is not None else None
        self.count = np.zeros(width, dtype=np.int64)
        self._ring = np.full((window, width), np.nan)  # past levels, one row per update
        self._ring_steps = np.full(window, np.nan)
        self._n = 0
        self.step: int | None = None
        self.first_step: int | None = None
        self._bucket_steps = None if baseline_steps is None else max(1, baseline_steps // self.BUCKETS)
        self._buckets: deque[tuple[int, np.ndarray]] = deque()  # (bucket index, minimum level in it)
        self._epoch = self.warmup.epoch

    @property
    def width(self) -> int:
        return self.level.shape[0]

    def grow(self, width: int) -> None:
        if width <= self.width:
            return
        self.level, self.baseline = grown(self.level, width), grown(self.baseline, width)
        if self.since_warmup is not None:
            self.since_warmup = grown(self.since_warmup, width)
        self.count = grown(self.count, width, 0)
        self._ring = grown(self._ring, width)
        self._buckets = deque((b, grown(row, width)) for b, row in self._buckets)

    def update(self, step: int, values: np.ndarray) -> None:
        """`values`: one row, NaN/Inf where the column has no usable value at this step."""
        self.grow(values.shape[0])
        ok = np.isfinite(values)
        first = ok & (self.count == 0)
        self.level = np.where(first, values, self.level)
        later = ok & ~first
        alpha = self.alpha
        if self.alpha_steps is not None and self.step is not None and step > self.step:
            alpha = 1.0 - (1.0 - alpha) ** ((step - self.step) / self.alpha_steps)
        self.level = np.where(later, self.level + alpha * (values - self.level), self.level)
        self.count += ok
        if self._epoch != self.warmup.epoch:
            self._forget_baselines()
        if self.warmup.baselines_open(step):
            if self._bucket_steps is None:
                self.baseline = np.where(ok, np.fmin(self.baseline, self.level), self.baseline)
            else:
                self._trail_baseline(step, np.where(ok, self.level, np.nan))
                if self.since_warmup is not None:
                    self.since_warmup = np.where(ok, np.fmin(self.since_warmup, self.level), self.since_warmup)
        slot = self._n % self._ring.shape[0]
        self._ring[slot] = self.level
        self._ring_steps[slot] = step
        self._n += 1
        self.step = step
        if self.first_step is None:
            self.first_step = step

    def _forget_baselines(self) -> None:
        self._epoch = self.warmup.epoch
        self.baseline = np.full(self.width, np.nan)
        if self.since_warmup is not None:
            self.since_warmup = np.full(self.width, np.nan)
        self._buckets.clear()

    def _trail_baseline(self, step: int, levels: np.ndarray) -> None:
        bucket = step // self._bucket_steps
        if self._buckets and self._buckets[-1][0] == bucket:
            self._buckets[-1] = (bucket, np.fmin(self._buckets[-1][1], levels))
        else:
            self._buckets.append((bucket, levels.copy()))
        while self._buckets[0][0] < bucket - self.BUCKETS:
            self._buckets.popleft()
        with np.errstate(invalid="ignore"):
            self.baseline = np.fmin.reduce([row for _, row in self._buckets])

    def rise(self) -> np.ndarray:
        """Level minus baseline; NaN before the baseline exists."""
        return self.level - self.baseline

    def long_rise(self) -> np.ndarray:
        """Level minus its minimum since the warm-up (NaN without `long_baseline`; without `baseline_steps`
        rise() is that)."""
        if self.since_warmup is None:
            return np.full(self.width, np.nan)
        return self.level - self.since_warmup

    def rate(self) -> np.ndarray:
        """Change of the level per training step over the window; NaN until the window is full (a rate
        over a few steps is noise). With `trend_steps`: over the last `trend_steps` training steps (from the
        oldest update within them, or the last one before when updates are sparser), whatever the interval."""
        if self.trend_steps is not None:
            return self._rate_over_steps()
        if self._n < self._ring.shape[0]:
            return np.full(self.width, np.nan)
        oldest = self._n % self._ring.shape[0]
        span = self.step - self._ring_steps[oldest]
        if not span > 0:
            return np.full(self.width, np.nan)
        return (self.level - self._ring[oldest]) / span

    def _rate_over_steps(self) -> np.ndarray:
        if self.step is None or self.step - self.first_step < self.trend_steps:
            return np.full(self.width, np.nan)
        steps = self._ring_steps
        earlier = steps < self.step  # NaN compares False
        within = earlier & (steps >= self.step - self.trend_steps)
        if within.any():
            i = int(np.flatnonzero(within)[np.argmin(steps[within])])
        else:
            i = int(np.flatnonzero(earlier)[np.argmax(steps[earlier])])
        return (self.level - self._ring[i]) / (self.step - steps[i])


class ScalarLevel:
    """LevelTracker for one scalar series, in plain floats (numpy's per-call cost dominates at width 1). With
    `alpha_steps`, `alpha` is the weight per `alpha_steps` training steps, as in LevelTracker; its baseline, too,
    is forgotten when an event begins."""

    def __init__(self, alpha: float, warmup: Warmup | int, alpha_steps: int | None = None):
        self.alpha, self.warmup, self.alpha_steps = alpha, as_warmup(warmup), alpha_steps
        self.level = math.nan
        self.baseline = math.nan
        self.step: int | None = None
        self._epoch = self.warmup.epoch

    def update(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return
        alpha = self.alpha
        if self.alpha_steps is not None and self.step is not None and step > self.step:
            alpha = 1.0 - (1.0 - alpha) ** ((step - self.step) / self.alpha_steps)
        self.step = step
        self.level = value if math.isnan(self.level) else self.level + alpha * (value - self.level)
        if self._epoch != self.warmup.epoch:
            self._epoch, self.baseline = self.warmup.epoch, math.nan
        if self.warmup.baselines_open(step) and not self.level >= self.baseline:
            self.baseline = self.level

    def rise(self) -> float:
        return self.level - self.baseline


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


class RobustZ:
    """z-score of each new value of a scalar stream against the median and MAD of the previous `window`
    values (values are only added after scoring, so a spike does not hide itself)."""

    def __init__(self, window: int, min_history: int):
        self.window, self.min_history = window, min_history
        self._values: deque[float] = deque(maxlen=window)

    def score(self, value: float) -> float:
        """z of `value`, then `value` joins the history; NaN while the history is short or the value is not
        finite (non-finite values never enter the history)."""
        z = math.nan
        if math.isfinite(value):
            history = self._values
            if len(history) >= self.min_history:
                median = _median(sorted(history))
                mad = _median(sorted(abs(v - median) for v in history))
                spread = 1.4826 * max(mad, 1e-3 * abs(median), 1e-12)
                z = (value - median) / spread
            history.append(value)
        return z
