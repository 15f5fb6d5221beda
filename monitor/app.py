"""The FastAPI application factory."""

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.middleware.gzip import GZipMiddleware

from fp8mon.monitor.alerting.alertmanager import AlertmanagerSender
from fp8mon.monitor.alerting.notifiers import Notifiers, firing_alerts
from fp8mon.monitor.alerting.webhooks import WebhookSender
from fp8mon.monitor.compactor import Compactor
from fp8mon.monitor.conditional import ConditionalGetMiddleware
from fp8mon.monitor.ingest_budget import IngestLimits
from fp8mon.monitor.metrics import Metrics
from fp8mon.monitor.pipeline import Pipeline
from fp8mon.monitor.routers import (
    alerts,
    compare,
    dashboard,
    docs,
    histograms,
    ingest,
    metrics,
    predictions,
    runs,
    series,
)
from fp8mon.monitor.security import CrossSiteGuard
from fp8mon.monitor.settings import Settings
from fp8mon.monitor.storage import AbstractStore, SqlAlchemyStore
from fp8mon.monitor.storage.run_status import StallPolicy

API_PREFIX = "/api/v1"
log = logging.getLogger("fp8mon.app")


def create_app(settings: Settings | None = None, *, store: AbstractStore | None = None,
               predictor_factory=None) -> FastAPI:
    """`store`: used as given and left open (default: a SqlAlchemyStore on `settings.database_url`, closed at
    shutdown). `predictor_factory(run, config=...)`: the run predictors (default: `settings.predictor`, imported
    lazily)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = store is None
        app.state.store = store or SqlAlchemyStore(
            settings.database_url, pool_size=settings.db_pool_size,
            stall=StallPolicy(settings.stall_intervals, settings.stall_min_seconds))
        try:
            app.state.store.check_schema()
            async with _background(app, settings, predictor_factory):
                yield
        finally:
            if owned:
                app.state.store.close()

    app = FastAPI(title="fp8mon", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Training-health monitoring for FP8 LLM training.")
    # Outermost last: answers are compressed (GZip) after the ETag of their plain body is taken, so a 304
    # carries no body at all. GZip leaves small answers (< 1 kB) and pre-compressed ones (plotly.js) alone.
    app.add_middleware(ConditionalGetMiddleware, prefix=API_PREFIX + "/")
    app.add_middleware(GZipMiddleware, minimum_size=1000, compresslevel=5)
    app.state.settings = settings
    app.state.metrics = Metrics(max_runs=settings.metrics_max_runs,
                                grace_seconds=settings.metrics_run_grace_seconds)
    app.state.pipeline = None
    app.state.ingest_limits = IngestLimits(settings.ingest_inflight_bytes)
    app.add_middleware(CrossSiteGuard, trusted_urls=(settings.public_url,))
    app.include_router(ingest.router, prefix=API_PREFIX)
    app.include_router(alerts.router, prefix=API_PREFIX)
    app.include_router(compare.router, prefix=API_PREFIX)
    # series, alerts and predictions before runs: the bare /runs/{run} routes (and /runs/{run}/latest) take any
    # path and must come after the suffixed ones.
    app.include_router(predictions.router, prefix=API_PREFIX)
    app.include_router(series.router, prefix=API_PREFIX)
    app.include_router(histograms.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    app.include_router(docs.router)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = ingest.add_body_schema(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        """The process answers (on the event loop itself: a blocked loop shows here)."""
        return {"ok": True}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        """The database answers and its schema is the one this fp8mon needs; 503 and the reason otherwise."""
        try:
            await run_in_threadpool(app.state.store.check_schema)
        except Exception as exc:  # unreachable, un-migrated, or migrated by a newer fp8mon: not ready, say why
            log.warning("not ready: %s", exc)
            return JSONResponse({"ready": False, "reason": str(exc)[:500]}, status_code=503)
        return JSONResponse({"ready": True})

    return app


@asynccontextmanager
async def _background(app: FastAPI, settings: Settings, predictor_factory):
    """The server's threads: the webhook and Alertmanager senders, the prediction pipeline (fed by the store
    after each ingest commit) and the rollup compactor."""
    store: AbstractStore = app.state.store
    webhooks = WebhookSender(settings.webhook_urls, base_url=settings.base_url(),
                             max_attempts=settings.webhook_max_attempts, backoff=settings.webhook_backoff_seconds,
                             max_backoff=settings.webhook_max_backoff_seconds,
                             timeout=settings.webhook_timeout_seconds, metrics=app.state.metrics,
                             min_severity=settings.webhook_min_severity,
                             group_wait=settings.webhook_group_wait_seconds,
                             group_interval=settings.webhook_group_interval_seconds).start()
    alertmanager = AlertmanagerSender(settings.alertmanager_url, base_url=settings.base_url(),
                                      resend_seconds=settings.alertmanager_resend_seconds,
                                      metrics=app.state.metrics)
    if settings.alertmanager_url:
        try:
            alertmanager.restore(firing_alerts(store))
        except Exception:  # the database answers later: those alerts come back with their runs' next events
            log.exception("cannot read the firing alerts for Alertmanager")
    alertmanager.start()
    pipeline = Pipeline(store, metrics=app.state.metrics, notifier=Notifiers(webhooks, alertmanager),
                        predictor_factory=predictor_factory,
                        predictor_spec=settings.predictor, queue_size=settings.predictor_queue_size,
                        every_steps=settings.prediction_every_steps, risk_delta=settings.prediction_risk_delta).start()
    app.state.pipeline = pipeline
    store.add_ingest_listener(pipeline.submit)
    compactor = Compactor(store, settings.rollup_interval_s).start()
    try:
        yield
    finally:
        compactor.stop()
        store.remove_ingest_listener(pipeline.submit)
        pipeline.stop()
        webhooks.stop()
        alertmanager.stop()
        app.state.pipeline = None
