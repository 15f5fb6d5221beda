"""The downsampling pyramid: a compactor that fills tensor_rollups / scalar_rollups.

Level w (every width of ROLLUP_WIDTHS) holds one row per (series, rank, bucket) with bucket b covering
steps [b*w, (b+1)*w): step_first, step_last, count (rows) and per statistic min, max, sum, n, last.
Width 16 is computed from the raw rows, each wider level from the level below it (widths are x4 apart).

Horizon. `runs.rollup_until` (a multiple of 16) is the one number that says what is valid: level w holds
every complete bucket below (rollup_until // w) * w, reflecting the raw rows. Ingest sets
`runs.rollup_dirty_from` when a batch lands below rollup_until; queries then trust the rollups only below
min(rollup_until, rollup_dirty_from) and the compactor recomputes from there. The compactor aims at
(last_step - HORIZON_LAG) // 16 * 16: buckets are rolled up once the run has moved past them, and the lag
keeps ranks or layers that arrive in separate batches from dirtying a bucket just compacted.

NaN semantics, per bucket and statistic: n counts the reported values (NaN and +-Inf included); if any of
them is NaN then min, max and sum (so the mean) are NaN, so a NaN stays visible at every zoom level; +-Inf
take part in min/max/sum as IEEE numbers (+Inf and -Inf together give a NaN sum); `last` is the value at
the bucket's last step (step_last), NULL when that row did not report the statistic. A bucket with n = 0
has NULL min/max/sum. In SQLite a NaN is the TEXT 'NaN' in the REAL column (see storage.bulk).

Concurrency. Work is done per run in short transactions ("chunks" of about MAX_ROWS_PER_CHUNK raw rows):
each deletes and re-inserts the affected buckets of every level and advances rollup_until, so a crash
or a second compactor leaves nothing half done and running it twice changes nothing. On PostgreSQL a
compactor takes an advisory lock on the run (the background one skips a run another compactor holds)
and locks the runs row FOR UPDATE, so an ingest that commits while a chunk is computed sees the new
horizon and marks the run dirty; on SQLite the writer lock (BEGIN IMMEDIATE) serialises everything.
The background thread that calls `compact` lives in monitor.compactor.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import Connection, text

from fp8mon.agent.wire import TENSOR_STATS
from fp8mon.monitor.models import ROLLUP_WIDTHS
from fp8mon.monitor.storage.database import Database
from fp8mon.monitor.storage.entities import CompactionReport

BASE_WIDTH = ROLLUP_WIDTHS[0]
HORIZON_LAG = 32
MAX_ROWS_PER_CHUNK = 100_000

# (raw table, rollup table, statistic columns)
KINDS = {
    "tensor": ("tensor_stats", "tensor_rollups", "tensor_series", TENSOR_STATS),
    "scalar": ("scalars", "scalar_rollups", "scalar_series", ("value",)),
}


def effective_horizon(rollup_until: int, dirty_from: int | None) -> int:
    """Steps below this are summarised correctly at the base level (rollup_until, lowered by a late batch)."""
    h = rollup_until if dirty_from is None else min(rollup_until, dirty_from)
    return max(0, h // BASE_WIDTH * BASE_WIDTH)


def level_cover(horizon: int, width: int) -> int:
    """Level `width` holds every bucket below this step."""
    return horizon // width * width


# -- SQL -------------------------------------------------------------------------------------------


def sql_nan(dialect: str) -> str:
    return "'NaN'" if dialect == "sqlite" else "CAST('NaN' AS DOUBLE PRECISION)"


def sql_is_nan(dialect: str, expr: str) -> str:
    """True when an aggregated MAX is NaN: SQLite sorts the TEXT 'NaN' above numbers, PostgreSQL sorts NaN last."""
    return f"typeof({expr}) = 'text'" if dialect == "sqlite" else f"{expr} = {sql_nan(dialect)}"


def _id_list(ids) -> str:
    return ", ".join(str(int(i)) for i in ids)


def level_insert_sql(dialect: str, kind: str, width: int, child: int | None, series_ids, ranks) -> str:
    """INSERT of the level-`width` buckets of raw steps [:lo, :hi) (child None), or of the level-`child`
    buckets [:clo, :chi) (child level)."""
    raw, roll, _, stats = KINDS[kind]
    agg_cols = [f"{s}_{a}" for s in stats for a in ("min", "max", "sum", "n", "last")]
    where = f"series_id IN ({_id_list(series_ids)}) AND rank IN ({_id_list(ranks)})"
    if child is None:
        inner = [f"MIN({s}) AS {s}_mn, MAX({s}) AS {s}_mx, SUM({s}) AS {s}_s, COUNT({s}) AS {s}_c" for s in stats]
        source = (f"SELECT series_id, rank, step / {width} AS b, MIN(step) AS sf, MAX(step) AS sl, COUNT(*) AS cnt, "
                  f"{', '.join(inner)} FROM {raw} WHERE {where} AND step >= :lo AND step < :hi "
                  f"GROUP BY series_id, rank, step / {width}")
        join = f"JOIN {raw} t ON t.series_id = g.series_id AND t.rank = g.rank AND t.step = g.sl"
        last = {s: f"t.{s}" for s in stats}
    else:
        k = width // child
        # A child's sum can be NaN without a NaN value (+Inf and -Inf): SQLite's SUM skips the TEXT 'NaN', so
        # MAX(sum) (TEXT sorts last) carries that into the flag.
        sum_max = {s: f", MAX({s}_sum) AS {s}_sx" if dialect == "sqlite" else "" for s in stats}
        inner = [f"MIN({s}_min) AS {s}_mn, MAX({s}_max) AS {s}_mx, SUM({s}_sum) AS {s}_s, SUM({s}_n) AS {s}_c"
                 f"{sum_max[s]}" for s in stats]
        source = (f"SELECT series_id, rank, bucket / {k} AS b, MIN(step_first) AS sf, MAX(step_last) AS sl, "
                  f"SUM(count) AS cnt, MAX(bucket) AS lb, {', '.join(inner)} FROM {roll} "
                  f"WHERE {where} AND width = {child} AND bucket >= :clo AND bucket < :chi "
                  f"GROUP BY series_id, rank, bucket / {k}")
        join = (f"JOIN {roll} t ON t.series_id = g.series_id AND t.rank = g.rank AND t.width = {child} "
                f"AND t.bucket = g.lb")
        last = {s: f"t.{s}_last" for s in stats}
    nan = sql_nan(dialect)
    outer = []
    for s in stats:
        flag = sql_is_nan(dialect, f"g.{s}_mx")
        sum_flag = f" OR {sql_is_nan(dialect, f'g.{s}_sx')}" if child is not None and dialect == "sqlite" else ""
        outer += [
            f"CASE WHEN {flag} THEN {nan} ELSE g.{s}_mn END",
            f"g.{s}_mx",
            # SQLite's SUM skips the TEXT 'NaN' and returns NULL for +Inf + -Inf: both are NaN here.
            f"CASE WHEN {flag}{sum_flag} OR (g.{s}_s IS NULL AND g.{s}_c > 0) THEN {nan} ELSE g.{s}_s END",
            f"g.{s}_c",
            last[s],
        ]
    return (f"INSERT INTO {roll} (series_id, rank, width, bucket, step_first, step_last, count, "
            f"{', '.join(agg_cols)}) SELECT g.series_id, g.rank, {width}, g.b, g.sf, g.sl, g.cnt, "
            f"{', '.join(outer)} FROM ({source}) g {join}")


def series_ranks(conn: Connection, kind: str, run_id: int) -> dict[int, list[int]]:
    """{series id: ranks with rows}, by index seeks only (a loose index scan over (series_id, rank))."""
    raw, _, series_table, _ = KINDS[kind]
    sql = text(
        f"WITH RECURSIVE r(sid, rk) AS ("
        f" SELECT s.id, (SELECT MIN(t.rank) FROM {raw} t WHERE t.series_id = s.id) FROM {series_table} s"
        f" WHERE s.run_id = :run"
        f" UNION ALL"
        f" SELECT r.sid, (SELECT MIN(t.rank) FROM {raw} t WHERE t.series_id = r.sid AND t.rank > r.rk)"
        f" FROM r WHERE r.rk IS NOT NULL)"
        f" SELECT sid, rk FROM r WHERE rk IS NOT NULL")
    out: dict[int, list[int]] = {}
    for sid, rank in conn.execute(sql, {"run": run_id}):
        out.setdefault(sid, []).append(rank)
    return out


def next_data_step(conn: Connection, run_id: int, pairs: dict[str, dict[int, list[int]]], at: int) -> int | None:
    """The first step >= `at` with a row in any series of the run (index seeks, one per series and rank)."""
    found = []
    for kind, ranks_by_series in pairs.items():
        raw, _, series_table, _ = KINDS[kind]
        for rank in sorted({r for rs in ranks_by_series.values() for r in rs}):
            found.append(conn.execute(text(
                f"SELECT MIN((SELECT MIN(t.step) FROM {raw} t WHERE t.series_id = s.id AND t.rank = :rank "
                f"AND t.step >= :at)) FROM {series_table} s WHERE s.run_id = :run"),
                {"rank": rank, "at": at, "run": run_id}).scalar())
    found = [f for f in found if f is not None]
    return min(found) if found else None


# -- compaction ------------------------------------------------------------------------------------


_BUSY = object()


# The first key is the OID of this schema's runs table, so that monitors sharing a PostgreSQL database in
# different schemas (tests do) do not lock each other's runs.
_PG_LOCK_KEY = "CAST(CAST(CAST(CAST('runs' AS regclass) AS oid) AS bigint) % 2147483647 AS integer)"


def _lock_run(conn: Connection, run_id: int, wait: bool):
    if conn.dialect.name == "postgresql":
        if wait:
            conn.execute(text(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY}, :run)"), {"run": run_id})
        elif not conn.execute(text(f"SELECT pg_try_advisory_xact_lock({_PG_LOCK_KEY}, :run)"),
                              {"run": run_id}).scalar_one():
            return _BUSY
        return conn.execute(text("SELECT rollup_until, rollup_dirty_from, last_step FROM runs WHERE id = :run "
                                 "FOR UPDATE"), {"run": run_id}).first()
    return conn.execute(text("SELECT rollup_until, rollup_dirty_from, last_step FROM runs WHERE id = :run"),
                        {"run": run_id}).first()


def compact_chunk(conn: Connection, run_id: int, *, max_rows: int = MAX_ROWS_PER_CHUNK,
                  lag: int = HORIZON_LAG, wait: bool = True) -> tuple[str, int]:
    """One transaction's worth of work on one run (the caller owns the transaction).

    Returns (state, buckets written), state one of "done" (nothing (more) to do), "more", or "busy" (another
    compactor holds the run and `wait` is false)."""
    row = _lock_run(conn, run_id, wait)
    if row is _BUSY:
        return "busy", 0
    if row is None or row.last_step is None:
        return "done", 0
    until, dirty, last = int(row.rollup_until), row.rollup_dirty_from, int(row.last_step)
    target = max(0, (last - lag) // BASE_WIDTH * BASE_WIDTH)
    if dirty is None and target <= until:
        return "done", 0
    lo = effective_horizon(until, dirty)
    goal = max(target, until)
    pairs = {kind: series_ranks(conn, kind, run_id) for kind in KINDS}
    n_pairs = sum(len(r) for ranks in pairs.values() for r in ranks.values())
    step_budget = max(BASE_WIDTH, max_rows // max(1, n_pairs) // BASE_WIDTH * BASE_WIDTH)
    hi = min(goal, lo + step_budget)
    if hi < goal:  # stretch the chunk over steps without data (a resumed run may jump far ahead)
        nxt = next_data_step(conn, run_id, pairs, hi)
        hi = goal if nxt is None else min(goal, max(hi, nxt // BASE_WIDTH * BASE_WIDTH))
    dialect = conn.dialect.name
    written = 0
    if hi > lo:
        for kind, ranks_by_series in pairs.items():
            if not ranks_by_series:
                continue
            ids = sorted(ranks_by_series)
            ranks = sorted({r for rs in ranks_by_series.values() for r in rs})
            _, roll, _, _ = KINDS[kind]
            child = None
            for width in ROLLUP_WIDTHS:
                blo, bhi = lo // width, hi // width
                if bhi <= blo:
                    break  # no complete bucket at this width, nor at any wider one
                conn.execute(text(f"DELETE FROM {roll} WHERE series_id IN ({_id_list(ids)}) "
                                  f"AND rank IN ({_id_list(ranks)}) AND width = {width} "
                                  f"AND bucket >= :blo AND bucket < :bhi"), {"blo": blo, "bhi": bhi})
                params = {"lo": blo * width, "hi": bhi * width}
                if child is not None:
                    params = {"clo": blo * width // child, "chi": bhi * width // child}
                result = conn.execute(text(level_insert_sql(dialect, kind, width, child, ids, ranks)), params)
                written += max(result.rowcount or 0, 0)
                child = width
    conn.execute(text("UPDATE runs SET rollup_until = :hi, rollup_dirty_from = NULL WHERE id = :run"),
                 {"hi": hi, "run": run_id})
    return ("more" if hi < goal else "done"), written


def runs_needing_compaction(conn: Connection, lag: int = HORIZON_LAG) -> list[int]:
    return list(conn.execute(
        text("SELECT id FROM runs WHERE last_step IS NOT NULL AND "
             "(rollup_dirty_from IS NOT NULL OR last_step - :lag >= rollup_until + :w) ORDER BY id"),
        {"lag": lag, "w": BASE_WIDTH}).scalars())


def compact(db: Database, *, run_ids: list[int] | None = None, max_rows: int = MAX_ROWS_PER_CHUNK,
            lag: int = HORIZON_LAG, wait: bool = True, stop: threading.Event | None = None) -> CompactionReport:
    """Bring the rollups of every run (or of `run_ids`) up to date, synchronously. Safe to run concurrently:
    with `wait`, a run another compactor is working on is waited for, else skipped (the background thread)."""
    t0 = time.perf_counter()
    report = CompactionReport()
    if run_ids is None:
        with db.read_engine.connect() as conn:  # SQLite: the writer engine's BEGIN IMMEDIATE would lock
            run_ids = runs_needing_compaction(conn, lag)
    for run_id in run_ids:
        report.runs += 1
        while stop is None or not stop.is_set():
            # SQLite: ingest threads of this process queue on the writer lock (a group commit) rather than in
            # SQLite's busy handler while a chunk holds the database's write lock.
            with db.writing() as conn:
                state, written = compact_chunk(conn, run_id, max_rows=max_rows, lag=lag, wait=wait)
            report.buckets += written
            if state == "busy":
                report.skipped_busy += 1
                break
            report.chunks += 1
            if state == "done":
                break
    report.seconds = time.perf_counter() - t0
    return report
