"""GET /metrics: the Prometheus exposition (monitor.metrics). Read scope, like the REST queries (run names are
data): give Prometheus a read token (`authorization: {credentials: ...}` in its scrape config)."""

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fp8mon.monitor.deps import MetricsDep, require_read

router = APIRouter(tags=["metrics"], dependencies=[require_read])


@router.get("/metrics", summary="Prometheus metrics (text exposition format)",
            response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
