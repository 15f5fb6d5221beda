"""Cross-site request refusal for the routes that change state (POST, PUT, PATCH, DELETE).

A browser attaches nothing secret to a cross-site request here (the dashboard keeps its token in the tab and sends
it as a header), but on a server without tokens any page the user visits could post to it. Three checks, each
enough against a different browser:
- `Sec-Fetch-Site` (every current browser): anything but same-origin or a user's own navigation is refused;
- `Origin`: when present it must name this server (its Host header, or `public_url`);
- a request must carry the `X-Fp8mon-Client` header or a bearer token, which a cross-site form cannot send and a
  cross-site script cannot without a CORS preflight (never granted). The agent, `fp8mon sync` and the dashboard
  send the header; other programs (curl, scripts) send it or a token.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from fp8mon.agent.wire import CLIENT_HEADER

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAME_SITE_OK = frozenset({"same-origin", "none"})  # "none": typed in the address bar, a bookmark


def _authority(netloc: str) -> str:
    """`host[:port]` lower-cased, without a default port (80, 443)."""
    netloc = netloc.strip().lower()
    for default in (":80", ":443"):
        if netloc.endswith(default):
            return netloc[: -len(default)]
    return netloc


def refusal(headers: Headers, trusted: frozenset[str] = frozenset()) -> str | None:
    """Why a state-changing request with these headers is refused as cross-site, or None. `trusted`: authorities
    (`host[:port]`) besides the request's own Host that count as this server."""
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.lower() not in _SAME_SITE_OK:
        return f"cross-site request refused (Sec-Fetch-Site: {fetch_site})"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        own = {_authority(headers.get("host", "")), *trusted}
        if parts.scheme not in ("http", "https") or _authority(parts.netloc) not in own:
            return f"cross-site request refused: Origin {origin[:100]} is not this server"
    if CLIENT_HEADER.lower() not in headers and not headers.get("authorization", "").lower().startswith("bearer "):
        return (f"a request that changes state needs the {CLIENT_HEADER} header (any value; the dashboard, the "
                "agent and fp8mon sync send it) or a bearer token")
    return None


class CrossSiteGuard:
    """ASGI middleware: answers 403 to a state-changing request that `refusal` refuses."""

    def __init__(self, app, *, trusted_urls: tuple[str, ...] = ()):
        self.app = app
        self.trusted = frozenset(_authority(urlsplit(url).netloc) for url in trusted_urls if url)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in UNSAFE_METHODS:
            reason = refusal(Headers(scope=scope), self.trusted)
            if reason is not None:
                await JSONResponse({"detail": reason}, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
