"""Ingest: a batch's rows into the database. A batch is written in one transaction: the batch id, catalogue
entries, statistic rows and run bookkeeping commit together or not at all, so an acknowledged batch is
durable and a retried one is recognised. On SQLite, concurrent batches share a transaction (group commit);
each is acknowledged only once that transaction has committed.
"""

import itertools
import operator
import threading
from collections.abc import Iterable, Iterator
from datetime import datetime

import numpy as np
from sqlalchemy import BigInteger, Connection, bindparam, case, func, select, update

from fp8mon.monitor.models import IngestBatch as BatchRow
from fp8mon.monitor.models import Run, ScalarSeries, TensorSeries
from fp8mon.monitor.storage import bulk, identity
from fp8mon.monitor.storage.database import Database, utcnow
from fp8mon.monitor.wire import FINAL_STATUSES, IngestBatch, IngestResult, RunMeta, ScalarBlock, TensorBlock

SQLITE_MAX_GROUP = 8  # batches per group commit at most, which bounds the wait of its first batch


class IngestWriter:
    """Writes ingest batches; keeps the ids of runs and series it has committed, so a batch of known series
    costs no catalogue lookups."""

    def __init__(self, db: Database):
        self.db = db
        self.dialect = db.dialect
        self._claim_stmt = (db.insert(BatchRow).on_conflict_do_nothing(index_elements=["run_id", "batch_id"])
                            .returning(BatchRow.batch_id))
        self._lock = threading.Lock()
        self._queue: list[_Job] = []  # SQLite: batches waiting for the next group, guarded by _lock
        self._run_ids: dict[tuple[str, str], identity.RunIdentity] = {}  # by _run_key
        self._tensor_series: dict[int, dict[tuple[str, str], int]] = {}
        self._scalar_series: dict[int, dict[str, int]] = {}

    def forget_run(self, run_id: int) -> None:
        """Drop cached ids of a deleted run."""
        with self._lock:
            self._run_ids = {k: v for k, v in self._run_ids.items() if v.id != run_id}
            self._tensor_series.pop(run_id, None)
            self._scalar_series.pop(run_id, None)

    # -- ingest -------------------------------------------------------------------------------------

    def ingest(self, batch: IngestBatch) -> IngestResult:
        """Store a batch; it is committed (durable) when this returns."""
        if self.dialect != "sqlite":
            return self._write([batch])[0]
        # SQLite has one writer. Batches queue here; the thread that gets the writer lock writes the queue
        # in one transaction, taking in batches that arrive while it writes (group commit): the pages they
        # share, the tail of every series, go to the WAL once instead of once per batch. Threads wait on a
        # lock, not in SQLite's busy handler, which sleeps up to 100 ms per retry.
        job = _Job(batch)
        with self._lock:
            self._queue.append(job)
        with self.db.write_lock:
            # the writer takes the oldest queued batches, not always its own: a group that fails before it
            # reaches this thread's batch leaves that batch queued, so write groups until it is done
            while not job.done:
                self._write_queue()
        if job.error is not None:
            raise job.error
        return job.result

    def _write_queue(self) -> None:
        with self._lock:
            group = [self._queue.pop(0)]  # never empty: the calling thread's batch is queued until done
        try:
            batches = itertools.chain([group[0].batch], self._take_queued(group))
            for job, result in zip(group, self._write(batches)):
                job.result = result
        except Exception as exc:
            if len(group) == 1:
                group[0].error = exc
            else:  # nothing was committed; write them one by one, so a bad batch fails alone
                for job in group:
                    try:
                        job.result = self._write([job.batch])[0]
                    except Exception as error:
                        job.error = error
        finally:
            for job in group:
                job.done = True

    def _take_queued(self, group: list["_Job"]) -> Iterator[IngestBatch]:
        """More queued batches, oldest first, until the queue is empty or the group full; their jobs are
        appended to `group`."""
        while len(group) < SQLITE_MAX_GROUP:
            with self._lock:
                if not self._queue:
                    return
                job = self._queue.pop(0)
            group.append(job)
            yield job.batch

    def _write(self, batches: Iterable[IngestBatch]) -> list[IngestResult]:
        """Write batches in one transaction."""
        now = utcnow()
        run_ids: dict[tuple[str, str], identity.RunIdentity] = {}
        tensor_series: dict[int, dict[tuple[str, str], int]] = {}
        scalar_series: dict[int, dict[str, int]] = {}
        with self.db.engine.begin() as conn:
            results = [self._write_batch(conn, batch, now, run_ids, tensor_series, scalar_series)
                       for batch in batches]
        # Only committed ids enter the caches.
        with self._lock:
            self._run_ids.update(run_ids)
            for run_id, ids in tensor_series.items():
                self._tensor_series.setdefault(run_id, {}).update(ids)
            for run_id, ids in scalar_series.items():
                self._scalar_series.setdefault(run_id, {}).update(ids)
        return results

    def _write_batch(self, conn: Connection, batch: IngestBatch, now: datetime, run_ids: dict,
                     tensor_series: dict, scalar_series: dict) -> IngestResult:
        """`run_ids`, `tensor_series`, `scalar_series`: ids registered earlier in this transaction."""
        values = batch.value_count()
        key = _run_key(batch)
        run = run_ids.get(key) or self._run_ids.get(key) or identity.resolve(self.db, conn, batch, now)
        run_ids[key] = run
        run_id = run.id
        if not self._claim_batch(conn, run_id, batch.batch_id, values, now):
            return IngestResult(batch_id=batch.batch_id, run=run.name, run_id=run_id, run_uid=run.uid,
                                duplicate=True, tensor_records=0, scalar_records=0, values=0)
        steps: list[tuple[int, int]] = []
        if batch.tensors is not None:
            steps.append(self._write_tensors(conn, run_id, batch.tensors, tensor_series.setdefault(run_id, {})))
        if batch.scalars is not None:
            steps.append(self._write_scalars(conn, run_id, batch.scalars, scalar_series.setdefault(run_id, {})))
        self._touch_run(conn, run_id, steps, batch.run_meta, now)
        return IngestResult(batch_id=batch.batch_id, run=run.name, run_id=run_id, run_uid=run.uid, duplicate=False,
                            tensor_records=len(batch.tensors) if batch.tensors else 0,
                            scalar_records=len(batch.scalars) if batch.scalars else 0, values=values)

    def _insert_ignore(self, conn: Connection, model, rows: list[dict], keys: list[str]) -> None:
        conn.execute(self.db.insert(model).on_conflict_do_nothing(index_elements=keys), rows)

    def _claim_batch(self, conn: Connection, run_id: int, batch_id: str, values: int, now: datetime) -> bool:
        row = {"run_id": run_id, "batch_id": batch_id, "received_at": now, "n_values": values}
        return conn.execute(self._claim_stmt, row).first() is not None

    def _series_ids(self, conn, run_id, model, key_columns, columns: tuple[list, ...], cache, new) -> list[int]:
        """Map each record's catalogue key (from `columns`, one list per key column) to its series id,
        registering unseen keys in first-seen order."""
        known = {**cache.get(run_id, {}), **new}
        try:
            return list(map(known.__getitem__, _keys(columns)))
        except KeyError:
            pass
        unseen = [k for k in dict.fromkeys(_keys(columns)) if k not in known]
        rows = [dict(zip(key_columns, k if isinstance(k, tuple) else (k,))) for k in unseen]
        for row in rows:
            row["run_id"] = run_id
        if model is TensorSeries:
            # Concurrent first batches of a run (PostgreSQL) take turns here, so ordinals stay unique.
            # NO KEY UPDATE: the foreign-key checks of this transaction's inserts hold KEY SHARE on the row.
            conn.execute(select(Run.id).where(Run.id == run_id).with_for_update(key_share=True))
            base = conn.execute(select(func.coalesce(func.max(TensorSeries.ordinal), -1))
                                .where(TensorSeries.run_id == run_id)).scalar_one()
            for i, row in enumerate(rows):
                row["ordinal"] = base + 1 + i
        self._insert_ignore(conn, model, rows, ["run_id", *key_columns])
        cols = [getattr(model, c) for c in key_columns]
        for *key, sid in conn.execute(select(*cols, model.id).where(model.run_id == run_id)):
            key = tuple(key) if len(key) > 1 else key[0]
            known[key] = sid
            new[key] = sid
        return list(map(known.__getitem__, _keys(columns)))

    def _write_tensors(self, conn: Connection, run_id: int, block: TensorBlock, new: dict) -> tuple[int, int]:
        n = len(block)
        series = self._series_ids(conn, run_id, TensorSeries, ("layer", "site"), (block.layer, block.site),
                                  self._tensor_series, new)
        # Statistics the batch does not carry are left out: bulk.upsert writes them as NULL.
        data = {"series_id": series, "rank": _broadcast(block.rank, n), "step": _broadcast(block.step, n),
                **block.stats}
        if block.log2_hist is not None:
            data["log2_hist"] = [None if h is None else np.asarray(h, dtype="<i8").tobytes() for h in block.log2_hist]
        _sort_by_key(data)
        bulk.upsert(conn, "tensor_stats", bulk.TENSOR_COLUMNS, data)
        return min(data["step"]), max(data["step"])

    def _write_scalars(self, conn: Connection, run_id: int, block: ScalarBlock, new: dict) -> tuple[int, int]:
        n = len(block)
        series = self._series_ids(conn, run_id, ScalarSeries, ("name",), (block.name,), self._scalar_series, new)
        data = {"series_id": series, "rank": _broadcast(block.rank, n), "step": _broadcast(block.step, n),
                "value": block.value}
        _sort_by_key(data)
        bulk.upsert(conn, "scalars", bulk.SCALAR_COLUMNS, data)
        return min(data["step"]), max(data["step"])

    def _touch_run(self, conn: Connection, run_id: int, step_ranges, meta: RunMeta | None, now: datetime) -> None:
        if step_ranges and meta is None:  # the common case, one prepared statement
            conn.execute(_TOUCH_RUN, {"b_run": run_id, "b_now": now, "b_lo": min(r[0] for r in step_ranges),
                                      "b_hi": max(r[1] for r in step_ranges)})
            return
        values: dict = {"last_seen_at": now}
        if step_ranges:
            lo = min(r[0] for r in step_ranges)
            hi = max(r[1] for r in step_ranges)
            values.update(_step_bounds(lo, hi))
        if meta is not None:
            row = conn.execute(select(Run.tags, Run.config).where(Run.id == run_id)).one()
            if meta.tags is not None:
                values["tags"] = {**row.tags, **meta.tags}
            if meta.config is not None:
                values["config"] = meta.config
            if meta.status is not None:
                values["status"] = meta.status
                values["ended_at"] = now if meta.status in FINAL_STATUSES else None
        conn.execute(update(Run).where(Run.id == run_id).values(**values))


class _Job:
    """A batch queued for a SQLite group commit; `done` once its group was written or failed."""

    def __init__(self, batch: IngestBatch):
        self.batch = batch
        self.result: IngestResult | None = None
        self.error: Exception | None = None
        self.done = False


def _run_key(batch: IngestBatch) -> tuple[str, str]:
    """What a batch's run is found by: its run_id, else its name."""
    return ("id", batch.run_id) if batch.run_id is not None else ("name", batch.run)


def _keys(columns: tuple[list, ...]):
    """Records' catalogue keys: a name, or a tuple of names (zip reuses one tuple as map consumes them)."""
    return zip(*columns) if len(columns) > 1 else iter(columns[0])


def _broadcast(column: int | list[int], n: int) -> list[int]:
    return [column] * n if isinstance(column, int) else column


def _sort_by_key(data: dict[str, list]) -> None:
    """Rows in key order, unique: a key repeated inside one batch keeps its last record, as a later batch would."""
    n = len(data["step"])
    if n < 2:
        return
    series, rank, step = (np.asarray(data[c], dtype=np.int64) for c in bulk.KEY)
    order = np.lexsort((np.arange(n), step, rank, series))
    s, r, t = series[order], rank[order], step[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = (s[1:] != s[:-1]) | (r[1:] != r[:-1]) | (t[1:] != t[:-1])
    keep = order[last]
    if len(keep) == n and (keep[1:] > keep[:-1]).all():
        return
    pick = operator.itemgetter(*keep.tolist())
    for name, column in data.items():
        data[name] = list(pick(column)) if len(keep) > 1 else [column[keep[0]]]


def _step_bounds(lo, hi) -> dict:
    """SET clauses that widen the run's step range to [lo, hi] (numbers or bind parameters)."""
    return {
        # NULL compares as unknown, so a run's first batch takes the else branch.
        "first_step": case((Run.first_step < lo, Run.first_step), else_=lo),
        "last_step": case((Run.last_step > hi, Run.last_step), else_=hi),
        # A late batch below the rolled-up horizon marks the rollups from there as stale.
        "rollup_dirty_from": case(
            (Run.rollup_until <= lo, Run.rollup_dirty_from),
            (Run.rollup_dirty_from.is_(None), lo),
            (Run.rollup_dirty_from > lo, lo),
            else_=Run.rollup_dirty_from,
        ),
    }


_TOUCH_RUN = (update(Run).where(Run.id == bindparam("b_run"))
              .values(last_seen_at=bindparam("b_now", type_=Run.last_seen_at.type),
                      **_step_bounds(bindparam("b_lo", type_=BigInteger), bindparam("b_hi", type_=BigInteger))))
