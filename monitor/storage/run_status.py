"""A run's status as the user should read it, computed by the database for the listing and for one run alike.

A client reports `running`, `finished`, `failed` or `diverged` (the run's stored status). Two more come from what
the server sees:
  * diverged: a running run whose loss met the divergence rule (monitor.predictors.divergence): an alert of the
    `loss_divergence` rule has fired for it, whatever that alert's state now;
  * stalled: a running run that sent nothing for `intervals` of its usual reporting intervals (and at least
    `min_seconds`): a killed or hung trainer. The usual interval is the mean gap between its ingested batches,
    (last seen - started) / (batches - 1); a run with one batch waits `min_seconds`.
A final status the client reported wins over both; diverged wins over stalled.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Float, case, cast, exists, extract, func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from fp8mon.monitor.models import Alert, IngestBatch
from fp8mon.monitor.models import Run as RunRow

DIVERGENCE_RULE = "loss_divergence"  # monitor.predictors.scalars.LossDivergence.name
RUN_STATES = ("running", "stalled", "finished", "failed", "diverged")


@dataclass(frozen=True)
class StallPolicy:
    intervals: float = 5.0  # silent for this many usual reporting intervals ...
    min_seconds: float = 60.0  # ... and at least this long: stalled


DEFAULT_STALL = StallPolicy()


def epoch_seconds(dialect: str, column) -> ColumnElement:
    """A timestamp column as seconds since 1970 (a float), in the dialect's own date arithmetic."""
    if dialect == "sqlite":
        return (func.julianday(column) - 2440587.5) * 86400.0
    return cast(extract("epoch", column), Float)


def report_interval(dialect: str) -> ColumnElement:
    """The run's mean seconds between ingested batches; NULL with fewer than two."""
    batches = (select(func.count()).select_from(IngestBatch).where(IngestBatch.run_id == RunRow.id)
               .correlate(RunRow).scalar_subquery())
    span = epoch_seconds(dialect, RunRow.last_seen_at) - epoch_seconds(dialect, RunRow.started_at)
    return case((batches > 1, span / (batches - 1)), else_=None)


def status_columns(dialect: str, policy: StallPolicy, now: float) -> tuple[ColumnElement, ColumnElement]:
    """(status, report interval) expressions over the runs table, `now` in seconds since 1970."""
    interval = report_interval(dialect)
    silent = literal(now, Float) - epoch_seconds(dialect, RunRow.last_seen_at)
    diverged = exists().where(Alert.run_id == RunRow.id, Alert.rule == DIVERGENCE_RULE,
                              Alert.fired_step.is_not(None)).correlate(RunRow)
    # the minimum first: a run that reported lately is not stalled, whatever its interval (not counted then)
    stalled = ((RunRow.last_seen_at.is_not(None)) & (silent > policy.min_seconds)
               & (interval.is_(None) | (silent > policy.intervals * interval)))
    status = case(
        (RunRow.status != "running", RunRow.status),
        (diverged, literal("diverged")),
        (stalled, literal("stalled")),
        else_=literal("running"))
    return status, interval
