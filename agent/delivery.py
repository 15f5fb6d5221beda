"""What the monitor's answer to one posted batch means, and what to tell the user about it.

Shared by the agent's transport and `fp8mon sync`: a batch is stored (200, also a duplicate: batch ids make a
retry harmless), worth retrying (unreachable, 5xx, 408/425/429), refused for the token (401/403: every batch will
be, until the token is fixed; the batch stays in the spool) or refused as such (any other answer: sending it again
cannot pass; it is set aside under the spool's ``rejected/`` with the server's answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

__all__ = ["DeliveryError", "DeliveryStatus", "Outcome", "ingest_url", "post"]

INGEST_PATH = "/api/v1/ingest"

STORED, RETRY, AUTH, REFUSED = "stored", "retry", "auth", "refused"
_RETRYABLE = {408, 425, 429}


class DeliveryError(Exception):
    """A delivery failure the user has to fix (the message says what); the agent counts it in ``agent.errors``."""


class TokenRefused(DeliveryError):
    pass


class BatchRefused(DeliveryError):
    pass


class SpoolUnwritable(DeliveryError):
    pass


class ResumeRefused(DeliveryError):
    """resume='must' for a run the monitor does not have (at construction, or a batch answered 409)."""


@dataclass(frozen=True)
class DeliveryStatus:
    """Where the agent's delivery stands (``agent.status()``); counts are batches.

    ``state``: "ok"; "retrying" (the monitor is unreachable or answers 5xx: the batches wait and are retried);
    "refused" (401/403: the token is missing or wrong, the batches wait in the spool); "closed".
    ``run``: the name the monitor stores the run under, once it has answered (a taken name gets a suffix)."""

    state: str
    delivered: int = 0
    pending: int = 0  # waiting in the spool directory
    in_memory: int = 0  # waiting in memory: the spool directory could not be written
    set_aside: int = 0  # refused for good, kept under <spool>/rejected with the server's answer
    lost: int = 0  # dropped: beyond the spool's bound, or in memory at exit
    last_error: str | None = None
    run: str | None = None


@dataclass(frozen=True)
class Outcome:
    kind: str  # STORED, RETRY, AUTH or REFUSED
    message: str = ""
    duplicate: bool = False
    run: str | None = None  # STORED: the name the monitor stores the run under
    code: int = 0  # the HTTP status, 0 when none came
    retry_after: float = 0.0  # seconds the server asked to wait (Retry-After) before the next try


def ingest_url(url: str) -> str:
    """The ingest endpoint under the monitor's base ``url``; ValueError when it is no http(s) address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"monitor url {url!r} needs a scheme and a host, e.g. http://127.0.0.1:8080")
    return url.rstrip("/") + INGEST_PATH


def post(client: httpx.Client, url: str, body: bytes) -> Outcome:
    """POST one encoded batch and classify the answer."""
    try:
        response = client.post(url, content=body)
    except httpx.HTTPError as exc:
        return Outcome(RETRY, f"{type(exc).__name__}: {exc}")
    code = response.status_code
    if code == 200:
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        return Outcome(STORED, duplicate=bool(answer.get("duplicate")), run=answer.get("run"))
    detail = response.text[:300].strip()
    if code >= 500 or code in _RETRYABLE:
        return Outcome(RETRY, f"{code} from {url}: {detail}", code=code, retry_after=_retry_after(response))
    if code in (401, 403):
        return Outcome(AUTH, _TOKEN_HINT[code].format(url=url, detail=detail), code=code)
    return Outcome(REFUSED, _refusal(code, url, detail, response.headers.get("location")), code=code)


def _retry_after(response: httpx.Response) -> float:
    """Retry-After in seconds, within [0, 300]; 0 when absent or an HTTP date (the back-off then decides)."""
    try:
        return min(max(float(response.headers.get("retry-after", "0")), 0.0), 300.0)
    except ValueError:
        return 0.0


_TOKEN_HINT = {
    401: "401 from {url}: the token is missing or wrong; set FP8MON_TOKEN or token=",
    403: "403 from {url}: the token is not one that may ingest ({detail}); set FP8MON_TOKEN or token= to a write "
         "token of the monitor",
}


def _refusal(code: int, url: str, detail: str, location: str | None) -> str:
    if code == 404:
        return (f"404 from {url}: no fp8mon ingest there; url= must be the monitor's base address "
                f"(e.g. http://127.0.0.1:8080)")
    if code == 409:
        return (f"409 from {url}: {detail}; resume='must' continues only a run the monitor has (check run= and "
                f"run_id=, or pass resume='allow')")
    if code == 413:
        return f"413 from {url}: the batch is larger than the server accepts; lower max_batch_records= ({detail})"
    if 300 <= code < 400:
        return f"{code} from {url}: the monitor redirects to {location}; use that address as url="
    return f"{code} from {url}: the monitor refused the batch: {detail}"
