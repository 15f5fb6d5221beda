"""The agent waits what a busy monitor asks (503 with Retry-After), within its own back-off bound."""

import time

import httpx

from fp8mon.agent import delivery
from fp8mon.agent.wire import CLIENT_HEADER


def answer(status: int, **headers):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(request.headers)
        return httpx.Response(status, headers=headers, text="busy")

    return httpx.Client(transport=httpx.MockTransport(handler), headers={CLIENT_HEADER: "agent"}), seen


def test_retry_after_is_read_and_bounded():
    for value, expected in (("3", 3.0), ("0.5", 0.5), ("100000", 300.0), ("-1", 0.0),
                            ("Wed, 21 Oct 2026 07:28:00 GMT", 0.0)):
        client, _ = answer(503, **{"Retry-After": value})
        outcome = delivery.post(client, "http://monitor/api/v1/ingest", b"x")
        assert outcome.kind == delivery.RETRY and outcome.retry_after == expected, value
    client, seen = answer(500)
    assert delivery.post(client, "http://monitor/api/v1/ingest", b"x").retry_after == 0.0
    assert seen[CLIENT_HEADER.lower()] == "agent"


def test_the_transport_waits_at_least_retry_after(tmp_path):
    from fp8mon.agent.transport import Transport

    transport = Transport("http://127.0.0.1:9", "run", spool_dir=tmp_path, backoff=(0.25, 30.0))
    try:
        assert transport._client.headers[CLIENT_HEADER] == "agent"  # what the monitor's cross-site check needs
        before = transport._retry_at
        transport._back_off(5.0)
        waited = transport._retry_at - time.monotonic()
        assert 4.5 < waited <= 5.0 and transport._retry_at > before
        transport._back_off(1000.0)  # never beyond the agent's own bound
        assert transport._retry_at - time.monotonic() <= 30.0
    finally:
        transport.close(timeout=1)
