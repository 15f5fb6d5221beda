"""Request bodies: size limits, gzip, and JSON or msgpack into the validated ingest batch."""

import json
import math
import re
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
            if _MAYBE_OVERFLOW.search(body):
                _refuse_overflow(body)
            return IngestBatch.model_validate_json(body)
    except ValidationError as exc:
        raise BodyError(422, _describe(exc)) from None
    raise BodyError(415, f"unsupported Content-Type {media_type!r}: use application/json or application/msgpack")


# A JSON number beyond float64's range (1e309) parses as infinity, which would store a value nobody sent
# and page the non-finite alert. Numbers with a three-digit exponent or 300 digits are rare, so only bodies
# that have one are parsed a second time to find them.
_MAYBE_OVERFLOW = re.compile(rb"[0-9][eE]\+?[0-9]{3}|[0-9]{300}")


class _Overflow(str):
    pass


def _parse_float(text: str):
    value = float(text)
    return _Overflow(text) if math.isinf(value) else value


def _refuse_overflow(body: bytes) -> None:
    try:
        payload = json.loads(body, parse_float=_parse_float, parse_int=_parse_int)
    except (ValueError, RecursionError):
        return  # not JSON: the validator says why
    where = _find_overflow(payload, [])
    if where is not None:
        path, text = where
        raise BodyError(422, f"{'.'.join(path) or 'body'}: the number {text[:40]} is beyond float64's range; send "
                             f"Infinity (or \"Infinity\") for an infinite value")


def _parse_int(text: str):
    return _Overflow(text) if len(text) > 308 else int(text)


def _find_overflow(obj, path: list[str]):
    if isinstance(obj, _Overflow):
        return path, str(obj)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        found = _find_overflow(value, [*path, str(key)])
        if found is not None:
            return found
    return None


def _describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field path, e.g. `tensors.stats.amax.3: Input should be ...`."""
    lines = []
    for error in exc.errors(include_url=False)[:20]:
        where = ".".join(str(part) for part in error["loc"]) or "body"
        lines.append(f"{where}: {error['msg']}")
    if exc.error_count() > 20:
        lines.append(f"... and {exc.error_count() - 20} more errors")
    return "; ".join(lines)
