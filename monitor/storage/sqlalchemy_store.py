"""`SqlAlchemyStore`: the AbstractStore on SQLite or PostgreSQL, through SQLAlchemy.

Each operation is a module function of this package over the store's `Database` (engines, transactions,
the writer lock); the store adds the ingest listeners and the ingest caches, and turns SQLAlchemy's errors
into InvalidData (a value the database refuses)
or StorageUnavailable (the database failed: retry).
"""

from __future__ import annotations

import functools
import logging
import threading
from datetime import datetime

from sqlalchemy.exc import DataError, IntegrityError, NotSupportedError, ProgrammingError, SQLAlchemyError

from fp8mon.agent.wire import TENSOR_STATS
from fp8mon.monitor import migrate
from fp8mon.monitor.storage import alerts, export, histograms, rollup, runs, series
from fp8mon.monitor.storage.abstract import AbstractStore, IngestListener
from fp8mon.monitor.storage.database import Database
from fp8mon.monitor.storage.entities import (
    AcknowledgedAlert,
    AlertPage,
    AlertWrite,
    Catalogue,
    CompactionReport,
    DeletedRun,
    Heatmap,
    Histograms,
    LatestSnapshot,
    PredictionPage,
    PredictionRecord,
    RecentRun,
    Run,
    RunAlertState,
    RunDetail,
    RunExport,
    RunPage,
    Series,
)
from fp8mon.monitor.storage.errors import InvalidData, StorageUnavailable
from fp8mon.monitor.storage.ingest import IngestWriter
from fp8mon.monitor.storage.run_status import DEFAULT_STALL, StallPolicy
from fp8mon.monitor.wire import IngestBatch, IngestResult

log = logging.getLogger("fp8mon.store")


class SqlAlchemyStore(AbstractStore):
    def __init__(self, url: str, *, pool_size: int = 8, stall: StallPolicy = DEFAULT_STALL):
        """`stall`: when a running run that sends nothing reads as stalled (storage.run_status)."""
        self.db = Database(url, pool_size=pool_size)
        self.stall = stall
        self._writer = IngestWriter(self.db)
        self._listeners: list[IngestListener] = []

    @property
    def dialect(self) -> str:
        return self.db.dialect

    @property
    def engine(self):
        """The writer engine (migrations and schema checks use it)."""
        return self.db.engine

    def close(self) -> None:
        self.db.close()

    def check_schema(self) -> None:
        migrate.check_schema(self.db.engine)

    # -- ingest ---------------------------------------------------------------------------------------

    def ingest(self, batch: IngestBatch) -> IngestResult:
        result = self._writer.ingest(batch)
        if result.run != batch.run:  # a new run under a suffixed name: the listeners key runs by stored name
            batch = batch.model_copy(update={"run": result.run})
        if not result.duplicate:
            for listener in self._listeners:
                try:
                    listener(batch, result)
                except Exception:  # the batch is stored: a listener's failure is not the client's
                    log.exception("ingest listener %r failed", listener)
        return result

    def add_ingest_listener(self, listener: IngestListener) -> None:
        self._listeners = [*self._listeners, listener]

    def remove_ingest_listener(self, listener: IngestListener) -> None:
        self._listeners = [fn for fn in self._listeners if fn is not listener]

    # -- runs -----------------------------------------------------------------------------------------

    def list_runs(self, *, status: list[str] | None = None, name: str | None = None,
                  tags: list[str] | None = None, created_since: datetime | None = None,
                  updated_since: datetime | None = None, order_by: str = "-created_at", limit: int = 50,
                  offset: int = 0) -> RunPage:
        return runs.list_runs(self.db, status=status, name=name, tags=tags, created_since=created_since,
                              updated_since=updated_since, order_by=order_by, limit=limit, offset=offset,
                              stall=self.stall)

    def get_run(self, name: str) -> RunDetail:
        return runs.get_run(self.db, name, self.stall)

    def find_run(self, name: str, run_id: str | None = None) -> Run | None:
        return runs.find_run(self.db, name, run_id)

    def patch_run(self, name: str, *, status: str | None = None, tags: dict | None = None,
                  config: dict | None = None) -> RunDetail:
        return runs.patch_run(self.db, name, status=status, tags=tags, config=config, stall=self.stall)

    def delete_run(self, name: str) -> DeletedRun:
        deleted = runs.delete_run(self.db, name)
        self._writer.forget_run(deleted.id)
        return deleted

    # -- statistics -----------------------------------------------------------------------------------

    def catalogue(self, name: str) -> Catalogue:
        return runs.catalogue(self.db, name)

    def latest(self, name: str, rank: int = 0) -> LatestSnapshot:
        return runs.latest(self.db, name, rank)

    def series(self, name: str, *, stat: str | None = None, layer: str | None = None, site: str | None = None,
               scalar: str | None = None, rank: int | None = 0, start: int | None = None, end: int | None = None,
               max_points: int = 1000) -> Series:
        return series.series(self.db, name, stat=stat, layer=layer, site=site, scalar=scalar, rank=rank,
                             start=start, end=end, max_points=max_points)

    def heatmap(self, name: str, *, stat: str, site: str, rank: int | None = 0, start: int | None = None,
                end: int | None = None, max_points: int = 1000, agg: str = "max", top: int | None = None,
                digits: int | None = None) -> Heatmap:
        return series.heatmap(self.db, name, stat=stat, site=site, rank=rank, start=start, end=end,
                              max_points=max_points, agg=agg, top=top, digits=digits)

    def histograms(self, name: str, *, layer: str, site: str, rank: int | None = 0, start: int | None = None,
                   end: int | None = None, max_points: int = 300) -> Histograms:
        return histograms.histograms(self.db, name, layer=layer, site=site, rank=rank, start=start, end=end,
                                     max_points=max_points)

    def export_rows(self, name: str, *, stats: tuple[str, ...] = TENSOR_STATS, hist: bool = True) -> RunExport:
        return export.export_rows(self.db, name, stats, hist)

    def compact(self, *, run_ids: list[int] | None = None, max_rows: int = rollup.MAX_ROWS_PER_CHUNK,
                lag: int = rollup.HORIZON_LAG, wait: bool = True,
                stop: threading.Event | None = None) -> CompactionReport:
        return rollup.compact(self.db, run_ids=run_ids, max_rows=max_rows, lag=lag, wait=wait, stop=stop)

    # -- alerts and predictions -----------------------------------------------------------------------

    def list_alerts(self, *, run: str | None = None, state: list[str] | None = None,
                    severity: list[str] | None = None, limit: int = 100, offset: int = 0) -> AlertPage:
        return alerts.list_alerts(self.db, run=run, state=state, severity=severity, limit=limit, offset=offset)

    def acknowledge_alert(self, alert_id: int) -> AcknowledgedAlert:
        return alerts.acknowledge(self.db, alert_id)

    def unacknowledge_alert(self, alert_id: int) -> AcknowledgedAlert:
        return alerts.unacknowledge(self.db, alert_id)

    def acknowledge_run_alerts(self, run: str, severity: list[str] | None = None) -> list[int]:
        return alerts.acknowledge_run(self.db, run, severity)

    def list_predictions(self, run: str, *, from_step: int | None = None, to_step: int | None = None,
                         limit: int = 1000) -> PredictionPage:
        return alerts.list_predictions(self.db, run, from_step=from_step, to_step=to_step, limit=limit)

    def latest_prediction(self, run: str) -> PredictionRecord:
        return alerts.latest_prediction(self.db, run)

    def run_alert_state(self, run_id: int) -> RunAlertState:
        return alerts.run_alert_state(self.db, run_id)

    def record_assessments(self, run_id: int, predictions: list[PredictionRecord], writes: list[AlertWrite],
                           alert_ids: dict[str, int]) -> dict[str, int]:
        return alerts.record_assessments(self.db, run_id, predictions, writes, alert_ids)

    def firing_counts(self, run: str) -> dict[str, int]:
        return alerts.firing_counts(self.db, run)

    def recent_runs(self, since: datetime, limit: int) -> list[RecentRun]:
        return alerts.recent_runs(self.db, since, limit)


def _translated(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (DataError, IntegrityError) as exc:  # a bad value: the same request fails again
            raise InvalidData(exc) from exc
        except (ProgrammingError, NotSupportedError):  # a bug of this server, not the database's state: a 500
            raise
        except SQLAlchemyError as exc:  # unreachable, locked, out of space, a lost connection: retry
            raise StorageUnavailable(exc) from exc

    return call


for _name in AbstractStore.__abstractmethods__ - {"close", "add_ingest_listener", "remove_ingest_listener"}:
    setattr(SqlAlchemyStore, _name, _translated(getattr(SqlAlchemyStore, _name)))
