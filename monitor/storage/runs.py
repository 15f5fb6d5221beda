"""Runs: list, read, patch and delete; a run's catalogue and its latest snapshot."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, case, delete, func, literal, select, text, update

from fp8mon.agent.wire import SITES, TENSOR_STATS
from fp8mon.monitor.models import Alert, Prediction, ScalarSeries, TensorSeries
from fp8mon.monitor.models import Run as RunRow
from fp8mon.monitor.storage import identity
from fp8mon.monitor.storage.database import Database, as_utc, fetch, to_float, utcnow
from fp8mon.monitor.storage.entities import (
    Catalogue,
    DeletedRun,
    LatestSnapshot,
    Run,
    RunDetail,
    RunPage,
    RunSummary,
)
from fp8mon.monitor.storage.errors import BadParameter, NotFound
from fp8mon.monitor.storage.rollup import KINDS, effective_horizon, series_ranks
from fp8mon.monitor.storage.run_status import DEFAULT_STALL, StallPolicy, status_columns
from fp8mon.monitor.wire import FINAL_STATUSES, finite_or_none

# severity: worst firing severity, then firing count; firing: firing count; risk: the latest prediction's
RUN_ORDER_FIELDS = ("created_at", "started_at", "last_seen_at", "name", "status", "first_step", "last_step", "id",
                    "severity", "firing", "risk")
SEVERITIES = ("info", "warning", "critical")  # mildest first

@dataclass
class RunRef:
    id: int
    name: str
    first_step: int | None
    last_step: int | None
    horizon: int  # rollups are valid below this step


def run_ref(conn: Connection, name: str) -> RunRef:
    row = conn.execute(select(RunRow.id, RunRow.first_step, RunRow.last_step, RunRow.rollup_until,
                              RunRow.rollup_dirty_from).where(RunRow.name == name)).first()
    if row is None:
        raise NotFound(f"run {name!r} not found")
    return RunRef(row.id, name, row.first_step, row.last_step,
                  effective_horizon(row.rollup_until or 0, row.rollup_dirty_from))


def run_entity(row) -> Run:
    """A row of `_runs_query`: the stored columns, the status the user reads and the usual reporting interval."""
    interval = to_float(row.report_interval_s)
    return Run(id=row.id, uid=row.uid, name=row.name, status=row.run_state, config=row.config or {},
               tags=row.tags or {},
               created_at=as_utc(row.created_at), started_at=as_utc(row.started_at), ended_at=as_utc(row.ended_at),
               last_seen_at=as_utc(row.last_seen_at), first_step=row.first_step, last_step=row.last_step,
               reported_status=row.status, report_interval_s=finite_or_none(interval))


def _runs_query(conn: Connection, stall: StallPolicy, *extra):
    state, interval = status_columns(conn.dialect.name, stall, time.time())
    return select(RunRow.__table__, state.label("run_state"), interval.label("report_interval_s"), *extra), state


def _like_pattern(name: str) -> str:
    escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if "*" in name or "?" in name:
        return escaped.replace("*", "%").replace("?", "_")
    return f"%{escaped}%"


def parse_tag_filters(tags: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for item in tags:
        key, sep, value = item.partition("=")
        if not key:
            raise BadParameter(f"tag: {item!r} is not key=value (or key)")
        out.append((key, value if sep else None))
    return out


def counted_as_firing():
    """The alerts a run's firing counts hold, on the dashboard and in /metrics alike: firing and not acknowledged
    (someone has seen it; it goes on firing in /alerts)."""
    return (Alert.state == "firing", Alert.acknowledged_at.is_(None))


def _firing_per_run():
    """One row per run with firing alerts (counted_as_firing): the count per severity and the worst (1 info ..
    3 critical)."""
    level = case({sev: i for i, sev in enumerate(SEVERITIES, start=1)}, value=Alert.severity, else_=0)
    per_severity = [func.sum(case((Alert.severity == sev, 1), else_=0)).label(sev) for sev in SEVERITIES]
    return (select(Alert.run_id, func.count().label("n"), func.max(level).label("worst"), *per_severity)
            .where(*counted_as_firing()).group_by(Alert.run_id)
            .subquery("firing"))


def _summary(row) -> RunSummary:
    counts = {sev: int(getattr(row, f"n_{sev}") or 0) for sev in SEVERITIES}
    worst = int(row.worst_level or 0)
    return RunSummary(**vars(run_entity(row)), firing_by_severity={k: v for k, v in counts.items() if v},
                      worst_severity=SEVERITIES[worst - 1] if worst else None, risk=finite_or_none(to_float(row.risk)))


def _run_filters(state, status, name, tags, created_since, updated_since) -> list:
    conds = []
    if status:
        conds.append(state.in_(status))
    if name:
        conds.append(func.lower(RunRow.name).like(_like_pattern(name.lower()), escape="\\"))
    for key, value in parse_tag_filters(tags or []):
        extracted = RunRow.tags[key].as_string()
        conds.append(extracted.is_not(None) if value is None else extracted == value)
    if created_since is not None:
        conds.append(RunRow.created_at >= as_utc(created_since))
    if updated_since is not None:
        conds.append(RunRow.last_seen_at >= as_utc(updated_since))
    return conds


def list_runs(db: Database, *, status: list[str] | None = None, name: str | None = None, tags: list[str] | None = None,
              created_since: datetime | None = None, updated_since: datetime | None = None,
              order_by: str = "-created_at", limit: int = 50, offset: int = 0,
              stall: StallPolicy = DEFAULT_STALL) -> RunPage:
    """Runs matching every filter given, a page of them and the total count. Each run comes with its firing
    alerts per severity and its latest risk, computed by the database for the whole listing (one grouped
    subquery), so that sorting by severity ranks every run, not a page. `status` filters (and sorts) on the
    status the user reads (storage.run_status), stalled and server-seen divergence included."""
    desc = order_by.startswith("-")
    field_name = order_by.lstrip("-+")
    if field_name not in RUN_ORDER_FIELDS:
        raise BadParameter(f"order_by: {order_by!r} is not one of {', '.join(RUN_ORDER_FIELDS)} (prefix - for "
                           "descending)")
    firing = _firing_per_run()
    risk = (select(Prediction.risk).where(Prediction.run_id == RunRow.id).order_by(Prediction.step.desc())
            .limit(1).correlate(RunRow).scalar_subquery())
    worst, n_firing = func.coalesce(firing.c.worst, literal(0)), func.coalesce(firing.c.n, literal(0))
    with db.reading() as conn:
        query, state = _runs_query(conn, stall, worst.label("worst_level"), risk.label("risk"),
                                   *[firing.c[sev].label(f"n_{sev}") for sev in SEVERITIES])
        query = query.select_from(RunRow.__table__.outerjoin(firing, firing.c.run_id == RunRow.id))
        conds = _run_filters(state, status, name, tags, created_since, updated_since)
        derived = {"severity": [worst, n_firing], "firing": [n_firing], "risk": [risk], "status": [state]}
        keys = derived[field_name] if field_name in derived else [getattr(RunRow, field_name)]
        direction = (lambda c: c.desc()) if desc else (lambda c: c.asc())
        ordering = [direction(k).nulls_last() for k in keys]
        ordering.append(RunRow.id.desc() if desc else RunRow.id.asc())
        total = conn.execute(select(func.count()).select_from(RunRow).where(*conds)).scalar_one()
        rows = conn.execute(query.where(*conds).order_by(*ordering).limit(limit).offset(offset))
        runs = [_summary(r) for r in rows]
    return RunPage(total=total, limit=limit, offset=offset, runs=runs)


def find_run(db: Database, name: str, run_id: str | None = None) -> Run | None:
    """The run a batch with this name and run_id goes to (storage.identity), None if it has none yet."""
    with db.reading() as conn:
        found = identity.find(conn, name, run_id)
        row = None if found is None else \
            conn.execute(_runs_query(conn, DEFAULT_STALL)[0].where(RunRow.id == found.id)).first()
    return None if row is None else run_entity(row)


def get_run(db: Database, name: str, stall: StallPolicy = DEFAULT_STALL) -> RunDetail:
    with db.reading() as conn:
        row = conn.execute(_runs_query(conn, stall)[0].where(RunRow.name == name)).first()
        if row is None:
            raise NotFound(f"run {name!r} not found")
        tensor_series = conn.execute(select(func.count()).select_from(TensorSeries)
                                     .where(TensorSeries.run_id == row.id)).scalar_one()
        scalar_series = conn.execute(select(func.count()).select_from(ScalarSeries)
                                     .where(ScalarSeries.run_id == row.id)).scalar_one()
    return RunDetail(run_entity(row), tensor_series=tensor_series, scalar_series=scalar_series)


def patch_run(db: Database, name: str, *, status: str | None = None, tags: dict | None = None,
              config: dict | None = None, stall: StallPolicy = DEFAULT_STALL) -> RunDetail:
    """Status, tags (merged into the run's tags, as ingest does) and config (replaced)."""
    with db.writing() as conn:
        row = conn.execute(select(RunRow.id, RunRow.tags).where(RunRow.name == name)).first()
        if row is None:
            raise NotFound(f"run {name!r} not found")
        values: dict = {}
        if tags is not None:
            values["tags"] = {**(row.tags or {}), **tags}
        if config is not None:
            values["config"] = config
        if status is not None:
            values["status"] = status
            values["ended_at"] = utcnow() if status in FINAL_STATUSES else None
        if values:
            conn.execute(update(RunRow).where(RunRow.id == row.id).values(**values))
    return get_run(db, name, stall)


def delete_run(db: Database, name: str) -> DeletedRun:
    """The run, its catalogue, batches, alerts, predictions and every bulk row (which has no foreign key)."""
    counts = {}
    with db.writing() as conn:
        lock = " FOR UPDATE" if conn.dialect.name == "postgresql" else ""
        run_id = conn.execute(text(f"SELECT id FROM runs WHERE name = :name{lock}"), {"name": name}).scalar()
        if run_id is None:
            raise NotFound(f"run {name!r} not found")
        for kind, (raw, roll, series_table, _) in KINDS.items():
            ids = f"SELECT id FROM {series_table} WHERE run_id = :run"
            for table in (raw, roll):
                result = conn.execute(text(f"DELETE FROM {table} WHERE series_id IN ({ids})"), {"run": run_id})
                counts[table] = result.rowcount
        # The catalogue, batches, alerts and predictions go by ON DELETE CASCADE; deleted explicitly too, so
        # that a SQLite connection without foreign_keys=ON cannot leave them behind.
        for table in ("tensor_series", "scalar_series", "ingest_batches", "alerts", "predictions"):
            conn.execute(text(f"DELETE FROM {table} WHERE run_id = :run"), {"run": run_id})
        conn.execute(delete(RunRow).where(RunRow.id == run_id))
    return DeletedRun(run=name, id=run_id, deleted_rows=counts)


# -- catalogue and latest --------------------------------------------------------------------------


def catalogue(db: Database, name: str) -> Catalogue:
    with db.reading() as conn:
        ref = run_ref(conn, name)
        layers: dict[str, set[str]] = {}
        for layer, site in conn.execute(select(TensorSeries.layer, TensorSeries.site)
                                        .where(TensorSeries.run_id == ref.id).order_by(TensorSeries.ordinal)):
            layers.setdefault(layer, set()).add(site)
        scalars = list(conn.execute(select(ScalarSeries.name).where(ScalarSeries.run_id == ref.id)
                                    .order_by(ScalarSeries.id)).scalars())
        ranks = set()
        for kind in KINDS:
            for rs in series_ranks(conn, kind, ref.id).values():
                ranks.update(rs)
    present = {s for sites in layers.values() for s in sites}
    return Catalogue(
        run=name, first_step=ref.first_step, last_step=ref.last_step,
        layers=[{"layer": layer, "sites": [s for s in SITES if s in sites]} for layer, sites in layers.items()],
        sites=[s for s in SITES if s in present], stats=list(TENSOR_STATS), scalars=scalars, ranks=sorted(ranks))


def latest(db: Database, name: str, rank: int = 0) -> LatestSnapshot:
    """Every statistic of every layer x site (and every scalar) at that series' last step on `rank`."""
    stat_cols = ", ".join(f"t.{s}" for s in TENSOR_STATS)
    with db.reading() as conn:
        ref = run_ref(conn, name)
        rows = fetch(conn, f"SELECT s.layer, s.site, t.step, {stat_cols} FROM tensor_series s "
                           f"JOIN tensor_stats t ON t.series_id = s.id AND t.rank = :rank AND t.step = "
                           f"(SELECT MAX(m.step) FROM tensor_stats m WHERE m.series_id = s.id AND m.rank = :rank) "
                           f"WHERE s.run_id = :run ORDER BY s.ordinal", {"rank": rank, "run": ref.id})
        scalar_rows = fetch(conn, "SELECT s.name, t.step, t.value FROM scalar_series s "
                                  "JOIN scalars t ON t.series_id = s.id AND t.rank = :rank AND t.step = "
                                  "(SELECT MAX(m.step) FROM scalars m WHERE m.series_id = s.id AND m.rank = :rank) "
                                  "WHERE s.run_id = :run ORDER BY s.id", {"rank": rank, "run": ref.id})
    series = [{"layer": r[0], "site": r[1], "step": r[2],
               "values": {s: finite_or_none(to_float(v)) for s, v in zip(TENSOR_STATS, r[3:])}} for r in rows]
    scalars = [{"name": n, "step": st, "value": finite_or_none(to_float(v))} for n, st, v in scalar_rows]
    return LatestSnapshot(run=name, rank=rank, last_step=ref.last_step, stats=list(TENSOR_STATS), series=series,
                          scalars=scalars)

