"""Run-level gauge values for /metrics, computed from an ingested batch."""

import math
import time

import numpy as np

from fp8mon.monitor.wire import IngestBatch


def batch_gauges(batch: IngestBatch) -> dict[str, float | None]:
    """Run-level aggregates at the batch's last step, from the batch itself: the worst (largest) kurtosis,
    underflow and overflow fraction over layers x sites, and the count of tensors or scalars with non-finite
    values. Used for /metrics unless the predictor reports its own."""
    out: dict[str, float | None] = {"last_seen": time.time()}
    last_steps = []
    t = batch.tensors
    nonfinite = 0
    if t is not None and len(t):
        steps = np.full(len(t), t.step, dtype=np.int64) if isinstance(t.step, int) else np.asarray(t.step, np.int64)
        last = int(steps.max())
        last_steps.append(last)
        at_last = steps == last
        for stat, key in (("kurtosis", "worst_kurtosis"), ("underflow_frac", "worst_underflow_frac"),
                          ("overflow_frac", "worst_overflow_frac")):
            column = t.stats.get(stat)
            if column is None:
                continue
            values = np.asarray([np.nan if v is None else v for v in column], dtype=np.float64)[at_last]
            finite = values[np.isfinite(values)]
            if finite.size:
                out[key] = float(finite.max())
            elif np.isinf(values).any():
                out[key] = math.inf
        bad = np.zeros(int(at_last.sum()), dtype=bool)
        column = t.stats.get("nonfinite")
        if column is not None:
            values = np.asarray([0.0 if v is None else v for v in column], dtype=np.float64)[at_last]
            bad |= ~(values == 0)  # NaN counts too
        for stat in ("amax", "rms", "kurtosis"):
            column = t.stats.get(stat)
            if column is not None:
                values = np.asarray([0.0 if v is None else v for v in column], dtype=np.float64)[at_last]
                bad |= ~np.isfinite(values)
        nonfinite += int(bad.sum())
    s = batch.scalars
    if s is not None and len(s):
        steps = np.full(len(s), s.step, dtype=np.int64) if isinstance(s.step, int) else np.asarray(s.step, np.int64)
        last = int(steps.max())
        last_steps.append(last)
        values = np.asarray([0.0 if v is None else v for v in s.value], dtype=np.float64)[steps == last]
        nonfinite += int((~np.isfinite(values)).sum())
    if last_steps:
        out["last_step"] = max(last_steps)
        out["nonfinite_tensors"] = nonfinite
    return out
