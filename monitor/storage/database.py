"""The database a store works on: its engines, transactions and the raw-cursor read of the hot paths."""

import re
import threading
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import postgresql, sqlite

from fp8mon.monitor.storage.engine import create_db_engine


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(dt: datetime | None) -> datetime | None:
    """A stored timestamp as an aware UTC datetime (SQLite returns naive ones)."""
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


class Database:
    """A writer engine and a reader engine (the same one on PostgreSQL) and the process's writer lock."""

    def __init__(self, url: str, *, pool_size: int = 8):
        self.engine: Engine = create_db_engine(url, pool_size=pool_size)
        # SQLite readers run deferred transactions on their own pool; PostgreSQL shares one engine.
        self.read_engine: Engine = (create_db_engine(url, writer=False) if self.engine.dialect.name == "sqlite"
                                    else self.engine)
        # SQLite: held by whoever writes (ingest's group commit, the compactor, user writes), so the writers of
        # this process queue here rather than in SQLite's busy handler.
        self.write_lock = threading.Lock()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def insert(self, model):
        """The dialect's INSERT, which has ON CONFLICT."""
        return (postgresql if self.dialect == "postgresql" else sqlite).insert(model)

    @contextmanager
    def reading(self):
        """A read transaction: one consistent snapshot (SQLite deferred transaction, PostgreSQL REPEATABLE READ)."""
        with self.read_engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    @contextmanager
    def writing(self):
        """A write transaction; on SQLite this process's ingest threads queue behind it on the writer lock."""
        lock = self.write_lock if self.dialect == "sqlite" else nullcontext()
        with lock, self.engine.begin() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()


_PARAM = re.compile(r"(?<![:\w]):(\w+)")


def fetch(conn: Connection, sql: str, params: dict | None = None) -> list[tuple]:
    """Rows as plain tuples straight from the DBAPI cursor (no Row objects: this is the hot path)."""
    dbapi = conn.connection.dbapi_connection
    if conn.dialect.name == "postgresql":
        sql = _PARAM.sub(r"%(\1)s", sql)
        cursor = dbapi.cursor(binary=True)
    else:
        cursor = dbapi.cursor()
    try:
        cursor.execute(sql, params or {})
        return cursor.fetchall()
    finally:
        cursor.close()


def to_float(value) -> float | None:
    """A stored REAL as a float: SQLite keeps NaN as the TEXT 'NaN' (storage.bulk)."""
    return None if value is None else float(value)
