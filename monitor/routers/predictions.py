"""/api/v1/runs/{run}/predictions: the divergence predictor's stored assessments of a run."""

from typing import Annotated

from fastapi import APIRouter, Query

from fp8mon.monitor.api_models import PredictionList, PredictionOut
from fp8mon.monitor.deps import StoreDep, require_read
from fp8mon.monitor.routers.common import ERRORS, RunPath, SafeJSONResponse, http_errors
from fp8mon.monitor.wire import Step

router = APIRouter(tags=["predictions"], dependencies=[require_read])


# Both routes come before the runs router's bare /runs/{run:path}/latest, which would take ".../predictions/latest"
# as the latest snapshot of a run named "<run>/predictions".
@router.get("/runs/{run:path}/predictions/latest", response_model=PredictionOut, responses=ERRORS,
            summary="The run's latest prediction: risk, steps to divergence, signals, culprits")
def latest(store: StoreDep, run: RunPath):
    with http_errors():
        return SafeJSONResponse(store.latest_prediction(run).to_dict())


@router.get("/runs/{run:path}/predictions", response_model=PredictionList, responses=ERRORS,
            summary="Stored predictions in step order (from from_step, or the last `limit` up to to_step)")
def predictions(store: StoreDep, run: RunPath,
                from_step: Annotated[Step | None, Query(description="first step (inclusive)")] = None,
                to_step: Annotated[Step | None, Query(description="last step (inclusive)")] = None,
                limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
                risk_only: Annotated[bool, Query(description="signals and culprits left empty: a risk-over-time "
                                                             "chart needs a tenth of the bytes")] = False):
    with http_errors():
        page = store.list_predictions(run, from_step=from_step, to_step=to_step, limit=limit).to_dict()
    if risk_only:
        page["predictions"] = [{**p, "signals": {}, "culprits": []} for p in page["predictions"]]
    return SafeJSONResponse(page)
