"""State-changing routes refuse cross-site requests (Origin, Sec-Fetch-Site) and requests without the client
header or a bearer token; the agent, the dashboard and reads are unaffected. The browser-level proof is
tests/web/test_cross_site.py."""

import msgpack
import pytest
from fastapi.testclient import TestClient

from fp8mon.agent.wire import CLIENT_HEADER

API = "/api/v1"
EVIL = "http://evil.example:8000"


def batch(run: str, step: int = 0) -> dict:
    return {"version": 1, "batch_id": f"{run}-{step}", "run": run,
            "scalars": {"step": [step], "name": ["loss"], "value": [2.0]}}


def ingest(client, run: str, **headers):
    return client.post(f"{API}/ingest", content=msgpack.packb(batch(run)),
                       headers={"content-type": "application/msgpack", **headers})


@pytest.mark.sqlite_only
def test_cross_site_writes_are_refused_and_same_site_ones_pass(client):
    assert ingest(client, "kept").status_code == 200  # the client header, as the agent sends it
    cross_site = [{"origin": EVIL}, {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                  {"sec-fetch-site": "same-site"},  # another port of the same host is another origin
                  {"origin": "http://testserver.evil.example"}]
    for headers in cross_site:
        r = ingest(client, "injected", **headers)
        assert r.status_code == 403 and "cross-site" in r.json()["detail"], (headers, r.text)
        assert client.post(f"{API}/alerts/1/ack", headers=headers).status_code == 403
        assert client.delete(f"{API}/runs/kept", headers=headers).status_code == 403
        assert client.patch(f"{API}/runs/kept", json={"status": "failed"}, headers=headers).status_code == 403
    assert client.get(f"{API}/runs/injected").status_code == 404
    assert client.get(f"{API}/runs/kept").json()["status"] != "failed"

    # the dashboard's own requests: same origin, Sec-Fetch-Site same-origin, the header
    same = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    assert ingest(client, "same", **same).status_code == 200
    assert client.post(f"{API}/alerts/1/ack", headers=same).status_code == 404  # past the guard: no such alert
    # reads are not refused (a cross-site page cannot read the answers: no CORS header)
    assert client.get(f"{API}/runs/kept", headers={"origin": EVIL}).status_code == 200

    bare = TestClient(client.app)  # a program that sends neither the header nor a token
    r = ingest(bare, "bare")
    assert r.status_code == 403 and CLIENT_HEADER in r.json()["detail"]
    assert bare.get(f"{API}/runs/kept").status_code == 200


@pytest.mark.sqlite_only
def test_a_bearer_token_or_the_public_url_counts_as_this_server(app_factory):
    with app_factory(write_tokens=["w"], public_url="https://fp8mon.example.com/") as client:
        bare = TestClient(client.app)
        assert ingest(bare, "token", authorization="Bearer w").status_code == 200  # an agent without the header
        assert ingest(bare, "proxied", authorization="Bearer w", origin="https://fp8mon.example.com",
                      **{"sec-fetch-site": "same-origin"}).status_code == 200
        assert ingest(bare, "evil", authorization="Bearer w", origin=EVIL).status_code == 403
