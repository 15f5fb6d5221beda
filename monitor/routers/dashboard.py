"""GET /: the web dashboard (one HTML page, its scripts, one stylesheet) and plotly.js from the installed
`plotly` package: nothing is loaded from a CDN.

The page itself needs no token (it holds no data); the script calls /api/v1 with the bearer token the user
gives (`/?token=...`, kept in the tab's sessionStorage), so an API with read tokens stays protected.
"""

import gzip
import hashlib
import re
from functools import cache, lru_cache
from importlib.resources import files

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

router = APIRouter(include_in_schema=False)

STATIC = files("fp8mon.monitor") / "static"
OWN_ASSETS = {"common.js": "text/javascript; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
              "alerts.js": "text/javascript; charset=utf-8", "compare.js": "text/javascript; charset=utf-8",
              "dashboard.css": "text/css; charset=utf-8"}
# The page asks for plotly.min.js?v=<version>, so a plotly upgrade changes the URL and a year's cache is safe.
PLOTLY_CACHE = "public, max-age=31536000, immutable"
# Our own script and stylesheet change with fp8mon itself: revalidate each time (cheap with the ETag).
OWN_CACHE = "no-cache"
# the run view's parts, one script each
RUN_VIEW_SCRIPTS = ("overview.js", "scalars.js", "heatmap.js", "histogram.js", "drilldown.js")
OWN_ASSETS.update({name: "text/javascript; charset=utf-8" for name in RUN_VIEW_SCRIPTS})


@lru_cache(maxsize=1)
def plotly_version() -> str:
    import plotly

    return plotly.__version__


@lru_cache(maxsize=1)
def _plotly_bytes() -> tuple[bytes, bytes]:
    """plotly.min.js (about 4.6 MB) as is and gzipped (about a third), read once."""
    raw = (files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return raw, gzip.compress(raw, compresslevel=4, mtime=0)


@cache
def _asset(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def _not_modified(request: Request, etag: str) -> bool:
    return etag in re.split(r"\s*,\s*", request.headers.get("if-none-match", ""))


@router.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
def dashboard_page() -> HTMLResponse:
    html = _asset("index.html").decode().replace("{{plotly_version}}", plotly_version())
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


@router.api_route("/static/plotly.min.js", methods=["GET", "HEAD"])
def plotly_js(request: Request) -> Response:
    raw, packed = _plotly_bytes()
    etag = _etag(raw[:4096] + plotly_version().encode())
    headers = {"Cache-Control": PLOTLY_CACHE, "ETag": etag, "Vary": "Accept-Encoding"}
    if _not_modified(request, etag):
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(packed, media_type="text/javascript; charset=utf-8",
                        headers={**headers, "Content-Encoding": "gzip"})
    return Response(raw, media_type="text/javascript; charset=utf-8", headers=headers)


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
def own_asset(request: Request, name: str) -> Response:
    if name not in OWN_ASSETS:  # a fixed list: no path ever reaches the file system from the URL
        raise HTTPException(404, f"no static file {name!r}")
    body = _asset(name)
    etag = _etag(body)
    headers = {"Cache-Control": OWN_CACHE, "ETag": etag}
    if _not_modified(request, etag):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=OWN_ASSETS[name], headers=headers)
