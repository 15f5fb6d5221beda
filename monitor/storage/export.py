"""A run's stored rows in step order, for monitor.export."""

from __future__ import annotations

from sqlalchemy import select

from fp8mon.monitor.models import Run
from fp8mon.monitor.storage.database import Database, fetch, to_float
from fp8mon.monitor.storage.entities import RunExport
from fp8mon.monitor.storage.errors import NotFound


def export_rows(db: Database, name: str, stats: tuple[str, ...], hist: bool) -> RunExport:
    with db.reading() as conn:
        run = conn.execute(select(Run.id, Run.config, Run.tags, Run.status).where(Run.name == name)).first()
        if run is None:
            raise NotFound(f"run {name!r} not found")
        columns = ", ".join(f"t.{c}" for c in (*stats, *(("log2_hist",) if hist else ())))
        tensor_rows = fetch(conn, f"SELECT t.step, t.rank, s.layer, s.site, {columns} FROM tensor_stats t "
                                  "JOIN tensor_series s ON s.id = t.series_id WHERE s.run_id = :run "
                                  "ORDER BY t.step, t.rank, s.ordinal", {"run": run.id})
        scalar_rows = fetch(conn, "SELECT t.step, t.rank, s.name, t.value FROM scalars t "
                                  "JOIN scalar_series s ON s.id = t.series_id WHERE s.run_id = :run "
                                  "ORDER BY t.step, t.rank, s.id", {"run": run.id})
    n = len(stats)
    tensor_rows = [(*r[:4], *map(to_float, r[4:4 + n]), *(bytes(h) if h is not None else None for h in r[4 + n:]))
                   for r in tensor_rows]
    scalar_rows = [(*r[:3], to_float(r[3])) for r in scalar_rows]
    return RunExport(name=name, config=run.config or {}, tags=run.tags or {}, status=run.status,
                     tensor_rows=tensor_rows, scalar_rows=scalar_rows)
