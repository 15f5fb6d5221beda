"""What the store returns: plain dataclasses, never ORM rows, so nothing above the store holds a connection.

`to_dict()` gives the JSON payload of the REST API (timestamps as ISO 8601 strings, non-finite floats in
user JSON as "NaN"/"Infinity" strings; the series and heatmap values are JSON-ready already)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime

from fp8mon.monitor.jsonvalues import json_safe


def _iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.isoformat()


class _Entity:
    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value):
    if isinstance(value, _Entity):
        return value.to_dict()
    if isinstance(value, list) and value and isinstance(value[0], _Entity):
        return [v.to_dict() for v in value]
    return value


# -- runs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run(_Entity):
    id: int
    uid: str  # the run's unique id (the agent's run_id); `name` is unique too
    name: str
    status: str  # as the user reads it (storage.run_status): stalled and server-seen divergence included
    config: dict
    tags: dict
    created_at: datetime  # timestamps are aware, in UTC
    started_at: datetime | None
    ended_at: datetime | None
    last_seen_at: datetime | None
    first_step: int | None
    last_step: int | None
    reported_status: str | None = None  # as the client reported (or a user patched) it
    report_interval_s: float | None = None  # mean seconds between the run's batches; None: fewer than two

    def to_dict(self) -> dict:
        return {"id": self.id, "uid": self.uid, "name": self.name, "status": self.status,
                "config": json_safe(self.config),
                "tags": json_safe(self.tags), "created_at": _iso(self.created_at),
                "started_at": _iso(self.started_at), "ended_at": _iso(self.ended_at),
                "last_seen_at": _iso(self.last_seen_at), "first_step": self.first_step,
                "last_step": self.last_step, "reported_status": self.reported_status,
                "report_interval_s": self.report_interval_s}


@dataclass(frozen=True)
class RunSummary(Run):
    """A run as listed: with its firing alerts per severity, the worst of them, and its latest risk."""

    firing_by_severity: dict = field(default_factory=dict)  # severity -> firing alerts (only those with some)
    worst_severity: str | None = None  # of the firing alerts; None: nothing firing
    risk: float | None = None  # of the latest prediction; None: none yet

    def to_dict(self) -> dict:
        return {**super().to_dict(), "firing": sum(self.firing_by_severity.values()),
                "firing_by_severity": dict(self.firing_by_severity), "worst_severity": self.worst_severity,
                "risk": self.risk}


@dataclass(frozen=True)
class RunDetail(_Entity):
    # Nothing of the rollups' bookkeeping (runs.rollup_until): the compactor moves it while a run is idle, and
    # it would change this answer's ETag under every dashboard tab polling the run.
    run: Run
    tensor_series: int
    scalar_series: int

    def to_dict(self) -> dict:
        return {**self.run.to_dict(), "tensor_series": self.tensor_series, "scalar_series": self.scalar_series}


@dataclass(frozen=True)
class RunPage(_Entity):
    total: int  # runs matching the filters, over all pages
    limit: int
    offset: int
    runs: list[Run]  # RunSummary from list_runs


@dataclass(frozen=True)
class DeletedRun(_Entity):
    run: str
    id: int
    deleted_rows: dict[str, int]  # bulk table -> rows deleted


# -- statistics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Catalogue(_Entity):
    run: str
    first_step: int | None
    last_step: int | None
    layers: list[dict]  # {"layer": name, "sites": [...]}, in model order
    sites: list[str]
    stats: list[str]
    scalars: list[str]
    ranks: list[int]


@dataclass(frozen=True)
class LatestSnapshot(_Entity):
    run: str
    rank: int
    last_step: int | None
    stats: list[str]
    series: list[dict]  # {"layer", "site", "step", "values": {stat: value}}
    scalars: list[dict]  # {"name", "step", "value"}


@dataclass(frozen=True)
class Series(_Entity):
    run: str
    rank: int | None  # None: the worst over `ranks`
    stat: str | None
    layer: str | None
    site: str | None
    scalar: str | None
    start: int | None
    end: int | None
    bucket_width: int
    downsampled: bool
    points: dict[str, list]  # step, value (raw) or step, count, min, max, mean, last (buckets)
    ranks: list[int] = field(default_factory=list)  # the ranks the values come from


@dataclass(frozen=True)
class Heatmap(_Entity):
    run: str
    stat: str
    site: str
    rank: int | None  # None: the worst over `ranks`
    agg: str
    start: int | None
    end: int | None
    bucket_width: int
    downsampled: bool
    edges: list[int]
    layers: list[str]
    values: list[list]  # values[layer][column]
    ranks: list[int] = field(default_factory=list)  # the ranks the cells come from
    run_ranks: list[int] = field(default_factory=list)  # every rank with statistics at this site
    top: int | None = None  # only the `top` worst layers, worst first (monitor.worst_layers); None: all of them
    layer_count: int = 0  # the run's layers at this site


@dataclass(frozen=True)
class Histograms(_Entity):
    """Log2 histograms of one layer x site: column i sums the histograms of steps step[i]..step_last[i]."""

    run: str
    layer: str
    site: str
    rank: int | None  # None: summed over the run's ranks
    start: int | None
    end: int | None
    binade_lo: int  # bin j counts 2**(binade_lo + j) <= |x| < 2**(binade_lo + j + 1)
    bins: int
    per_column: int  # histogram steps summed per column
    step: list[int]
    step_last: list[int]
    counts: list[list[int]]  # counts[column][bin]
    scale_min: list[float | None]  # the scales in use over the column's steps; None: not reported
    scale_max: list[float | None]


# -- alerts and predictions ------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredAlert(_Entity):
    id: int
    run: str
    fingerprint: str
    rule: str
    severity: str
    state: str
    layer: str | None
    site: str | None
    message: str
    details: dict  # value, for_steps, and the run's risk when it was written
    first_step: int | None
    fired_step: int | None
    escalated_step: int | None
    escalations: list[dict]  # {"step", "severity", "from"}: each rise of severity after firing, in step order
    last_step: int | None
    resolved_step: int | None
    started_at: datetime
    updated_at: datetime
    resolved_at: datetime | None
    acknowledged_at: datetime | None

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["details"] = json_safe(self.details)
        for key in ("started_at", "updated_at", "resolved_at", "acknowledged_at"):
            out[key] = _iso(out[key])
        return out


@dataclass(frozen=True)
class AlertPage(_Entity):
    total: int
    limit: int
    offset: int
    alerts: list[StoredAlert]


@dataclass(frozen=True)
class AcknowledgedAlert(_Entity):
    alert: StoredAlert
    newly_acknowledged: bool  # false: it had been acknowledged before (that time is kept)

    def to_dict(self) -> dict:
        return {**self.alert.to_dict(), "newly_acknowledged": self.newly_acknowledged}


@dataclass(frozen=True)
class PredictionRecord(_Entity):
    step: int
    risk: float
    steps_to_divergence: float | None
    signals: dict
    culprits: list

    def to_dict(self) -> dict:
        return {"step": self.step, "risk": self.risk, "steps_to_divergence": self.steps_to_divergence,
                "signals": json_safe(self.signals), "culprits": json_safe(self.culprits)}


@dataclass(frozen=True)
class PredictionPage(_Entity):
    run: str
    predictions: list[PredictionRecord]


# -- the pipeline's view -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunAlertState:
    """What the pipeline reads back when it meets a run: its config and its pending and firing alerts."""

    config: dict
    alerts: list[StoredAlert]


@dataclass(frozen=True)
class AlertWrite:
    """One alert row to write after an assessment: its row (found by fingerprint among the active alerts'
    ids) is inserted, updated, or deleted."""

    alert: object  # monitor.alerting.lifecycle.Alert: the alert's state after the event
    delete: bool = False  # a pending alert that was dropped
    resolved: bool = False  # sets resolved_at; the alert is no longer active
    context: dict = field(default_factory=dict)  # more details (the run's risk at the time)


@dataclass(frozen=True)
class RecentRun:
    """A run that was active lately and has not ended: what /metrics is seeded with at start."""

    name: str
    last_step: int | None
    last_seen_at: datetime | None
    risk: float | None
    steps_to_divergence: float | None
    firing: dict[str, int]  # severity -> firing alerts


# -- export ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunExport:
    """A run's stored rows in step order: tensor rows (step, rank, layer, site, *stats as floats or None[,
    log2_hist as little-endian int64 bytes or None]) and scalar rows (step, rank, name, value)."""

    name: str
    config: dict
    tags: dict
    status: str
    tensor_rows: list[tuple]
    scalar_rows: list[tuple]


@dataclass
class CompactionReport:
    runs: int = 0
    chunks: int = 0
    buckets: int = 0  # rollup rows written
    skipped_busy: int = 0  # runs another compactor held
    seconds: float = 0.0
