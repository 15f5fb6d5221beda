"""Reads and the one user write (acknowledge) of alerts and predictions, for the REST routers."""

from __future__ import annotations

from sqlalchemy import func, select, update

from fp8mon.monitor.models import Alert, Prediction, Run
from fp8mon.monitor.queries import BadParameter, NotFound, _iso, json_safe, reading, run_ref, writing
from fp8mon.monitor.store import utcnow

_ALERT_COLUMNS = (Alert.id, Run.name, Alert.fingerprint, Alert.rule, Alert.severity, Alert.state, Alert.layer,
                  Alert.site, Alert.message, Alert.details, Alert.first_step, Alert.fired_step, Alert.escalated_step,
                  Alert.last_step, Alert.resolved_step, Alert.started_at, Alert.updated_at, Alert.resolved_at,
                  Alert.acknowledged_at)


def _alert_dict(row) -> dict:
    return {"id": row.id, "run": row.name, "fingerprint": row.fingerprint, "rule": row.rule,
            "severity": row.severity, "state": row.state, "layer": row.layer, "site": row.site,
            "message": row.message, "details": json_safe(row.details or {}), "first_step": row.first_step,
            "fired_step": row.fired_step, "escalated_step": row.escalated_step, "last_step": row.last_step,
            "resolved_step": row.resolved_step,
            "started_at": _iso(row.started_at), "updated_at": _iso(row.updated_at),
            "resolved_at": _iso(row.resolved_at), "acknowledged_at": _iso(row.acknowledged_at)}


def list_alerts(store, *, run: str | None = None, state: list[str] | None = None,
                severity: list[str] | None = None, limit: int = 100, offset: int = 0) -> dict:
    with reading(store) as conn:
        where = []
        if run is not None:
            where.append(Alert.run_id == run_ref(conn, run).id)
        if state:
            where.append(Alert.state.in_(state))
        if severity:
            where.append(Alert.severity.in_(severity))
        total = conn.execute(select(func.count()).select_from(Alert).where(*where)).scalar_one()
        rows = conn.execute(select(*_ALERT_COLUMNS).join(Run, Run.id == Alert.run_id).where(*where)
                            .order_by(Alert.updated_at.desc(), Alert.id.desc()).limit(limit).offset(offset)).all()
    return {"total": total, "limit": limit, "offset": offset, "alerts": [_alert_dict(r) for r in rows]}


def get_alert(conn, alert_id: int) -> dict:
    row = conn.execute(select(*_ALERT_COLUMNS).join(Run, Run.id == Alert.run_id).where(Alert.id == alert_id)).first()
    if row is None:
        raise NotFound(f"alert {alert_id} not found")
    return _alert_dict(row)


def acknowledge(store, alert_id: int) -> dict:
    """Set acknowledged_at (the first acknowledgement's time is kept). The lifecycle is unchanged."""
    with writing(store) as conn:
        result = conn.execute(update(Alert).where(Alert.id == alert_id, Alert.acknowledged_at.is_(None))
                              .values(acknowledged_at=utcnow()))
        alert = get_alert(conn, alert_id)
    alert["newly_acknowledged"] = result.rowcount == 1
    return alert


def _prediction_dict(row) -> dict:
    return {"step": row.step, "risk": row.risk, "steps_to_divergence": row.steps_to_divergence,
            "signals": json_safe(row.signals or {}), "culprits": json_safe(row.culprits or [])}


_PRED_COLUMNS = (Prediction.step, Prediction.risk, Prediction.steps_to_divergence, Prediction.signals,
                 Prediction.culprits)


def list_predictions(store, run: str, *, from_step: int | None = None, to_step: int | None = None,
                     limit: int = 1000) -> dict:
    """Stored predictions in step order: from from_step on, or the last `limit` ones up to to_step."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise BadParameter(f"from_step ({from_step}) is after to_step ({to_step})")
    with reading(store) as conn:
        ref = run_ref(conn, run)
        where = [Prediction.run_id == ref.id]
        if from_step is not None:
            where.append(Prediction.step >= from_step)
        if to_step is not None:
            where.append(Prediction.step <= to_step)
        query = select(*_PRED_COLUMNS).where(*where)
        if from_step is not None:
            rows = conn.execute(query.order_by(Prediction.step).limit(limit)).all()
        else:
            rows = conn.execute(query.order_by(Prediction.step.desc()).limit(limit)).all()[::-1]
    return {"run": run, "predictions": [_prediction_dict(r) for r in rows]}


def latest_prediction(store, run: str) -> dict:
    with reading(store) as conn:
        ref = run_ref(conn, run)
        row = conn.execute(select(*_PRED_COLUMNS).where(Prediction.run_id == ref.id)
                           .order_by(Prediction.step.desc()).limit(1)).first()
    if row is None:
        raise NotFound(f"run {run!r} has no prediction yet")
    return _prediction_dict(row)
