"""The FastAPI application factory."""

from contextlib import asynccontextmanager

from fastapi import FastAPI

from monitor.migrate import check_schema
from monitor.rollup import Compactor, interval_from_env
from monitor.routers import ingest, runs, series
from monitor.settings import Settings
from monitor.store import Store

API_PREFIX = "/api/v1"


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = store is None
        app.state.store = store or Store(settings.database_url, pool_size=settings.db_pool_size)
        try:
            check_schema(app.state.store.engine)
            compactor = Compactor(app.state.store, interval_from_env()).start()
            try:
                yield
            finally:
                compactor.stop()
        finally:
            if owned:
                app.state.store.close()

    app = FastAPI(title="fp8mon", version="0.1.0", lifespan=lifespan,
                  description="Training-health monitoring for FP8 LLM training.")
    app.state.settings = settings
    app.include_router(ingest.router, prefix=API_PREFIX)
    # series before runs: the bare /runs/{run} routes take any path and must come after the suffixed ones.
    app.include_router(series.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"ok": True}

    return app
