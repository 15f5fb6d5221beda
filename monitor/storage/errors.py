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
