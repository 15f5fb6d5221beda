"""Bulk upserts of the wide statistic rows: the ingest hot path, one statement per table and batch.

SQLite gets an executemany of an UPSERT; PostgreSQL gets one INSERT ... SELECT FROM unnest(arrays),
which ships each column as one array parameter instead of a row at a time. A (series, rank, step) that
arrives again (a resumed run re-logging steps) replaces the earlier row: last write wins.
"""

import numpy as np
from sqlalchemy import Connection

from agent.wire import TENSOR_STATS

TENSOR_COLUMNS = ("series_id", "rank", "step", *TENSOR_STATS, "log2_hist")
SCALAR_COLUMNS = ("series_id", "rank", "step", "value")
KEY = ("series_id", "rank", "step")
FLOAT_COLUMNS = frozenset((*TENSOR_STATS, "value"))
_PG_TYPES = {"series_id": "int4", "rank": "int2", "step": "int8", "log2_hist": "bytea"}


def upsert(conn: Connection, table: str, columns: tuple[str, ...], data: dict[str, list]) -> None:
    """Write `data` (column name -> list, all the same length) into `table`."""
    if conn.dialect.name == "sqlite":
        _sqlite_upsert(conn, table, columns, data)
    else:
        _postgres_upsert(conn, table, columns, data)


def _update_clause(columns) -> str:
    return ", ".join(f"{c} = excluded.{c}" for c in columns if c not in KEY)


def _sqlite_upsert(conn: Connection, table: str, columns, data) -> None:
    # SQLite turns a NaN parameter into NULL; bound as the text 'NaN' it survives in the REAL column
    # (text that is not a number keeps its text type) and reads back through float().
    cols = [sqlite_safe(data[c]) if c in FLOAT_COLUMNS else data[c] for c in columns]
    sql = (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
           f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {_update_clause(columns)}")
    conn.exec_driver_sql(sql, list(zip(*cols)))


def sqlite_safe(column: list) -> list:
    # np.array maps None to NaN too, so a column with gaps takes the exact slow path.
    if not np.isnan(np.array(column, dtype=np.float64)).any():
        return column
    return ["NaN" if v is not None and v != v else v for v in column]


def _postgres_upsert(conn: Connection, table: str, columns, data) -> None:
    params = {f"c{i}": data[c] for i, c in enumerate(columns)}
    arrays = ", ".join(f"%(c{i})s::{_PG_TYPES.get(c, 'float8')}[]" for i, c in enumerate(columns))
    sql = (f"INSERT INTO {table} ({', '.join(columns)}) SELECT * FROM unnest({arrays}) "
           f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {_update_clause(columns)}")
    conn.exec_driver_sql(sql, params)
