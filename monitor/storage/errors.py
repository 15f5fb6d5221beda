"""Errors of the storage interface that the REST API maps to status codes."""


class QueryError(Exception):
    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotFound(QueryError):
    status = 404


class BadParameter(QueryError):
    status = 422


class RunConflict(QueryError):
    """A batch asks to resume (resume "must") a run the monitor does not have."""

    status = 409


class StorageUnavailable(QueryError):
    """The database failed (unreachable, locked, out of space): nothing was written; retry later."""

    status = 503

    def __init__(self, cause: Exception):
        super().__init__(f"storage unavailable: {type(cause).__name__}; retry")
        self.cause_name = type(cause).__name__


class InvalidData(QueryError):
    """The database refused a value (a NUL in text, a number out of a column's range): retrying cannot help."""

    status = 422

    def __init__(self, cause: Exception):
        detail = str(getattr(cause, "orig", None) or cause).strip().splitlines()
        super().__init__(f"invalid value, refused by the database: {detail[0] if detail else type(cause).__name__}")
