"""The storage interface: every read and write of the monitor goes through `Store`.

SQLAlchemy Core behind it, SQLite or PostgreSQL. Ingest is one transaction per batch: the batch id,
catalogue entries, statistic rows and run bookkeeping commit together or not at all, so an acknowledged
batch is durable and a retried one is recognised.
"""

import threading
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import Connection, Engine, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from agent.wire import TENSOR_STATS
from monitor import bulk
from monitor.db import create_db_engine
from monitor.models import IngestBatch as BatchRow
from monitor.models import Run, ScalarSeries, TensorSeries
from monitor.schemas import IngestBatch, IngestResult, RunMeta, ScalarBlock, TensorBlock

FINAL_STATUSES = ("finished", "failed", "diverged")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Store:
    def __init__(self, url: str, *, pool_size: int = 8):
        self.engine: Engine = create_db_engine(url, pool_size=pool_size)
        # SQLite readers run deferred transactions on their own pool; PostgreSQL shares one engine.
        self.read_engine: Engine = (create_db_engine(url, writer=False) if self.engine.dialect.name == "sqlite"
                                    else self.engine)
        self._lock = threading.Lock()
        self._run_ids: dict[str, int] = {}
        self._tensor_series: dict[int, dict[tuple[str, str], int]] = {}
        self._scalar_series: dict[int, dict[str, int]] = {}

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    def forget_run(self, run_id: int) -> None:
        """Drop cached ids of a deleted run."""
        with self._lock:
            self._run_ids = {k: v for k, v in self._run_ids.items() if v != run_id}
            self._tensor_series.pop(run_id, None)
            self._scalar_series.pop(run_id, None)

    # -- ingest -------------------------------------------------------------------------------------

    def ingest(self, batch: IngestBatch) -> IngestResult:
        now = utcnow()
        values = batch.value_count()
        new_tensor_series: dict[tuple[str, str], int] = {}
        new_scalar_series: dict[str, int] = {}
        with self.engine.begin() as conn:
            run_id = self._run_id(conn, batch.run, now)
            if not self._claim_batch(conn, run_id, batch.batch_id, values, now):
                return IngestResult(batch_id=batch.batch_id, run=batch.run, run_id=run_id, duplicate=True,
                                    tensor_records=0, scalar_records=0, values=0)
            steps: list[int] = []
            if batch.tensors is not None:
                steps.append(self._write_tensors(conn, run_id, batch.tensors, new_tensor_series))
            if batch.scalars is not None:
                steps.append(self._write_scalars(conn, run_id, batch.scalars, new_scalar_series))
            self._touch_run(conn, run_id, steps, batch.run_meta, now)
        # Only committed ids enter the caches.
        with self._lock:
            self._run_ids[batch.run] = run_id
            self._tensor_series.setdefault(run_id, {}).update(new_tensor_series)
            self._scalar_series.setdefault(run_id, {}).update(new_scalar_series)
        return IngestResult(batch_id=batch.batch_id, run=batch.run, run_id=run_id, duplicate=False,
                            tensor_records=len(batch.tensors) if batch.tensors else 0,
                            scalar_records=len(batch.scalars) if batch.scalars else 0, values=values)

    def _insert_ignore(self, conn: Connection, model, rows: list[dict], keys: list[str]) -> None:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        conn.execute(dialect.insert(model).on_conflict_do_nothing(index_elements=keys), rows)

    def _run_id(self, conn: Connection, name: str, now: datetime) -> int:
        run_id = self._run_ids.get(name)
        if run_id is not None:
            return run_id
        self._insert_ignore(conn, Run, [{"name": name, "status": "running", "config": {}, "tags": {},
                                         "created_at": now, "started_at": now, "rollup_until": 0}], ["name"])
        return conn.execute(select(Run.id).where(Run.name == name)).scalar_one()

    def _claim_batch(self, conn: Connection, run_id: int, batch_id: str, values: int, now: datetime) -> bool:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        stmt = dialect.insert(BatchRow).values(run_id=run_id, batch_id=batch_id, received_at=now, n_values=values)
        stmt = stmt.on_conflict_do_nothing(index_elements=["run_id", "batch_id"]).returning(BatchRow.batch_id)
        return conn.execute(stmt).first() is not None

    def _series_ids(self, conn, run_id, model, key_columns, keys, cache, new) -> list[int]:
        """Map each record's catalogue key to its series id, registering unseen keys in first-seen order."""
        known = {**cache.get(run_id, {}), **new}
        unseen = [k for k in dict.fromkeys(keys) if k not in known]
        if unseen:
            rows = [dict(zip(key_columns, k if isinstance(k, tuple) else (k,))) for k in unseen]
            for row in rows:
                row["run_id"] = run_id
            if model is TensorSeries:
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
        return [known[k] for k in keys]

    def _write_tensors(self, conn: Connection, run_id: int, block: TensorBlock, new: dict) -> tuple[int, int]:
        n = len(block)
        keys = list(zip(block.layer, block.site))
        series = self._series_ids(conn, run_id, TensorSeries, ("layer", "site"), keys, self._tensor_series, new)
        data = {"series_id": series, "rank": _broadcast(block.rank, n), "step": _broadcast(block.step, n)}
        missing = [None] * n
        for name in TENSOR_STATS:
            data[name] = block.stats.get(name, missing)
        hist = block.log2_hist
        data["log2_hist"] = ([None if h is None else np.asarray(h, dtype="<i8").tobytes() for h in hist]
                             if hist is not None else missing)
        _keep_last_per_key(data)
        bulk.upsert(conn, "tensor_stats", bulk.TENSOR_COLUMNS, data)
        return min(data["step"]), max(data["step"])

    def _write_scalars(self, conn: Connection, run_id: int, block: ScalarBlock, new: dict) -> tuple[int, int]:
        n = len(block)
        series = self._series_ids(conn, run_id, ScalarSeries, ("name",), block.name, self._scalar_series, new)
        data = {"series_id": series, "rank": _broadcast(block.rank, n), "step": _broadcast(block.step, n),
                "value": block.value}
        _keep_last_per_key(data)
        bulk.upsert(conn, "scalars", bulk.SCALAR_COLUMNS, data)
        return min(data["step"]), max(data["step"])

    def _touch_run(self, conn: Connection, run_id: int, step_ranges, meta: RunMeta | None, now: datetime) -> None:
        values: dict = {"last_seen_at": now}
        if step_ranges:
            lo = min(r[0] for r in step_ranges)
            hi = max(r[1] for r in step_ranges)
            # NULL compares as unknown, so a run's first batch takes the else branch.
            values["first_step"] = case((Run.first_step < lo, Run.first_step), else_=lo)
            values["last_step"] = case((Run.last_step > hi, Run.last_step), else_=hi)
            # A late batch below the rolled-up horizon marks the rollups from there as stale.
            values["rollup_dirty_from"] = _case_dirty(lo)
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


def _broadcast(column: int | list[int], n: int) -> list[int]:
    return [column] * n if isinstance(column, int) else column


def _keep_last_per_key(data: dict[str, list]) -> None:
    """A key repeated inside one batch keeps its last record, as a later batch would."""
    keys = list(zip(data["series_id"], data["rank"], data["step"]))
    if len(set(keys)) == len(keys):
        return
    last = {k: i for i, k in enumerate(keys)}
    keep = sorted(last.values())
    for name, column in data.items():
        data[name] = [column[i] for i in keep]


def _case_dirty(lo: int):
    return case(
        (Run.rollup_until <= lo, Run.rollup_dirty_from),
        (Run.rollup_dirty_from.is_(None), lo),
        (Run.rollup_dirty_from > lo, lo),
        else_=Run.rollup_dirty_from,
    )
