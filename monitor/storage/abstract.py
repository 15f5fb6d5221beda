"""The storage interface of the monitor: every read and write of the server goes through an `AbstractStore`.

Operations return the typed entities of storage.entities (never ORM rows); a missing run or alert raises
storage.errors.NotFound, an invalid argument BadParameter, a value the database refuses InvalidData (422),
a failing database StorageUnavailable (503: retry).
`AlertStore` is the part the prediction pipeline needs, so that it can be given a store (or a fake) without
the rest.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import datetime

from fp8mon.agent.wire import TENSOR_STATS
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
from fp8mon.monitor.storage.rollup import HORIZON_LAG, MAX_ROWS_PER_CHUNK
from fp8mon.monitor.wire import IngestBatch, IngestResult

IngestListener = Callable[[IngestBatch, IngestResult], object]


class AlertStore(ABC):
    """What the prediction pipeline reads and writes."""

    @abstractmethod
    def run_alert_state(self, run_id: int) -> RunAlertState:
        """The run's config and its pending and firing alerts."""

    @abstractmethod
    def record_assessments(self, run_id: int, predictions: list[PredictionRecord], writes: list[AlertWrite],
                           alert_ids: dict[str, int]) -> dict[str, int]:
        """Store predictions (one per step, a later one replacing) and alert writes in one transaction.
        `alert_ids` maps the fingerprints of the run's active alerts to their rows; returns the new map."""

    @abstractmethod
    def firing_counts(self, run: str) -> dict[str, int]:
        """The run's firing alerts that count (not acknowledged) per severity, zeros included."""

    @abstractmethod
    def recent_runs(self, since: datetime, limit: int) -> list[RecentRun]:
        """Runs seen since `since` that have not ended, most recent first."""


class AbstractStore(AlertStore):
    # -- ingest ---------------------------------------------------------------------------------------

    @abstractmethod
    def ingest(self, batch: IngestBatch) -> IngestResult:
        """Store a batch; it is committed (durable) when this returns. A batch id stored before is
        acknowledged as a duplicate and writes nothing."""

    @abstractmethod
    def add_ingest_listener(self, listener: IngestListener) -> None:
        """`listener(batch, result)` runs in the ingesting thread after each stored, non-duplicate batch has
        committed; it must return at once (hand work to a thread). Its exceptions are logged, never raised."""

    @abstractmethod
    def remove_ingest_listener(self, listener: IngestListener) -> None: ...

    # -- runs -----------------------------------------------------------------------------------------

    @abstractmethod
    def list_runs(self, *, status: list[str] | None = None, name: str | None = None,
                  tags: list[str] | None = None, created_since: datetime | None = None,
                  updated_since: datetime | None = None, order_by: str = "-created_at", limit: int = 50,
                  offset: int = 0) -> RunPage:
        """Runs matching every filter given: `name` a substring or a glob (* and ?), case-insensitive; `tags`
        items "key=value" or "key"; `order_by` a field, "-" prefixed for descending. Each run comes as a RunSummary: its firing alerts
        per severity (all of them) and its latest risk."""

    @abstractmethod
    def get_run(self, name: str) -> RunDetail: ...

    @abstractmethod
    def find_run(self, name: str, run_id: str | None = None) -> Run | None:
        """The run that a batch with this name and run_id would go to (docs/wire-format.md, "Run identity"); None
        when such a batch would create one."""

    @abstractmethod
    def patch_run(self, name: str, *, status: str | None = None, tags: dict | None = None,
                  config: dict | None = None) -> RunDetail:
        """Status, tags (merged into the run's tags, as ingest does) and config (replaced)."""

    @abstractmethod
    def delete_run(self, name: str) -> DeletedRun:
        """The run and everything stored for it."""

    # -- statistics -----------------------------------------------------------------------------------

    @abstractmethod
    def catalogue(self, name: str) -> Catalogue: ...

    @abstractmethod
    def latest(self, name: str, rank: int = 0) -> LatestSnapshot:
        """Every statistic of every layer x site (and every scalar) at that series' last step on `rank`."""

    @abstractmethod
    def series(self, name: str, *, stat: str | None = None, layer: str | None = None, site: str | None = None,
               scalar: str | None = None, rank: int | None = 0, start: int | None = None, end: int | None = None,
               max_points: int = 1000) -> Series:
        """One statistic of one layer x site (or one scalar) over [start, end]: raw points, or buckets;
        `rank` None: the worst (largest) over the series' ranks."""

    @abstractmethod
    def heatmap(self, name: str, *, stat: str, site: str, rank: int | None = 0, start: int | None = None,
                end: int | None = None, max_points: int = 1000, agg: str = "max", top: int | None = None,
                digits: int | None = None) -> Heatmap:
        """A layer x step-bucket matrix of one statistic at one site, layers in model order; `rank` None:
        each cell the worst (largest) over the run's ranks; `top`: only the k layers with the largest cells,
        worst first; `digits`: values rounded to that many significant digits."""

    @abstractmethod
    def histograms(self, name: str, *, layer: str, site: str, rank: int | None = 0, start: int | None = None,
                   end: int | None = None, max_points: int = 300) -> Histograms:
        """The stored log2 histograms of one layer x site over [start, end], at most `max_points` columns (more
        are summed), with the scales in use. `rank` None: each step's histograms summed over the run's ranks (the
        merged rank -1 only if it is the only one)."""

    @abstractmethod
    def export_rows(self, name: str, *, stats: tuple[str, ...] = TENSOR_STATS, hist: bool = True) -> RunExport:
        """The run's stored rows in step order (monitor.export makes wire batches of them)."""

    @abstractmethod
    def compact(self, *, run_ids: list[int] | None = None, max_rows: int = MAX_ROWS_PER_CHUNK,
                lag: int = HORIZON_LAG, wait: bool = True, stop: threading.Event | None = None) -> CompactionReport:
        """Bring the rollups of every run (or of `run_ids`) up to date; with `wait` false, a run another
        compactor is working on is skipped."""

    # -- alerts and predictions -----------------------------------------------------------------------

    @abstractmethod
    def list_alerts(self, *, run: str | None = None, state: list[str] | None = None,
                    severity: list[str] | None = None, limit: int = 100, offset: int = 0) -> AlertPage:
        """Most recently updated first."""

    @abstractmethod
    def acknowledge_alert(self, alert_id: int) -> AcknowledgedAlert:
        """Idempotent: the first acknowledgement's time is kept; the lifecycle goes on."""

    @abstractmethod
    def unacknowledge_alert(self, alert_id: int) -> AcknowledgedAlert:
        """Undo an acknowledgement: the alert counts among the run's firing alerts again."""

    @abstractmethod
    def acknowledge_run_alerts(self, run: str, severity: list[str] | None = None) -> list[int]:
        """Acknowledge every unacknowledged pending or firing alert of the run (of these severities); their
        ids."""

    @abstractmethod
    def list_predictions(self, run: str, *, from_step: int | None = None, to_step: int | None = None,
                         limit: int = 1000) -> PredictionPage:
        """In step order: from from_step on, or the last `limit` ones up to to_step."""

    @abstractmethod
    def latest_prediction(self, run: str) -> PredictionRecord: ...

    @abstractmethod
    def check_schema(self) -> None:
        """Raise migrate.SchemaError unless the database is at the schema this version of fp8mon needs."""

    @abstractmethod
    def close(self) -> None: ...
