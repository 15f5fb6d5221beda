"""Alerts and predictions: the REST reads, the one user write (acknowledge), and the pipeline's writes."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, insert, select, update

from fp8mon.monitor.jsonvalues import json_safe
from fp8mon.monitor.models import Alert, Prediction, Run
from fp8mon.monitor.storage.database import Database, as_utc, utcnow
from fp8mon.monitor.storage.entities import (
    AcknowledgedAlert,
    AlertPage,
    AlertWrite,
    PredictionPage,
    PredictionRecord,
    RecentRun,
    RunAlertState,
    StoredAlert,
)
from fp8mon.monitor.storage.errors import BadParameter, NotFound
from fp8mon.monitor.storage.runs import SEVERITIES, counted_as_firing, run_ref

ACTIVE_STATES = ("pending", "firing")
_ALERT_COLUMNS = (Alert.id, Run.name, Alert.fingerprint, Alert.rule, Alert.severity, Alert.state, Alert.layer,
                  Alert.site, Alert.message, Alert.details, Alert.first_step, Alert.fired_step, Alert.escalated_step,
                  Alert.escalations, Alert.last_step, Alert.resolved_step, Alert.started_at, Alert.updated_at,
                  Alert.resolved_at, Alert.acknowledged_at)
_PRED_COLUMNS = (Prediction.step, Prediction.risk, Prediction.steps_to_divergence, Prediction.signals,
                 Prediction.culprits)


def _alert(row) -> StoredAlert:
    return StoredAlert(id=row.id, run=row.name, fingerprint=row.fingerprint, rule=row.rule, severity=row.severity,
                       state=row.state, layer=row.layer, site=row.site, message=row.message,
                       details=row.details or {}, first_step=row.first_step, fired_step=row.fired_step,
                       escalated_step=row.escalated_step, escalations=_escalations(row),
                       last_step=row.last_step, resolved_step=row.resolved_step,
                       started_at=as_utc(row.started_at), updated_at=as_utc(row.updated_at),
                       resolved_at=as_utc(row.resolved_at), acknowledged_at=as_utc(row.acknowledged_at))


def _escalations(row) -> list[dict]:
    """The rises of severity after firing; a row written before they were kept shows its last rise only."""
    if row.escalations is not None:
        return list(row.escalations)
    if row.escalated_step is not None:
        return [{"step": row.escalated_step, "severity": row.severity, "from": None}]
    return []


def _prediction(row) -> PredictionRecord:
    return PredictionRecord(step=row.step, risk=row.risk, steps_to_divergence=row.steps_to_divergence,
                            signals=row.signals or {}, culprits=row.culprits or [])


def list_alerts(db: Database, *, run: str | None = None, state: list[str] | None = None,
                severity: list[str] | None = None, limit: int = 100, offset: int = 0) -> AlertPage:
    with db.reading() as conn:
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
    return AlertPage(total=total, limit=limit, offset=offset, alerts=[_alert(r) for r in rows])


def acknowledge(db: Database, alert_id: int) -> AcknowledgedAlert:
    """Set acknowledged_at (the first acknowledgement's time is kept). The lifecycle is unchanged."""
    with db.writing() as conn:
        result = conn.execute(update(Alert).where(Alert.id == alert_id, Alert.acknowledged_at.is_(None))
                              .values(acknowledged_at=utcnow()))
        row = conn.execute(select(*_ALERT_COLUMNS).join(Run, Run.id == Alert.run_id)
                           .where(Alert.id == alert_id)).first()
    if row is None:
        raise NotFound(f"alert {alert_id} not found")
    return AcknowledgedAlert(_alert(row), newly_acknowledged=result.rowcount == 1)


def unacknowledge(db: Database, alert_id: int) -> AcknowledgedAlert:
    """Clear acknowledged_at: the alert counts as firing again. `newly_acknowledged` is false."""
    with db.writing() as conn:
        conn.execute(update(Alert).where(Alert.id == alert_id).values(acknowledged_at=None))
        row = conn.execute(select(*_ALERT_COLUMNS).join(Run, Run.id == Alert.run_id)
                           .where(Alert.id == alert_id)).first()
    if row is None:
        raise NotFound(f"alert {alert_id} not found")
    return AcknowledgedAlert(_alert(row), newly_acknowledged=False)


def acknowledge_run(db: Database, run: str, severity: list[str] | None = None) -> list[int]:
    """Acknowledge every pending or firing alert of the run not acknowledged yet (of these severities, if
    given); returns their ids."""
    with db.writing() as conn:
        where = [Alert.run_id == run_ref(conn, run).id, Alert.state.in_(ACTIVE_STATES),
                 Alert.acknowledged_at.is_(None)]
        if severity:
            where.append(Alert.severity.in_(severity))
        ids = list(conn.execute(select(Alert.id).where(*where).order_by(Alert.id)).scalars())
        if ids:
            conn.execute(update(Alert).where(Alert.id.in_(ids)).values(acknowledged_at=utcnow()))
    return ids


def list_predictions(db: Database, run: str, *, from_step: int | None = None, to_step: int | None = None,
                     limit: int = 1000) -> PredictionPage:
    """Stored predictions in step order: from from_step on, or the last `limit` ones up to to_step."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise BadParameter(f"from_step ({from_step}) is after to_step ({to_step})")
    with db.reading() as conn:
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
    return PredictionPage(run=run, predictions=[_prediction(r) for r in rows])


def latest_prediction(db: Database, run: str) -> PredictionRecord:
    with db.reading() as conn:
        ref = run_ref(conn, run)
        row = conn.execute(select(*_PRED_COLUMNS).where(Prediction.run_id == ref.id)
                           .order_by(Prediction.step.desc()).limit(1)).first()
    if row is None:
        raise NotFound(f"run {run!r} has no prediction yet")
    return _prediction(row)


# -- the pipeline's side ---------------------------------------------------------------------------


def run_alert_state(db: Database, run_id: int) -> RunAlertState:
    with db.reading() as conn:
        config = conn.execute(select(Run.config).where(Run.id == run_id)).scalar()
        rows = conn.execute(select(*_ALERT_COLUMNS).join(Run, Run.id == Alert.run_id)
                            .where(Alert.run_id == run_id, Alert.state.in_(ACTIVE_STATES))).all()
    return RunAlertState(config=config or {}, alerts=[_alert(r) for r in rows])


def record_assessments(db: Database, run_id: int, predictions: list[PredictionRecord], writes: list[AlertWrite],
                       alert_ids: dict[str, int]) -> dict[str, int]:
    """Upsert predictions (by step) and apply the alert writes in order, in one transaction. `alert_ids`:
    fingerprint -> row id of the run's active alerts; returns it as the writes left it."""
    now = utcnow()
    ids = dict(alert_ids)
    with db.writing() as conn:
        if predictions:
            stmt = db.insert(Prediction)
            stmt = stmt.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={c: stmt.excluded[c] for c in ("risk", "steps_to_divergence", "signals", "culprits")})
            conn.execute(stmt, [{"run_id": run_id, "step": p.step, "risk": p.risk,
                                 "steps_to_divergence": p.steps_to_divergence, "signals": json_safe(p.signals),
                                 "culprits": json_safe(p.culprits)} for p in predictions])
        for write in writes:
            a = write.alert
            row_id = ids.get(a.fingerprint)
            if write.delete:
                if row_id is not None:
                    conn.execute(delete(Alert).where(Alert.id == row_id))
                ids.pop(a.fingerprint, None)
                continue
            values = _alert_values(a, now, write.context)
            if write.resolved:
                values["resolved_at"] = now
            if row_id is None:
                row_id = conn.execute(insert(Alert).values(run_id=run_id, fingerprint=a.fingerprint, rule=a.rule,
                                                           layer=a.layer, site=a.site, started_at=now, **values)
                                      .returning(Alert.id)).scalar_one()
            else:
                conn.execute(update(Alert).where(Alert.id == row_id).values(**values))
            if write.resolved:
                ids.pop(a.fingerprint, None)
            else:
                ids[a.fingerprint] = row_id
    return ids


def _alert_values(a, now: datetime, context: dict) -> dict:
    return {"severity": a.severity, "state": a.state, "message": a.message,
            "first_step": a.first_step, "last_step": a.last_step, "fired_step": a.fired_step,
            "escalated_step": a.escalated_step, "escalations": list(a.escalations),
            "resolved_step": a.resolved_step, "updated_at": now,
            "details": json_safe({"value": a.value, "for_steps": a.for_steps, **context})}


def firing_counts(db: Database, run: str) -> dict[str, int]:
    """The run's firing, unacknowledged alerts per severity (every severity, zeros included)."""
    counts = dict.fromkeys(SEVERITIES, 0)
    with db.reading() as conn:
        for severity, n in conn.execute(select(Alert.severity, func.count()).join(Run, Run.id == Alert.run_id)
                                        .where(Run.name == run, *counted_as_firing()).group_by(Alert.severity)):
            counts[severity] = int(n)
    return counts


def recent_runs(db: Database, since: datetime, limit: int) -> list[RecentRun]:
    """Runs not ended and seen since `since`, most recently seen first, with their latest prediction and
    firing alerts."""
    with db.reading() as conn:
        runs = conn.execute(select(Run.id, Run.name, Run.last_step, Run.last_seen_at)
                            .where(Run.ended_at.is_(None), Run.last_seen_at >= since)
                            .order_by(Run.last_seen_at.desc()).limit(limit)).all()
        if not runs:
            return []
        firing: dict[int, dict[str, int]] = {}
        for run_id, severity, n in conn.execute(
                select(Alert.run_id, Alert.severity, func.count())
                .where(Alert.run_id.in_([r.id for r in runs]), *counted_as_firing())
                .group_by(Alert.run_id, Alert.severity)):
            firing.setdefault(run_id, {})[severity] = n
        out = []
        for r in runs:
            latest = conn.execute(select(Prediction.risk, Prediction.steps_to_divergence)
                                  .where(Prediction.run_id == r.id).order_by(Prediction.step.desc()).limit(1)).first()
            out.append(RecentRun(name=r.name, last_step=r.last_step, last_seen_at=as_utc(r.last_seen_at),
                                 risk=None if latest is None else latest.risk,
                                 steps_to_divergence=None if latest is None else latest.steps_to_divergence,
                                 firing=firing.get(r.id, {})))
    return out
