"""POST /api/v1/ingest: the agent's write path (docs/wire-format.md)."""

import time

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from fp8mon.monitor.codec import BodyError, inflate, parse_batch
from fp8mon.monitor.deps import MetricsDep, SettingsDep, StoreDep, require_write
from fp8mon.monitor.storage import QueryError, StorageUnavailable
from fp8mon.monitor.wire import IngestBatch, IngestResult, ResumePoint, ResumeQuery

router = APIRouter(tags=["ingest"], dependencies=[require_write])

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "An ingest batch (docs/wire-format.md), as JSON or msgpack, optionally gzip-encoded.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}},
            "application/msgpack": {"schema": {"$ref": "#/components/schemas/IngestBatch"}},
        },
    }
}


def add_body_schema(openapi: dict) -> dict:
    """The route reads its body itself (JSON or msgpack, gzip), so FastAPI does not list the IngestBatch
    model that _BODY_DOC refers to: add it, and the models it uses, to the schema's components."""
    schema = IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components["IngestBatch"] = schema
    return openapi


@router.post("/ingest", response_model=IngestResult, openapi_extra=_BODY_DOC,
             responses={413: {"description": "body too large"}, 415: {"description": "unsupported encoding"},
                        409: {"description": "resume 'must' for a run the monitor does not have"},
                        422: {"description": "invalid batch; the message names the field"},
                        503: {"description": "storage unavailable or too many bytes in flight; retry later "
                                              "(Retry-After)"}})
async def ingest(request: Request, store: StoreDep, settings: SettingsDep, metrics: MetricsDep) -> IngestResult:
    started = time.perf_counter()
    try:
        result = await _ingest(request, store, settings)
    except HTTPException:
        metrics.ingest_rejected.inc()
        raise
    finally:
        metrics.ingest_duration.observe(time.perf_counter() - started)
    if result.duplicate:
        metrics.ingest_duplicates.inc()
    else:
        metrics.ingest_batches.inc()
        metrics.ingest_values.inc(result.values)
    return result


async def _ingest(request: Request, store: StoreDep, settings: SettingsDep) -> IngestResult:
    limits = request.app.state.ingest_limits
    lease = limits.lease()
    try:
        raw = await _receive(request, settings.max_request_bytes, lease)
        # Inflating, decoding and storing a big body takes long enough to stall every other request: never on the
        # event loop, and one big body at a time.
        return await run_in_threadpool(_decode_and_store, raw, request.headers, settings.max_request_bytes, lease,
                                       limits.lane(len(raw)), store)
    except BodyError as exc:
        raise HTTPException(exc.status, exc.message) from None
    except _Busy:
        raise HTTPException(503, "the server holds too many ingest bytes at once (setting ingest_inflight_bytes); "
                                 "retry later", headers={"Retry-After": "1"}) from None
    except StorageUnavailable as exc:
        raise HTTPException(503, f"storage unavailable, batch not stored; retry: {exc.cause_name}",
                            headers={"Retry-After": "1"}) from None
    except QueryError as exc:  # a value the database refuses: sending it again cannot help
        raise HTTPException(exc.status, f"batch not stored: {exc.message}") from None
    finally:
        lease.release()


@router.post("/ingest/resume", response_model=ResumePoint, responses={503: {"description": "retry later"}},
             summary="The run a batch with this name and run_id would continue, and its last step")
def resume_point(store: StoreDep, query: ResumeQuery) -> ResumePoint:
    try:
        run = store.find_run(query.run, query.run_id)
    except StorageUnavailable as exc:
        raise HTTPException(503, f"storage unavailable; retry: {exc.cause_name}",
                            headers={"Retry-After": "1"}) from None
    if run is None:
        return ResumePoint(exists=False)
    return ResumePoint(exists=True, run=run.name, run_uid=run.uid, last_step=run.last_step)


def _decode_and_store(raw: bytes, headers, limit: int, lease, lane, store) -> IngestResult:
    with lane:
        body = inflate(raw, headers.get("content-encoding"), limit)
        if body is not raw and not lease.hold(len(raw) + len(body)):
            raise _Busy
        batch = parse_batch(body, headers.get("content-type"))
        del raw, body
        return store.ingest(batch)


async def _receive(request: Request, limit: int, lease) -> bytes:
    """The raw body, within the per-request limit (413) and the server's ingest byte budget (503)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise HTTPException(413, f"body of {declared} bytes is larger than the limit of {limit} bytes")
        if not lease.hold(int(declared)):
            raise _Busy
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise HTTPException(413, f"body is larger than the limit of {limit} bytes")
        if len(raw) > lease.held and not lease.hold(len(raw)):
            raise _Busy
    return bytes(raw)


class _Busy(Exception):
    """The ingest byte budget is spent by other requests."""
