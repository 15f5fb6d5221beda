"""Bulk upserts of the wide statistic rows: the ingest hot path, one statement per table and batch.

SQLite gets an executemany of an UPSERT. PostgreSQL gets a binary COPY (psycopg packs the rows in C, no
per-value text formatting), straight into the table while the keys are new, else into a temporary
staging table followed by one INSERT ... SELECT ... ON CONFLICT. A (series, rank, step) that arrives
again (a client re-sending steps of its run) replaces the earlier row, every column: last write wins.
Columns the caller leaves out of `data` are written as NULL without binding a parameter per row.
Callers pass rows unique by key and sorted by it, so concurrent upserts take row locks in one order.
"""

import numpy as np
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from fp8mon.agent.wire import TENSOR_STATS

TENSOR_COLUMNS = ("series_id", "rank", "step", *TENSOR_STATS, "log2_hist")
SCALAR_COLUMNS = ("series_id", "rank", "step", "value")
KEY = ("series_id", "rank", "step")
FLOAT_COLUMNS = frozenset((*TENSOR_STATS, "value"))
_PG_TYPES = {"series_id": "int4", "rank": "int2", "step": "int8", "log2_hist": "bytea"}


def upsert(conn: Connection, table: str, columns: tuple[str, ...], data: dict[str, list]) -> None:
    """Write `data` (column name -> list, all the same length, the key columns included) into `table`,
    whose columns are `columns`."""
    present = [c for c in columns if c in data]
    update = ", ".join(f"{c} = excluded.{c}" if c in data else f"{c} = NULL" for c in columns if c not in KEY)
    upsert_clause = f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {update}"
    if conn.dialect.name == "sqlite":
        _sqlite_upsert(conn, table, present, data, upsert_clause)
    else:
        _postgres_upsert(conn, table, present, data, upsert_clause)


def _sqlite_upsert(conn: Connection, table: str, present: list[str], data, upsert_clause: str) -> None:
    # SQLite turns a NaN parameter into NULL; bound as the text 'NaN' it survives in the REAL column
    # (text that is not a number keeps its text type) and reads back through float().
    cols = [sqlite_safe(data[c]) if c in FLOAT_COLUMNS else data[c] for c in present]
    sql = f"INSERT INTO {table} ({', '.join(present)}) VALUES ({', '.join('?' * len(present))}) {upsert_clause}"
    conn.exec_driver_sql(sql, list(zip(*cols)))


def sqlite_safe(column: list) -> list:
    # np.array maps None to NaN too, so a column with gaps takes the exact slow path.
    if not np.isnan(np.array(column, dtype=np.float64)).any():
        return column
    return ["NaN" if v is not None and v != v else v for v in column]


def _postgres_upsert(conn: Connection, table: str, present: list[str], data, upsert_clause: str) -> None:
    # New keys, the common case: COPY straight into the table, half the database work of staging the rows
    # and upserting them. A key that exists (a run re-logging steps) fails the COPY, and only then are
    # the rows staged and upserted.
    try:
        with conn.begin_nested():
            _copy(conn, table, present, data)
        return
    except IntegrityError:
        pass
    stage, names = f"_stage_{table}", ", ".join(present)
    conn.exec_driver_sql(f"CREATE TEMPORARY TABLE IF NOT EXISTS {stage} (LIKE {table}) ON COMMIT DELETE ROWS")
    conn.exec_driver_sql(f"TRUNCATE {stage}")
    _copy(conn, stage, present, data)
    conn.exec_driver_sql(f"INSERT INTO {table} ({names}) SELECT {names} FROM {stage} {upsert_clause}")


def _copy(conn: Connection, table: str, present: list[str], data) -> None:
    sql = f"COPY {table} ({', '.join(present)}) FROM STDIN (FORMAT BINARY)"
    try:  # the COPY goes through the driver, so its errors are wrapped here as SQLAlchemy would
        with conn.connection.dbapi_connection.cursor() as cursor, cursor.copy(sql) as copy:
            copy.set_types([_PG_TYPES.get(c, "float8") for c in present])
            for row in zip(*(data[c] for c in present)):
                copy.write_row(row)
    except conn.dialect.dbapi.Error as exc:
        raise DBAPIError.instance(sql, None, exc, conn.dialect.dbapi.Error) from exc
