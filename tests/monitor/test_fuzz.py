"""Every endpoint of the application, fuzzed in process from its own OpenAPI schema: schemathesis generates
valid (positive) and invalid (negative) paths, queries and bodies (ingest's in JSON and in msgpack); whatever
comes in, the answer is never a 5xx."""

import json
import re
import time

import msgpack
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.app import create_app
from fp8mon.monitor.fixtures import fixture_paths, load_fixture
from fp8mon.monitor.migrate import upgrade
from fp8mon.monitor.settings import Settings
from fp8mon.monitor.storage.engine import create_db_engine

RUN = "fuzz/run-1"
# (operation, body media type): every body type an operation declares is fuzzed
OPERATIONS = [(op.label, media_type) for op in (result.ok() for result in
              schemathesis.openapi.from_dict(create_app().openapi()).get_all_operations())
              for media_type in op.get_request_payload_content_types() or [None]]


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx, value):
    return msgpack.packb(_fits_msgpack(value))


def _fits_msgpack(value):
    """msgpack's integers end at 64 bits (a client cannot send more): larger ones go as floats."""
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return float(value)
    if isinstance(value, dict):
        return {k: _fits_msgpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fits_msgpack(v) for v in value]
    return value


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
    # its lifespan (store, pipeline) serves the fuzzer's requests too
    with TestClient(app, headers={CLIENT_HEADER: "tests"}) as client:
        for batch in fixture.batches:
            assert client.post("/api/v1/ingest", json={**batch, "run": RUN}).status_code == 200
        deadline = time.monotonic() + 30
        while not client.get(f"/api/v1/runs/{RUN}/alerts").json()["alerts"] and time.monotonic() < deadline:
            time.sleep(0.2)
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label,media_type", OPERATIONS, ids=[f"{op} {t}" if t else op for op, t in OPERATIONS])
def test_no_endpoint_answers_with_a_server_error(schema, label, media_type, mode):
    operation = next(result.ok() for result in schema.get_all_operations() if result.ok().label == label)

    @given(case=operation.as_strategy(generation_mode=mode, media_type=media_type))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        if media_type is not None and mode is GenerationMode.POSITIVE:
            assert isinstance(case.body, dict)  # the body schema resolved: a body is sent
        # the header the agent sends: without it every state-changing request is refused before its body is read
        case.call_and_validate(checks=[not_a_server_error], headers={CLIENT_HEADER: "tests"})

    fuzz()


def test_every_schema_reference_resolves():
    """The ingest body referred to a schema the document did not have, so nothing fuzzed ingest bodies."""
    openapi = create_app().openapi()
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(openapi)))
    assert "IngestBatch" in refs and refs <= set(openapi["components"]["schemas"])
    body = openapi["paths"]["/api/v1/ingest"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/msgpack"}
