"""/api/v1/alerts and /api/v1/runs/{run}/alerts: list alerts (filters, pages); acknowledge one, undo that, or
acknowledge all of a run. An acknowledged alert keeps its lifecycle but leaves the run's firing counts (the
dashboard's and /metrics' fp8mon_alerts_firing)."""

from typing import Annotated

from fastapi import APIRouter, Path, Query

from fp8mon.monitor.api_models import AlertAcked, AlertList, AlertState, RunAlertsAcked, Severity
from fp8mon.monitor.deps import MetricsDep, StoreDep, require_read, require_write
from fp8mon.monitor.routers.common import ERRORS, RunPath, SafeJSONResponse, http_errors

router = APIRouter(tags=["alerts"])

StateQuery = Annotated[list[AlertState] | None, Query(description="any of these states (repeatable)")]
SeverityQuery = Annotated[list[Severity] | None, Query(description="any of these severities (repeatable)")]
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=2**62)]  # (the databases' integers are 64-bit)


@router.get("/alerts", response_model=AlertList, responses=ERRORS, dependencies=[require_read],
            summary="Alerts of every run, most recently updated first")
def list_alerts(store: StoreDep, state: StateQuery = None, severity: SeverityQuery = None,
                run: Annotated[str | None, Query(min_length=1, max_length=200, description="run name")] = None,
                limit: Limit = 100, offset: Offset = 0):
    with http_errors():
        return SafeJSONResponse(store.list_alerts(run=run, state=state, severity=severity, limit=limit,
                                                  offset=offset).to_dict())


def _recount(store, metrics, run: str) -> None:
    """/metrics' firing gauges of the run follow an acknowledgement, as the dashboard's counts do."""
    metrics.runs.set_firing(run, store.firing_counts(run))


@router.post("/alerts/{alert_id}/ack", response_model=AlertAcked, responses=ERRORS, dependencies=[require_write],
             summary="Acknowledge an alert (idempotent; its lifecycle goes on)")
def acknowledge(store: StoreDep, metrics: MetricsDep, alert_id: Annotated[int, Path(ge=1, le=2**31 - 1)]):
    with http_errors():
        acked = store.acknowledge_alert(alert_id)
        _recount(store, metrics, acked.alert.run)
    return SafeJSONResponse(acked.to_dict())


@router.post("/alerts/{alert_id}/unack", response_model=AlertAcked, responses=ERRORS,
             dependencies=[require_write], summary="Undo an acknowledgement (the alert counts as firing again)")
def unacknowledge(store: StoreDep, metrics: MetricsDep, alert_id: Annotated[int, Path(ge=1, le=2**31 - 1)]):
    with http_errors():
        unacked = store.unacknowledge_alert(alert_id)
        _recount(store, metrics, unacked.alert.run)
    return SafeJSONResponse(unacked.to_dict())


@router.post("/runs/{run:path}/alerts/ack", response_model=RunAlertsAcked, responses=ERRORS,
             dependencies=[require_write],
             summary="Acknowledge every pending or firing alert of a run (of the severities given)")
def acknowledge_run(store: StoreDep, metrics: MetricsDep, run: RunPath, severity: SeverityQuery = None):
    with http_errors():
        ids = store.acknowledge_run_alerts(run, severity)
        _recount(store, metrics, run)
    return SafeJSONResponse({"run": run, "acknowledged": ids})


@router.get("/runs/{run:path}/alerts", response_model=AlertList, responses=ERRORS, dependencies=[require_read],
            summary="A run's alerts, most recently updated first")
def run_alerts(store: StoreDep, run: RunPath, state: StateQuery = None, severity: SeverityQuery = None,
               limit: Limit = 100, offset: Offset = 0):
    with http_errors():
        return SafeJSONResponse(store.list_alerts(run=run, state=state, severity=severity, limit=limit,
                                                  offset=offset).to_dict())
