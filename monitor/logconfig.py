"""The server's logging: one line per record with a UTC timestamp and the level (or one JSON object per line),
for uvicorn's loggers and fp8mon's own; bearer tokens in request URLs (`/?token=...`) are redacted everywhere."""

from __future__ import annotations

import json
import logging
import re
import time

TOKEN_IN_URL = re.compile(r"([?&](?:access_)?token=)[^&#\s\"]*", re.IGNORECASE)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class UtcFormatter(logging.Formatter):
    """`2026-01-31T12:00:00.123Z LEVEL logger: message`."""

    converter = time.gmtime

    def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's name)
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(UtcFormatter):
    """One JSON object per line: time, level, logger, message (and the traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class RedactTokens(logging.Filter):
    """Replaces the value of `token=` query parameters in the formatted message (uvicorn's access lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = TOKEN_IN_URL.sub(r"\1[redacted]", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def log_config(level: str = "info", fmt: str = "text") -> dict:
    """A logging.config.dictConfig for uvicorn.run(log_config=...): uvicorn's loggers and `fp8mon.*` to stderr."""
    formatter = ({"()": JsonFormatter} if fmt == "json" else {"()": UtcFormatter, "fmt": TEXT_FORMAT})
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact_tokens": {"()": RedactTokens}},
        "formatters": {"line": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "line",
                                "filters": ["redact_tokens"]}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["stderr"], "level": level, "propagate": False},
            "fp8mon": {"handlers": ["stderr"], "level": level, "propagate": False},
        },
    }
