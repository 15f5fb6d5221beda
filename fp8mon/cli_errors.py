"""What went wrong in a `fp8mon` command, as the one line the user reads (`fp8mon --debug ...` shows the traceback).

Only the standard library here: the modules whose errors are described (SQLAlchemy, pydantic) are looked up in
`sys.modules`, since an error of theirs means they were imported.
"""

from __future__ import annotations

import errno
import sys

# The extra that provides each top-level package a command may miss.
EXTRA_OF = {"fastapi": "monitor", "uvicorn": "monitor", "sqlalchemy": "monitor", "alembic": "monitor",
            "pydantic": "monitor", "pydantic_settings": "monitor", "prometheus_client": "monitor",
            "psycopg": "monitor", "starlette": "monitor", "torch": "trainer", "triton": "trainer", "tqdm": "agent"}


class CommandError(Exception):
    """A mistake a command found itself; its message is the line to print, `code` the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def describe(exc: BaseException) -> tuple[str, int] | None:
    """(the line, the exit status) for a mistake users make; None for anything else (a bug: still one line)."""
    if isinstance(exc, CommandError):
        return str(exc), exc.code
    if isinstance(exc, ModuleNotFoundError):
        top = (exc.name or "").split(".")[0]
        if top in EXTRA_OF:
            return f"needs {top}, which this install lacks: pip install 'fp8mon[{EXTRA_OF[top]}]'", 2
        return None
    for error in (exc, exc.__cause__):  # the store wraps the database's errors (StorageUnavailable)
        sqlalchemy_error = _sqlalchemy(error)
        if sqlalchemy_error is not None:
            return sqlalchemy_error, 1
    validation = sys.modules.get("pydantic")
    if validation is not None and isinstance(exc, validation.ValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()[:5])
        return f"invalid setting ({problems})", 2
    if isinstance(exc, OSError) and exc.strerror:  # a path that cannot be made or read, an address in use
        if exc.errno == errno.EADDRINUSE:
            return f"address in use: {exc.strerror}", 1
        return (f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror), 1
    if isinstance(exc, ValueError) and "database URL" in str(exc):
        return str(exc), 2
    return None


def _sqlalchemy(exc: BaseException) -> str | None:
    errors = sys.modules.get("sqlalchemy.exc")
    if errors is None or not isinstance(exc, errors.SQLAlchemyError):
        return None
    detail = _first_line(getattr(exc, "orig", None) or exc)
    if isinstance(exc, (errors.ArgumentError, errors.NoSuchModuleError)):
        return f"bad database URL: {detail}; use sqlite:///path.db or postgresql+psycopg://user@host/db"
    lowered = detail.lower()
    if "no such table" in lowered or ("relation" in lowered and "does not exist" in lowered):
        return f"the database has no fp8mon schema ({detail}): run `fp8mon db upgrade --database-url URL`"
    if isinstance(exc, (errors.OperationalError, errors.InterfaceError)):
        return f"cannot use the database: {detail}"
    return f"database error: {detail}"


def _first_line(exc: object) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
