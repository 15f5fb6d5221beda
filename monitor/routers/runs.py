"""/api/v1/runs: list, read, patch and delete runs; a run's catalogue and latest snapshot."""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from fp8mon.monitor.api_models import (
    Catalogue,
    LatestOut,
    RunDeleted,
    RunDetail,
    RunList,
    RunPatch,
    RunState,
)
from fp8mon.monitor.deps import PipelineDep, StoreDep, require_read, require_write
from fp8mon.monitor.routers.common import ERRORS, RunPath, SafeJSONResponse, http_errors
from fp8mon.monitor.storage.runs import RUN_ORDER_FIELDS
from fp8mon.monitor.wire import FINAL_STATUSES

router = APIRouter(tags=["runs"])


@router.get("/runs", response_model=RunList, responses=ERRORS, dependencies=[require_read], summary="List runs, with their firing alerts and latest risk")
def list_runs(
    store: StoreDep,
    status: Annotated[list[RunState] | None, Query(description="any of these statuses, as listed (repeatable)")]
    = None,
    name: Annotated[str | None, Query(max_length=200, description="substring of the name, or a glob with * and "
                                                                  "? (case-insensitive)")] = None,
    tag: Annotated[list[str] | None, Query(description="key=value (or key: has the tag); repeatable, all must "
                                                       "match")] = None,
    created_since: Annotated[datetime | None, Query(description="created at or after (ISO 8601; UTC if no "
                                                                "offset)")] = None,
    updated_since: Annotated[datetime | None, Query(description="data received at or after")] = None,
    order_by: Annotated[str, Query(description="one of " + ", ".join(RUN_ORDER_FIELDS)
                                               + "; prefix - for descending (-severity: the worst firing severity "
                                               "first, then the most firing alerts)")] = "-created_at",
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,  # (the databases' integers are 64-bit)
):
    with http_errors():
        return SafeJSONResponse(store.list_runs(status=status, name=name, tags=tag, created_since=created_since,
                                                updated_since=updated_since, order_by=order_by, limit=limit,
                                                offset=offset).to_dict())


@router.get("/runs/{run:path}/catalogue", response_model=Catalogue, responses=ERRORS,
            dependencies=[require_read], summary="Layers, sites, statistics, scalars, ranks and steps of a run")
def get_catalogue(store: StoreDep, run: RunPath):
    with http_errors():
        return SafeJSONResponse(store.catalogue(run).to_dict())


@router.get("/runs/{run:path}/latest", response_model=LatestOut, responses=ERRORS, dependencies=[require_read],
            summary="Every statistic of every layer x site at its last step")
def get_latest(store: StoreDep, run: RunPath,
               rank: Annotated[int, Query(ge=-1, le=32767)] = 0):
    with http_errors():
        return SafeJSONResponse(store.latest(run, rank).to_dict())


# The bare /runs/{run} routes come last: {run:path} would otherwise swallow the suffixed routes.
@router.get("/runs/{run:path}", response_model=RunDetail, responses=ERRORS, dependencies=[require_read],
            summary="One run")
def get_run(store: StoreDep, run: RunPath):
    with http_errors():
        return SafeJSONResponse(store.get_run(run).to_dict())


@router.patch("/runs/{run:path}", response_model=RunDetail, responses=ERRORS, dependencies=[require_write],
              summary="Change a run's status, tags (merged) or config (replaced)")
def patch_run(store: StoreDep, pipeline: PipelineDep, run: RunPath, body: RunPatch):
    with http_errors():
        detail = store.patch_run(run, status=body.status, tags=body.tags, config=body.config)
    if pipeline is not None and body.status in FINAL_STATUSES:  # its alerts resolve
        pipeline.end_run(run, detail.run.id)
    return SafeJSONResponse(detail.to_dict())


@router.delete("/runs/{run:path}", response_model=RunDeleted, responses=ERRORS, dependencies=[require_write],
               summary="Delete a run and all its data")
def delete_run(store: StoreDep, pipeline: PipelineDep, run: RunPath):
    with http_errors():
        deleted = store.delete_run(run).to_dict()
    if pipeline is not None:  # its predictor, alert state and /metrics series go too
        pipeline.forget_run(run)
    return SafeJSONResponse(deleted)
