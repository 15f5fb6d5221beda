"""The monitor's storage: every SQL statement of the server lives in this package.

`AbstractStore` (storage.abstract) is the interface, `SqlAlchemyStore` its implementation on SQLite or
PostgreSQL; both speak the dataclasses of storage.entities. The ORM models (monitor.models) are the schema
that the migrations keep.
"""

from fp8mon.monitor.storage.abstract import AbstractStore, AlertStore
from fp8mon.monitor.storage.errors import BadParameter, InvalidData, NotFound, QueryError, StorageUnavailable
from fp8mon.monitor.storage.sqlalchemy_store import SqlAlchemyStore

__all__ = ["AbstractStore", "AlertStore", "BadParameter", "InvalidData", "NotFound", "QueryError",
           "SqlAlchemyStore", "StorageUnavailable"]
