"""Request bodies: size limits, gzip, and JSON or msgpack into the validated ingest batch."""

import zlib

import msgpack
from pydantic import ValidationError

from fp8mon.monitor.wire import IngestBatch

JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


class BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def inflate(raw: bytes, encoding: str | None, limit: int) -> bytes:
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return raw
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise BodyError(415, f"unsupported Content-Encoding {encoding!r}: use gzip or none")
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: accept gzip and zlib headers
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BodyError(400, f"body is not valid {encoding} data: {exc}") from None
    if len(body) > limit or inflater.unconsumed_tail:
        raise BodyError(413, f"inflated body is larger than the limit of {limit} bytes")
    if not inflater.eof:
        raise BodyError(400, f"{encoding} body is truncated")
    return body


def parse_batch(body: bytes, content_type: str | None) -> IngestBatch:
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    try:
        if media_type in MSGPACK_TYPES:
            try:
                payload = msgpack.unpackb(body, raw=False, strict_map_key=True)
            except Exception as exc:  # msgpack raises several unrelated types for corrupt input
                raise BodyError(400, f"body is not valid msgpack: {exc}") from None
            return IngestBatch.model_validate(payload)
        if media_type in JSON_TYPES:
            return IngestBatch.model_validate_json(body)
    except ValidationError as exc:
        raise BodyError(422, _describe(exc)) from None
    raise BodyError(415, f"unsupported Content-Type {media_type!r}: use application/json or application/msgpack")


def _describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field path, e.g. `tensors.stats.amax.3: Input should be ...`."""
    lines = []
    for error in exc.errors(include_url=False)[:20]:
        where = ".".join(str(part) for part in error["loc"]) or "body"
        lines.append(f"{where}: {error['msg']}")
    if exc.error_count() > 20:
        lines.append(f"... and {exc.error_count() - 20} more errors")
    return "; ".join(lines)
