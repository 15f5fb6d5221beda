"""Engine creation: SQLite (a file in WAL mode) or PostgreSQL through psycopg 3."""

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_WAL_AUTOCHECKPOINT_PAGES = 16384  # 64 MiB of 4 KiB pages
# FULL: each commit's WAL frames are fsynced before ingest acknowledges it, so an acknowledged batch survives a
# power loss or an OS crash (NORMAL survives a killed process only). `?synchronous=normal` in the URL trades that
# for ingest speed; docs/operations.md has the measured cost.
SQLITE_SYNCHRONOUS = ("FULL", "NORMAL")


def normalise_url(url: str) -> str:
    """Accept the URLs people paste (postgres://, postgresql://) and route them to psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def create_db_engine(url: str, *, pool_size: int = 8, writer: bool = True) -> Engine:
    """`writer=False` gives SQLite readers deferred transactions, so queries never wait on ingest."""
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        synchronous = parsed.query.get("synchronous", "full").upper()
        if synchronous not in SQLITE_SYNCHRONOUS:
            raise ValueError(f"synchronous={synchronous.lower()} in the database URL: use full or normal")
        url = parsed.difference_update_query(["synchronous"]).render_as_string(hide_password=False)
        return _sqlite_engine(url, parsed.database, immediate=writer, synchronous=synchronous)
    if parsed.get_backend_name() == "postgresql":
        return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
    raise ValueError(f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
                     "use sqlite:///path.db or postgresql+psycopg://user@host/db")


def _sqlite_engine(url: str, database: str | None, *, immediate: bool, synchronous: str) -> Engine:
    if database and database != ":memory:":
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record):
        # The driver's implicit transactions are turned off so that SQLAlchemy's BEGIN is the only one.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA cache_size=-65536")
        if immediate:
            # Each ingest commit appends ~1 dirty page per series to the WAL; checkpointing (copying the WAL
            # into the database, with fsyncs) every 1000 pages meant one checkpoint per batch. A larger WAL
            # lets a checkpoint write each page once for many batches; durability still rests on the WAL.
            cursor.execute(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_AUTOCHECKPOINT_PAGES}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        # IMMEDIATE takes the write lock up front, so two writers queue instead of failing to upgrade.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"
