"""Which run a batch belongs to (docs/wire-format.md, "Run identity").

A run has a unique id (`uid`, the agent's run_id) and a display name, unique too, so that the REST routes and
the dashboard's links keep naming runs. A batch with a run_id goes to the run of that id; a batch without one
(an older agent, a replayed export) goes to the run of that name. A missing run is created, unless the batch says
resume "must" (409). A new run whose name is taken gets the name with the first free suffix: `name-2`, `name-3`.
Every decision depends on the batch alone, never on which batch came first, so a replayed spool lands where the
first delivery did.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

from fp8mon.agent.wire import MAX_RUN_NAME
from fp8mon.monitor.models import Run
from fp8mon.monitor.storage.database import Database
from fp8mon.monitor.storage.errors import RunConflict
from fp8mon.monitor.wire import IngestBatch

_ATTEMPTS = 20  # names taken by concurrent writers between looking and inserting, at most


@dataclass(frozen=True)
class RunIdentity:
    id: int
    uid: str
    name: str


def find(conn: Connection, name: str, run_id: str | None) -> RunIdentity | None:
    """The run a batch of this name and id goes to, if it exists."""
    where = Run.uid == run_id if run_id is not None else Run.name == name
    row = conn.execute(select(Run.id, Run.uid, Run.name).where(where)).first()
    return None if row is None else RunIdentity(row.id, row.uid, row.name)


def resolve(db: Database, conn: Connection, batch: IngestBatch, now: datetime) -> RunIdentity:
    """The batch's run, created if missing; RunConflict under resume "must" when it is missing."""
    found = find(conn, batch.run, batch.run_id)
    if found is not None:
        return found
    if batch.resume == "must":
        which = f"id {batch.run_id!r}" if batch.run_id is not None else f"name {batch.run!r}"
        raise RunConflict(f"no run with {which} to resume (resume 'must'); use resume 'allow' to create it")
    if batch.run_id is None:  # by name: the run of that name, whoever creates it first
        _insert(db, conn, batch.run, uuid.uuid4().hex, now)
        return find(conn, batch.run, None)  # type: ignore[return-value]  # inserted or there already
    for _ in range(_ATTEMPTS):
        _insert(db, conn, _free_name(conn, batch.run), batch.run_id, now)
        found = find(conn, batch.run, batch.run_id)
        if found is not None:  # ours, or a concurrent batch of the same run inserted it first
            return found
    raise RunConflict(f"could not find a free name for a new run named {batch.run!r}; retry")


def _insert(db: Database, conn: Connection, name: str, uid: str, now: datetime) -> None:
    """A new run, unless its name or its uid exists already (no error then: the caller looks)."""
    row = {"uid": uid, "name": name, "status": "running", "config": {}, "tags": {}, "created_at": now,
           "started_at": now, "rollup_until": 0}
    conn.execute(db.insert(Run).values(row).on_conflict_do_nothing())


def _free_name(conn: Connection, name: str) -> str:
    """`name` if no run has it, else `name-k` with the smallest free k >= 2 (the name shortened to fit)."""
    if conn.execute(select(Run.id).where(Run.name == name)).first() is None:
        return name
    base = name[: MAX_RUN_NAME - 8]
    escaped = base.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    taken = conn.execute(select(Run.name).where(Run.name.like(f"{escaped}-%", escape="\\"))).scalars()
    suffix = re.compile(re.escape(base) + r"-(\d+)$")
    used = {int(m.group(1)) for t in taken if (m := suffix.match(t))}
    k = 2
    while k in used:
        k += 1
    return f"{base}-{k}"
