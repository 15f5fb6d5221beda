"""Downsampled reads: one statistic over a step range (series) and a layer x step matrix (heatmap).

Everything here reads in one transaction (REPEATABLE READ on PostgreSQL), so the rollup horizon and the
rows read with it belong to one snapshot.

Downsampling. A range [start, end] asked for with at most `max_points` points is cut into output buckets
of `width` steps aligned on multiples of the width (the first and last may be partial). The width is 1
(raw points) when the range fits. Otherwise (plan_buckets) the finest width that whole rollup buckets
tile (a multiple of the largest level L <= range/max_points, or raw rows grouped when that is below the
first level) if its GROUP BY reads at most SCAN_BUDGET rows, else the smallest level width that fits, so
that each output bucket is one stored rollup row (a heatmap of many layers takes that path). The range is
then covered by segments (decompose): rollup buckets of level L in the middle, finer levels at the edges
down to raw rows, and raw rows above the rollup horizon. Each segment is aggregated into the output
buckets by the database (GROUP BY) and the segments are merged per bucket in numpy: min of mins, max of
maxes, sum of sums and counts, `last` from the latest segment holding rows of the bucket. Nothing is
sampled, so a one-step spike (or a NaN) shows in the bucket containing it at every zoom level. NaN
semantics are those of the rollups (storage.rollup): a NaN makes the bucket's min, max and mean NaN;
`last` is the value at the bucket's last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import Connection, select

from fp8mon.agent.wire import TENSOR_STATS
from fp8mon.monitor.jsonvalues import json_floats, significant
from fp8mon.monitor.models import ROLLUP_WIDTHS, ScalarSeries, TensorSeries
from fp8mon.monitor.storage.database import Database, fetch
from fp8mon.monitor.storage.entities import Heatmap, Series
from fp8mon.monitor.storage.errors import BadParameter, NotFound
from fp8mon.monitor.storage.rollup import KINDS, level_cover, series_ranks, sql_is_nan, sql_nan
from fp8mon.monitor.storage.runs import RunRef, run_ref
from fp8mon.monitor.worst_layers import worst_rows

AGGS = ("min", "max", "mean", "last")

@dataclass
class Plan:
    """Output buckets: column i covers [max(start, (first+i)*width), min(end, (first+i+1)*width - 1)]."""

    start: int
    end: int  # inclusive
    width: int  # 1: raw steps
    level: int | None  # the coarsest rollup level used, None: raw rows only

    @property
    def first(self) -> int:
        return self.start // self.width

    @property
    def columns(self) -> int:
        return self.end // self.width - self.first + 1

    def edges(self) -> list[int]:
        inner = [(self.first + i) * self.width for i in range(1, self.columns)]
        return [self.start, *inner, self.end + 1]


SCAN_BUDGET = 60_000  # source rows a GROUP BY may read before a coarser plan without one is preferred


def _fitted(start: int, end: int, need: int, max_points: int, choose) -> Plan:
    while True:
        width, level = choose(need)
        plan = Plan(start, end, width, level)
        if plan.columns <= max_points:
            return plan
        need = width + 1  # alignment added a partial bucket: widen


def _finest(need: int) -> tuple[int, int | None]:
    """The finest width >= need that whole rollup buckets tile: raw rows below the first level, else a
    multiple (x1..x3) of the largest level <= need."""
    if need < ROLLUP_WIDTHS[0]:
        return need, None
    level = max(w for w in ROLLUP_WIDTHS if w <= need)
    width = -(-need // level) * level
    if width // level == 4 and level * 4 in ROLLUP_WIDTHS:
        level *= 4
    return width, level


def _direct(need: int) -> tuple[int, int]:
    """The smallest level width >= need: one rollup row per bucket, no GROUP BY."""
    for w in ROLLUP_WIDTHS:
        if w >= need:
            return w, w
    top = ROLLUP_WIDTHS[-1]
    return -(-need // top) * top, top


def plan_buckets(start: int, end: int, max_points: int, n_series: int = 1, scan_budget: int | None = None) -> Plan:
    """Buckets for [start, end] in at most max_points columns: raw steps when the range fits, else the finest
    width whose GROUP BY reads at most `scan_budget` source rows over `n_series` series, else the smallest
    rollup level width that fits (each bucket one rollup row: fast, up to 4x coarser than asked)."""
    span = end - start + 1
    need = -(-span // max_points)
    if need <= 1:
        return Plan(start, end, 1, None)
    scan_budget = SCAN_BUDGET if scan_budget is None else scan_budget
    fine = _fitted(start, end, need, max_points, _finest)
    if fine.level == fine.width or n_series * span // (fine.level or 1) <= scan_budget:
        return fine
    return _fitted(start, end, need, max_points, _direct)


def decompose(lo: int, hi: int, horizon: int, levels: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Cover steps [lo, hi) with (width, lo, hi) segments: rollup buckets of the coarsest usable level of
    `levels` (ascending, each dividing the next) and raw rows (width 1) where no bucket is complete or valid."""
    segs: list[list[int]] = []
    pos = lo
    while pos < hi:
        seg = None
        for i in range(len(levels) - 1, -1, -1):
            w = levels[i]
            if pos % w:
                continue
            limit = min(hi, level_cover(horizon, w))
            if i + 1 < len(levels):  # stop where the next coarser level could take over
                limit = min(limit, (pos // levels[i + 1] + 1) * levels[i + 1])
            n = (limit - pos) // w
            if n > 0:
                seg = (w, pos, pos + n * w)
                break
        if seg is None:
            end_raw = hi
            if levels:
                w0 = levels[0]
                nxt = (pos // w0 + 1) * w0
                if nxt + w0 <= min(hi, level_cover(horizon, w0)):
                    end_raw = nxt
            seg = (1, pos, end_raw)
        if segs and segs[-1][0] == seg[0] and segs[-1][2] == seg[1]:
            segs[-1][2] = seg[2]
        else:
            segs.append(list(seg))
        pos = seg[2]
    return [tuple(s) for s in segs]


@dataclass
class Cells:
    """Aggregates per (series row, output bucket); `null` marks cells without a value for that aggregate."""

    values: dict[str, np.ndarray]  # "n", "min", "max", "mean", "last" -> (rows, columns)
    null: dict[str, np.ndarray]
    segments: list = field(default_factory=list)


def _column(rows: list[tuple], i: int) -> tuple[np.ndarray, np.ndarray]:
    """Column i as float64 and its NULL mask (SQLite's TEXT 'NaN' becomes NaN, not NULL)."""
    col = [r[i] for r in rows]
    values = np.array(col, dtype=np.float64)
    null = np.zeros(len(col), dtype=bool)
    for j in np.flatnonzero(np.isnan(values)).tolist():
        null[j] = col[j] is None
    return values, null


def _source_exprs(dialect: str, column: str, rollup: bool, grouped: bool) -> dict[str, str]:
    """SQL per aggregate for one source; grouped ones apply the NaN rule of storage.rollup."""
    if rollup:
        n, mn, mx, sm, last = (f"{column}_{a}" for a in ("n", "min", "max", "sum", "last"))
    else:
        n, mn, mx, sm, last = f"COUNT({column})" if grouped else f"CASE WHEN {column} IS NULL THEN 0 ELSE 1 END", \
            column, column, column, column
    if not grouped:
        return {"n": n, "min": mn, "max": mx, "sum": sm, "last": last}
    if rollup:
        n = f"CAST(SUM({n}) AS BIGINT)"
    nan, flag = sql_nan(dialect), sql_is_nan(dialect, f"MAX({mx})")
    total = f"SUM({sm})"
    # A rollup sum is NaN for +Inf and -Inf in one bucket too; SQLite's SUM would skip that TEXT 'NaN'.
    sum_flag = f" OR {sql_is_nan(dialect, f'MAX({sm})')}" if rollup and dialect == "sqlite" else ""
    return {
        "n": n,
        "max": f"MAX({mx})",
        "min": f"CASE WHEN {flag} THEN {nan} ELSE MIN({mn}) END",
        "sum": f"CASE WHEN {flag}{sum_flag} OR ({total} IS NULL AND {n} > 0) THEN {nan} ELSE {total} END",
    }


def aggregate(conn: Connection, kind: str, column: str, series_ids: list[int], rank: int, plan: Plan,
              horizon: int, want: tuple[str, ...]) -> Cells:
    """Aggregate `column` of the series (matrix rows, in the given order) into the plan's buckets.

    `want` holds any of n, min, max, mean, last. Segments (storage.rollup levels and raw rows) are read
    in step order; a bucket that spans several is merged: min/max/sum/n combine, last comes from the
    latest segment with a row in the bucket."""
    raw, roll, _, _ = KINDS[kind]
    dialect = conn.dialect.name
    n_rows, n_cols = len(series_ids), plan.columns
    size = n_rows * n_cols
    B = plan.width
    ids_sql = ", ".join(str(int(i)) for i in series_ids)
    levels = tuple(w for w in ROLLUP_WIDTHS if plan.level is not None and w <= plan.level)
    segments = decompose(plan.start, plan.end + 1, horizon, levels) if series_ids else []
    aggs = [a for a in ("n", "max", "min", "sum") if a in want or (a == "sum" and "mean" in want)
            or (a == "n" and "mean" in want)]
    want_last = "last" in want

    parts: list[tuple[int, list[tuple], list[str]]] = []  # (segment index, rows (sid, bucket, *cols), cols)
    for seg_index, (w, lo, hi) in enumerate(segments):
        params = {"rank": rank, "lo": lo, "hi": hi, "blo": lo // w, "bhi": hi // w}
        if w == 1:
            table, pos_col, key, grouped = raw, "step", f"step / {B}", B > 1
            where = f"series_id IN ({ids_sql}) AND rank = :rank AND step >= :lo AND step < :hi"
        else:
            k = B // w
            table, pos_col, key, grouped = roll, "bucket", f"bucket / {k}", k > 1
            where = f"series_id IN ({ids_sql}) AND rank = :rank AND width = {w} AND bucket >= :blo AND bucket < :bhi"
        exprs = _source_exprs(dialect, column, w > 1, grouped)
        if not grouped:
            cols = aggs + (["last"] if want_last else [])
            rows = fetch(conn, f"SELECT series_id, {pos_col}, {', '.join(exprs[c] for c in cols)} FROM {table} "
                               f"WHERE {where}", params)
            parts.append((seg_index, rows, cols))
            continue
        if aggs:
            rows = fetch(conn, f"SELECT series_id, {key}, {', '.join(exprs[c] for c in aggs)} FROM {table} "
                               f"WHERE {where} GROUP BY series_id, {key}", params)
            parts.append((seg_index, rows, aggs))
        if want_last:
            last_col = f"{column}_last" if w > 1 else column
            if dialect == "sqlite":  # bare columns come from the row of the single MAX()
                sql = (f"SELECT series_id, {key}, {last_col}, MAX({pos_col}) FROM {table} WHERE {where} "
                       f"GROUP BY series_id, {key}")
            else:
                sql = (f"SELECT DISTINCT ON (series_id, {key}) series_id, {key}, {last_col} FROM {table} "
                       f"WHERE {where} ORDER BY series_id, {key}, {pos_col} DESC")
            parts.append((seg_index, fetch(conn, sql, params), ["last"]))

    sorted_ids = np.array(sorted(series_ids), dtype=np.int64)
    row_of = np.empty(len(series_ids), dtype=np.int64)
    if series_ids:
        row_of[np.searchsorted(sorted_ids, np.array(series_ids, dtype=np.int64))] = np.arange(len(series_ids))

    n = np.zeros(size, dtype=np.int64)
    acc = {"max": np.full(size, -np.inf), "min": np.full(size, np.inf), "sum": np.zeros(size)}
    seen = {a: np.zeros(size, dtype=bool) for a in acc}
    last = np.full(size, np.nan)
    last_null = np.ones(size, dtype=bool)
    with np.errstate(invalid="ignore"):  # NaN meeting a number in maximum/minimum is the intent
        for seg_index, rows, cols in parts:
            if not rows:
                continue
            sid = np.array([r[0] for r in rows], dtype=np.int64)
            pos = np.array([r[1] for r in rows], dtype=np.int64)
            cell = row_of[np.searchsorted(sorted_ids, sid)] * n_cols + (pos - plan.first)
            for i, name in enumerate(cols, start=2):
                if name == "n":
                    np.add.at(n, cell, np.array([r[i] for r in rows], dtype=np.int64))
                    continue
                values, null = _column(rows, i)
                if name == "last":  # segments come in step order: a later one holds later steps
                    last[cell] = values
                    last_null[cell] = null
                    continue
                ok = ~null
                c, v = cell[ok], values[ok]
                seen[name][c] = True
                if name == "max":
                    np.maximum.at(acc["max"], c, v)  # maximum/minimum propagate NaN, as the rule wants
                elif name == "min":
                    np.minimum.at(acc["min"], c, v)
                else:
                    np.add.at(acc["sum"], c, v)
    out = {"n": n, "max": acc["max"], "min": acc["min"], "last": last}
    null = {"n": np.zeros(size, dtype=bool), "max": ~seen["max"], "min": ~seen["min"], "last": last_null}
    if "mean" in want:
        with np.errstate(invalid="ignore", divide="ignore"):
            out["mean"] = acc["sum"] / n
        null["mean"] = ~seen["sum"] | (n == 0)
    shape = (n_rows, n_cols)
    return Cells({k: v.reshape(shape) for k, v in out.items()}, {k: v.reshape(shape) for k, v in null.items()},
                  segments)


def step_range(ref: RunRef, start: int | None, end: int | None) -> tuple[int, int] | None:
    if start is not None and end is not None and start > end:
        raise BadParameter(f"start ({start}) must be <= end ({end})")
    if ref.last_step is None:
        return None
    lo = ref.first_step if start is None else start
    hi = ref.last_step if end is None else end
    if lo > hi:
        return None
    return lo, hi


def tensor_series_id(conn: Connection, ref: RunRef, layer: str, site: str) -> int:
    sid = conn.execute(select(TensorSeries.id).where(TensorSeries.run_id == ref.id, TensorSeries.layer == layer,
                                                     TensorSeries.site == site)).scalar()
    if sid is None:
        raise NotFound(f"run {ref.name!r} has no series for layer {layer!r} and site {site!r}")
    return sid


def _scalar_series_id(conn: Connection, ref: RunRef, scalar: str) -> int:
    sid = conn.execute(select(ScalarSeries.id).where(ScalarSeries.run_id == ref.id,
                                                     ScalarSeries.name == scalar)).scalar()
    if sid is None:
        raise NotFound(f"run {ref.name!r} has no scalar {scalar!r}")
    return sid


def worst_ranks(reported: list[int]) -> list[int]:
    """The ranks "worst over ranks" reads: the per-rank ones; the merged rank -1 only when it is the only one."""
    return [r for r in reported if r >= 0] or reported


def _largest(pairs: list[tuple[np.ndarray, np.ndarray]], shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Of (values, null) arrays, per cell the largest value (a NaN wins); null where every one is null."""
    best = np.full(shape, -np.inf)
    null = np.ones(shape, dtype=bool)
    for values, missing in pairs:
        with np.errstate(invalid="ignore"):
            best = np.maximum(best, np.where(missing, -np.inf, values))
        null = null & missing
    return best, null


def series(db: Database, name: str, *, stat: str | None = None, layer: str | None = None, site: str | None = None,
           scalar: str | None = None, rank: int | None = 0, start: int | None = None, end: int | None = None,
           max_points: int = 1000) -> Series:
    """One statistic of one layer x site (or one scalar) over [start, end]: raw points, or buckets. `rank` None:
    the worst over the series' ranks (worst_ranks): at each step the largest value (a NaN wins); in buckets,
    each aggregate the largest of the ranks' (count too)."""
    if scalar is not None:
        if stat is not None or layer is not None or site is not None:
            raise BadParameter("scalar: give either scalar, or stat with layer and site, not both")
        kind, column = "scalar", "value"
    else:
        for pname, value in (("stat", stat), ("layer", layer), ("site", site)):
            if value is None:
                raise BadParameter(f"{pname}: required (give stat, layer and site for a tensor statistic, "
                                   "or scalar for a scalar)")
        if stat not in TENSOR_STATS:
            raise BadParameter(f"stat: {stat!r} is not one of {', '.join(TENSOR_STATS)}")
        kind, column = "tensor", stat
    out: dict = {"run": name, "rank": rank, "stat": stat, "layer": layer, "site": site, "scalar": scalar}
    with db.reading() as conn:
        ref = run_ref(conn, name)
        sid = (_scalar_series_id(conn, ref, scalar) if kind == "scalar"
               else tensor_series_id(conn, ref, layer, site))
        ranks = [rank] if rank is not None else worst_ranks(series_ranks(conn, kind, ref.id).get(sid, []))
        out["ranks"] = ranks
        rng = step_range(ref, start, end)
        if rng is None or not ranks:
            out.update(start=start if rng is None else rng[0], end=end if rng is None else rng[1], bucket_width=1,
                       downsampled=False, points={"step": [], "value": []})
            return Series(**out)
        lo, hi = rng
        plan = plan_buckets(lo, hi, max_points)
        out.update(start=lo, end=hi, bucket_width=plan.width, downsampled=plan.width > 1)
        raw = KINDS[kind][0]
        if plan.width == 1:
            # MAX over ranks keeps a NaN: PostgreSQL sorts NaN above every number, SQLite stores it as TEXT 'NaN'
            # (above every number too)
            value = column if len(ranks) == 1 else f"MAX({column})"
            group = "" if len(ranks) == 1 else " GROUP BY step"
            rows = fetch(conn, f"SELECT step, {value} FROM {raw} WHERE series_id = :sid "
                               f"AND rank IN ({', '.join(str(int(r)) for r in ranks)}) AND step >= :lo "
                               f"AND step <= :hi AND {column} IS NOT NULL{group} ORDER BY step",
                         {"sid": sid, "lo": lo, "hi": hi})
            out["points"] = {"step": [r[0] for r in rows], "value": json_floats(_column(rows, 1)[0])}
            return Series(**out)
        per_rank = [aggregate(conn, kind, column, [sid], r, plan, ref.horizon, ("n", *AGGS)) for r in ranks]
    n = np.max([cells.values["n"][0] for cells in per_rank], axis=0)
    keep = np.flatnonzero(n > 0)
    points = {"step": np.maximum(plan.start, (plan.first + keep) * plan.width).tolist(), "count": n[keep].tolist()}
    for agg in AGGS:
        values, null = _largest([(cells.values[agg][0], cells.null[agg][0]) for cells in per_rank], n.shape)
        points[agg] = json_floats(values[keep], null[keep])
    out["points"] = points
    return Series(**out)


def _worst_cells(conn: Connection, stat: str, series_ids: list[int], ranks: list[int], plan: Plan, horizon: int,
                 agg: str) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the largest of the ranks' `agg` (a NaN on any rank wins); null where no rank reported."""
    per_rank = []
    for rank in ranks:
        cells = aggregate(conn, "tensor", stat, series_ids, rank, plan, horizon, (agg,))
        per_rank.append((cells.values[agg], cells.null[agg]))
    return _largest(per_rank, (len(series_ids), plan.columns))


def _matrix(conn: Connection, stat: str, series_ids: list[int], rank: int | None, ranks: list[int], plan: Plan,
            horizon: int, agg: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, null) of the series x the plan's buckets, on `rank` or (None) the worst over `ranks`."""
    if rank is None:
        return _worst_cells(conn, stat, series_ids, ranks, plan, horizon, agg)
    cells = aggregate(conn, "tensor", stat, series_ids, rank, plan, horizon, (agg,))
    return cells.values[agg], cells.null[agg]


SCORE_COLUMNS = 4  # columns of the coarse map that ranks the layers for `top` (agg max)


def heatmap(db: Database, name: str, *, stat: str, site: str, rank: int | None = 0, start: int | None = None,
            end: int | None = None, max_points: int = 1000, agg: str = "max", top: int | None = None,
            digits: int | None = None) -> Heatmap:
    """A layer x step-bucket matrix of one statistic at one site, layers in model order. `rank` None: each
    cell is the worst (largest) over the per-rank values (rank -1, the merged one, only when it is the only
    rank). `top`: only the `top` layers whose largest cell is largest, worst first (monitor.worst_layers).
    `digits`: values rounded to that many significant digits (None: as stored)."""
    if stat not in TENSOR_STATS:
        raise BadParameter(f"stat: {stat!r} is not one of {', '.join(TENSOR_STATS)}")
    if agg not in AGGS:
        raise BadParameter(f"agg: {agg!r} is not one of {', '.join(AGGS)}")
    out: dict = {"run": name, "stat": stat, "site": site, "rank": rank, "agg": agg, "top": top}
    with db.reading() as conn:
        ref = run_ref(conn, name)
        series_rows = conn.execute(select(TensorSeries.id, TensorSeries.layer).where(
            TensorSeries.run_id == ref.id, TensorSeries.site == site).order_by(TensorSeries.ordinal)).all()
        by_series = series_ranks(conn, "tensor", ref.id)
        run_ranks = sorted({r for row in series_rows for r in by_series.get(row.id, [])})
        ranks = [rank] if rank is not None else worst_ranks(run_ranks)
        out.update(ranks=ranks, run_ranks=run_ranks, layer_count=len(series_rows))
        rng = step_range(ref, start, end)
        if rng is None or not series_rows:
            rows = [] if top is not None else series_rows
            out.update(start=start if rng is None else rng[0], end=end if rng is None else rng[1], bucket_width=1,
                       downsampled=False, edges=[], layers=[r.layer for r in rows], values=[[] for _ in rows])
            return Heatmap(**out)
        per_series = max(1, len(ranks))
        if top is not None and agg == "max":
            # A row's largest cell is its largest value over the whole range, which a few coarse buckets give:
            # they rank the layers, and only the k worst are read at the map's resolution.
            coarse = plan_buckets(rng[0], rng[1], SCORE_COLUMNS, n_series=len(series_rows) * per_series)
            keep = worst_rows(*_matrix(conn, stat, [r.id for r in series_rows], rank, ranks, coarse, ref.horizon,
                                       agg), top)
            series_rows = [series_rows[i] for i in keep]
        plan = plan_buckets(rng[0], rng[1], max_points, n_series=max(1, len(series_rows)) * per_series)
        values, null = _matrix(conn, stat, [r.id for r in series_rows], rank, ranks, plan, ref.horizon, agg)
    if top is not None and agg != "max":
        keep = worst_rows(values, null, top)
        series_rows, values, null = [series_rows[i] for i in keep], values[keep], null[keep]
    if digits is not None:
        values = significant(values, digits)
    flat = json_floats(values.ravel(), null.ravel())
    cols = plan.columns
    out.update(start=plan.start, end=plan.end, bucket_width=plan.width, downsampled=plan.width > 1,
               edges=plan.edges(), layers=[r.layer for r in series_rows],
               values=[flat[i * cols:(i + 1) * cols] for i in range(len(series_rows))])
    return Heatmap(**out)
