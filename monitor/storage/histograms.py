"""The stored log2 histograms of one layer x site (wire `log2_hist`: counts of |x| per binade, 56 bins from 2^-40)
over a step range, with the scale in use at each of their steps.

Histograms come on histogram steps only (every `hist_every`-th reporting step). When a range holds more than
`max_points` of them, consecutive ones are summed into columns of equally many histograms (counts add; nothing is
sampled), each column with the smallest and the largest scale of its steps. Summed over ranks (`rank` None), a step's
histograms add up to the histogram of all ranks' values together, and its scales are every rank's."""

from __future__ import annotations

import math
from itertools import groupby
from operator import itemgetter

import numpy as np

from fp8mon.agent.wire import LOG2_HIST_BINS, LOG2_HIST_LO
from fp8mon.monitor.storage.database import Database, fetch, to_float
from fp8mon.monitor.storage.entities import Histograms
from fp8mon.monitor.storage.runs import run_ref
from fp8mon.monitor.storage.series import step_range, tensor_series_id, worst_ranks


def _scale(value) -> float | None:
    s = to_float(value)
    return s if s is not None and math.isfinite(s) and s > 0 else None


def histograms(db: Database, name: str, *, layer: str, site: str, rank: int | None = 0, start: int | None = None,
               end: int | None = None, max_points: int = 300) -> Histograms:
    """`rank` None: summed over the run's ranks (the merged rank -1 only if it is the only one)."""
    with db.reading() as conn:
        ref = run_ref(conn, name)
        sid = tensor_series_id(conn, ref, layer, site)
        rng = step_range(ref, start, end)
        rows = [] if rng is None else fetch(
            conn, "SELECT step, scale, log2_hist, rank FROM tensor_stats WHERE series_id = :sid "
                  + ("" if rank is None else "AND rank = :rank ")
                  + "AND step >= :lo AND step <= :hi AND log2_hist IS NOT NULL ORDER BY step",
            {"sid": sid, "lo": rng[0], "hi": rng[1], **({} if rank is None else {"rank": rank})})
    if rank is None:
        kept = set(worst_ranks(sorted({row[3] for row in rows})))
        rows = [row for row in rows if row[3] in kept]
    by_step = [list(step_rows) for _, step_rows in groupby(rows, key=itemgetter(0))]  # one histogram step each
    per_column = max(1, -(-len(by_step) // max_points))
    steps, step_last, counts, scale_min, scale_max = [], [], [], [], []
    for lo in range(0, len(by_step), per_column):
        group = [row for step_rows in by_step[lo:lo + per_column] for row in step_rows]
        summed = np.zeros(LOG2_HIST_BINS, dtype=np.int64)
        for row in group:
            summed += np.frombuffer(bytes(row[2]), dtype="<i8")
        scales = [s for s in (_scale(row[1]) for row in group) if s is not None]
        steps.append(group[0][0])
        step_last.append(group[-1][0])
        counts.append(summed.tolist())
        scale_min.append(min(scales) if scales else None)
        scale_max.append(max(scales) if scales else None)
    return Histograms(run=name, layer=layer, site=site, rank=rank, start=None if rng is None else rng[0],
                      end=None if rng is None else rng[1], binade_lo=LOG2_HIST_LO, bins=LOG2_HIST_BINS,
                      per_column=per_column, step=steps, step_last=step_last, counts=counts, scale_min=scale_min,
                      scale_max=scale_max)
