"""GET /docs (Swagger UI) and /redoc with their scripts and stylesheet served by the monitor itself, from the
installed `fastapi-offline` package: the API's documentation works on a machine with no Internet access."""

from functools import cache, lru_cache
from importlib.metadata import version
from importlib.resources import files

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

router = APIRouter(include_in_schema=False)

ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8",
          "redoc.standalone.js": "text/javascript; charset=utf-8", "favicon.png": "image/png"}
# The URLs carry the package's version: an upgrade changes them, so a year's cache is safe.
CACHE = "public, max-age=31536000, immutable"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


@lru_cache(maxsize=1)
def assets_version() -> str:
    return version("fastapi-offline")


def asset_url(name: str) -> str:
    return f"/static/docs/{name}?v={assets_version()}"


@cache
def _asset(name: str) -> bytes:
    return (files("fastapi_offline") / "static" / name).read_bytes()


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=request.app.openapi_url, title="fp8mon API",
                               oauth2_redirect_url=OAUTH2_REDIRECT,
                               swagger_js_url=asset_url("swagger-ui-bundle.js"),
                               swagger_css_url=asset_url("swagger-ui.css"),
                               swagger_favicon_url=asset_url("favicon.png"))


@router.get(OAUTH2_REDIRECT)
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url=request.app.openapi_url, title="fp8mon API",
                          redoc_js_url=asset_url("redoc.standalone.js"), redoc_favicon_url=asset_url("favicon.png"),
                          with_google_fonts=False)


@router.api_route("/static/docs/{name}", methods=["GET", "HEAD"])
def docs_asset(name: str) -> Response:
    if name not in ASSETS:  # a fixed list: no path from the URL reaches the file system
        raise HTTPException(404, f"no documentation asset {name!r}")
    return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": CACHE})
