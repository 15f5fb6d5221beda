"""Every endpoint of the application, fuzzed in process from its own OpenAPI schema: schemathesis generates
valid (positive) and invalid (negative) paths, queries and bodies; whatever comes in, the answer is never a
5xx."""

import time

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from fp8mon.monitor.app import create_app
from fp8mon.monitor.fixtures import fixture_paths, load_fixture
from fp8mon.monitor.migrate import upgrade
from fp8mon.monitor.settings import Settings
from fp8mon.monitor.storage.engine import create_db_engine

RUN = "fuzz/run-1"
LABELS = [result.ok().label for result in schemathesis.openapi.from_dict(create_app().openapi()).get_all_operations()]


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    """The application on a fresh SQLite file, shared by the module's tests, with one diverged run stored first
    (so that reads of an existing run reach the query code and not only the 404 path)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fp8mon.db'}"
    engine = create_db_engine(url)
    upgrade(engine)
    engine.dispose()
    app = create_app(Settings(database_url=url))
    fixture = next(f for f in map(load_fixture, fixture_paths()) if f.outcome == "diverged")
    with TestClient(app) as client:  # its lifespan (store, pipeline) serves the fuzzer's requests too
        for batch in fixture.batches:
            assert client.post("/api/v1/ingest", json={**batch, "run": RUN}).status_code == 200
        deadline = time.monotonic() + 30
        while not client.get(f"/api/v1/runs/{RUN}/alerts").json()["alerts"] and time.monotonic() < deadline:
            time.sleep(0.2)
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", LABELS)
def test_no_endpoint_answers_with_a_server_error(schema, label, mode):
    operation = next(result.ok() for result in schema.get_all_operations() if result.ok().label == label)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        case.call_and_validate(checks=[not_a_server_error])

    fuzz()
