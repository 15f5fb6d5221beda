"""Conditional GETs for the REST API: every JSON answer to a GET carries an ETag (a hash of its body), and a
request whose If-None-Match names it gets 304 Not Modified with no body.

A dashboard tab polls the same runs, series, heatmaps, alerts and predictions every few seconds; while a run
is idle nothing in those answers changes, and the browser's cache revalidates each one (`Cache-Control:
no-cache`) for a few hundred bytes of headers instead of the whole payload. The server still runs the query;
what it saves is the transfer and the client's parsing and redrawing.
"""

from __future__ import annotations

import hashlib
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CACHE_CONTROL = b"private, no-cache"


def etag_of(body: bytes) -> bytes:
    return b'W/"' + hashlib.blake2b(body, digest_size=16).hexdigest().encode() + b'"'


def matches(if_none_match: str, etag: str) -> bool:
    """Weak comparison (RFC 9110 13.1.2): W/ prefixes are ignored; * matches anything."""
    def bare(tag: str) -> str:
        return tag.strip().removeprefix("W/")

    tags = [bare(t) for t in re.split(r",", if_none_match) if t.strip()]
    return "*" in tags or bare(etag) in tags


class ConditionalGetMiddleware:
    """ETags on the 200 JSON answers of GET requests under `prefix`; 304 when If-None-Match names it."""

    def __init__(self, app: ASGIApp, prefix: str = "/api/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "GET"
                or not scope["path"].startswith(self.prefix)):
            await self.app(scope, receive, send)
            return
        asked = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"if-none-match"), None)
        start: Message | None = None
        chunks: list[bytes] = []
        passing = False

        async def buffered_send(message: Message) -> None:
            nonlocal start, passing
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] != 200 or not json or b"etag" in headers:
                    passing = True
                    await send(message)
                else:
                    start = message
                return
            if passing or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await _finish(send, start, b"".join(chunks), asked)

        await self.app(scope, receive, buffered_send)


async def _finish(send: Send, start: Message, body: bytes, asked: str | None) -> None:
    etag = etag_of(body)
    headers = [(k, v) for k, v in start.get("headers", []) if k not in (b"etag", b"cache-control")]
    headers += [(b"etag", etag), (b"cache-control", CACHE_CONTROL)]
    if asked is not None and matches(asked, etag.decode()):
        kept = [(k, v) for k, v in headers if k not in (b"content-length", b"content-type")]
        await send({"type": "http.response.start", "status": 304, "headers": kept})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
