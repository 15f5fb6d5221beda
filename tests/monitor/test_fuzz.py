"""Every endpoint of a real server, fuzzed from the app's own OpenAPI schema: schemathesis generates valid
(positive) and invalid (negative) paths, queries and bodies; whatever comes in, the answer is never a 5xx."""

import time

import httpx
import pytest
import schemathesis
from fp8mon.monitor.app import create_app
from fp8mon.monitor.fixtures import fixture_paths, load_fixture
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

RUN = "fuzz/run-1"
OPERATIONS = [result.ok() for result in schemathesis.openapi.from_dict(create_app().openapi()).get_all_operations()]


@pytest.fixture(scope="module")
def target(module_server) -> str:
    # Data first, so that reads of an existing run reach the query code and not only the 404 path.
    fixture = next(f for f in map(load_fixture, fixture_paths()) if f.outcome == "diverged")
    with httpx.Client(base_url=module_server.url, timeout=30) as client:
        for batch in fixture.batches:
            assert client.post("/api/v1/ingest", json={**batch, "run": RUN}).status_code == 200
        deadline = time.monotonic() + 30
        while not client.get(f"/api/v1/runs/{RUN}/alerts").json()["alerts"] and time.monotonic() < deadline:
            time.sleep(0.2)
    return module_server.url


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_no_endpoint_answers_with_a_server_error(target, operation, mode):
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        case.call_and_validate(base_url=target, checks=[not_a_server_error])

    fuzz()
