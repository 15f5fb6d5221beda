"""Shared pieces of the query routers: NaN-safe JSON responses and error mapping."""

import json
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import HTTPException, Path
from fastapi.responses import JSONResponse

from fp8mon.monitor.jsonvalues import json_safe
from fp8mon.monitor.storage import QueryError, StorageUnavailable

# Run names may contain '/', so the path parameter takes the rest of the path; routes with a suffix
# (/runs/{run}/series, ...) are registered before the bare /runs/{run}.
RunPath = Annotated[str, Path(description="run name (may contain '/')", min_length=1, max_length=200)]

ERRORS = {404: {"description": "unknown run or series; the message says which"},
          422: {"description": "invalid parameter; the message names it"},
          503: {"description": "storage unavailable; retry later"}}


class SafeJSONResponse(JSONResponse):
    """JSON without NaN/Infinity literals: payloads are built with them as strings already; anything else
    non-finite is converted rather than crashing the encoder."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()
        except ValueError:
            return json.dumps(json_safe(content), allow_nan=False, separators=(",", ":"),
                              ensure_ascii=False).encode()


@contextmanager
def http_errors():
    try:
        yield
    except StorageUnavailable as exc:
        raise HTTPException(exc.status, exc.message, headers={"Retry-After": "1"}) from None
    except QueryError as exc:
        raise HTTPException(exc.status, exc.message) from None
