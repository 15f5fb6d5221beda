"""`fp8mon import`: load the labelled corpus (monitor.fixtures) into a monitor, so that a newcomer's dashboard
shows stable and diverging runs, FP8 and BF16 twins, alerts and predictions at once.

Into a database: each fixture's batches are stored as ingest stores them, and the prediction pipeline runs in
this process over them, as a server would (predictions and alerts stored). Into a running server (`url`): the
batches are posted to its /api/v1/ingest, and its own pipeline assesses them. Either way a batch id already
stored is a duplicate, so importing twice adds nothing. A run its labels call diverged gets the status
"diverged".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.fixtures import Fixture, fixture_paths, load_fixture


@dataclass
class Imported:
    run: str
    outcome: str  # the fixture's label: stable, diverged, early, censored
    batches: int
    duplicates: int


def select(root: Path | str | None = None, match: str | None = None, limit: int | None = None) -> list[Path]:
    """The corpus files (cpu and gpu profiles), those whose file name matches the glob `match`, the first
    `limit` of them."""
    paths = fixture_paths(root)
    if match:
        paths = [p for p in paths if p.match(match) or p.name.startswith(match)]
    return paths[:limit] if limit else paths


def import_into_store(store, paths: Iterable[Path], *, predict: bool = True, predictor: str | None = None,
                      progress: Callable[[Imported], object] = lambda _: None) -> list[Imported]:
    """Store every batch of the fixtures at `paths`; with `predict`, through the prediction pipeline."""
    from fp8mon.monitor.metrics import Metrics
    from fp8mon.monitor.pipeline import Pipeline
    from fp8mon.monitor.settings import Settings
    from fp8mon.monitor.wire import IngestBatch

    pipeline = None
    if predict:
        pipeline = Pipeline(store, metrics=Metrics(), predictor_spec=predictor or Settings().predictor,
                            queue_size=100_000).start()
        store.add_ingest_listener(pipeline.submit)
    done = []
    try:
        for path in paths:
            fixture = load_fixture(path)
            duplicates = 0
            for batch in fixture.batches:
                duplicates += store.ingest(IngestBatch.model_validate(batch)).duplicate
            if pipeline is not None:
                pipeline.flush(timeout=600)
            if fixture.diverged:
                store.patch_run(run_name(fixture), status="diverged")
            done.append(Imported(run_name(fixture), fixture.outcome, len(fixture.batches), duplicates))
            progress(done[-1])
    finally:
        if pipeline is not None:
            store.remove_ingest_listener(pipeline.submit)
            pipeline.stop()
    return done


def import_into_server(url: str, paths: Iterable[Path], *, token: str | None = None,
                       progress: Callable[[Imported], object] = lambda _: None) -> list[Imported]:
    """Post every batch of the fixtures to a running monitor's /api/v1/ingest (its pipeline assesses them)."""
    import httpx
    import msgpack

    headers = {CLIENT_HEADER: "fp8mon-import"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    done = []
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60) as client:
        for path in paths:
            fixture = load_fixture(path)
            duplicates = 0
            for batch in fixture.batches:
                response = client.post("/api/v1/ingest", content=msgpack.packb(batch),  # NaN losses: not JSON
                                       headers={"Content-Type": "application/msgpack"})
                response.raise_for_status()
                duplicates += bool(response.json().get("duplicate"))
            if fixture.diverged:
                client.patch(f"/api/v1/runs/{quote(run_name(fixture))}",
                             json={"status": "diverged"}).raise_for_status()
            done.append(Imported(run_name(fixture), fixture.outcome, len(fixture.batches), duplicates))
            progress(done[-1])
    return done


def run_name(fixture: Fixture) -> str:
    return fixture.batches[0]["run"] if fixture.batches else fixture.name
