"""FastAPI dependencies: settings, the store, metrics, the pipeline, and token scopes."""

import re
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fp8mon.monitor.metrics import Metrics
from fp8mon.monitor.pipeline import Pipeline
from fp8mon.monitor.settings import Settings
from fp8mon.monitor.storage import AbstractStore

_bearer = HTTPBearer(auto_error=False)
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750's b64token


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> AbstractStore:
    return request.app.state.store


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_pipeline(request: Request) -> Pipeline | None:
    """None outside the application's lifespan."""
    return request.app.state.pipeline


def _token_in(token: str, allowed: list[str]) -> bool:
    # as bytes: compare_digest refuses str with non-ASCII characters (headers arrive decoded as latin-1)
    raw = token.encode("latin-1", "replace")
    return any(secrets.compare_digest(raw, candidate.encode()) for candidate in allowed)


def _require(scope: str):
    def check(settings: Annotated[Settings, Depends(get_settings)],
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if not settings.write_tokens and not settings.read_tokens:
            return  # no tokens configured: an open local server
        if credentials is None:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not _TOKEN68.fullmatch(credentials.credentials):
            raise HTTPException(401, "malformed bearer token: printable ASCII letters, digits and -._~+/= only",
                                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        allowed = settings.write_tokens if scope == "write" else settings.read_tokens + settings.write_tokens
        if not _token_in(credentials.credentials, allowed):
            raise HTTPException(403, f"token lacks the {scope} scope")

    return check


StoreDep = Annotated[AbstractStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
PipelineDep = Annotated[Pipeline | None, Depends(get_pipeline)]
require_read = Depends(_require("read"))
require_write = Depends(_require("write"))
