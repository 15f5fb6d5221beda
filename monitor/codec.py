"""Request bodies: size limits, gzip, and JSON or msgpack into the validated ingest batch."""

import json
import math
import zlib

import msgpack
import numpy as np
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
            batch = IngestBatch.model_validate_json(body)
            infinities = _infinities(batch)
            if infinities and infinities > body.count(b"Infinity"):
                _refuse_overflow(body)
            return batch
    except ValidationError as exc:
        raise BodyError(422, _describe(exc)) from None
    raise BodyError(415, f"unsupported Content-Type {media_type!r}: use application/json or application/msgpack")


# A JSON number beyond float64's range (1e309) parses as infinity, which would store a value nobody sent
# and page the non-finite alert. A JSON infinity is spelt `Infinity` or "Infinity": only a batch with more
# infinities than that word in its body is parsed a second time, to find the number (scanning every body
# for long exponents costs more than this count).
def _infinities(batch: IngestBatch) -> int:
    columns = list(batch.tensors.stats.values()) if batch.tensors is not None else []
    if batch.scalars is not None:
        columns.append(batch.scalars.value)
    n = sum(int(np.isinf(np.array(col, dtype=np.float64)).sum()) for col in columns)  # None -> NaN
    if batch.sent_at is not None and math.isinf(batch.sent_at):
        n += 1
    if batch.run_meta is not None and batch.run_meta.config:
        n += str(batch.run_meta.config).count("Infinity")  # json_config spelt them so
    return n


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
