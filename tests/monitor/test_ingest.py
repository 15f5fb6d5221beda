"""Ingest through the HTTP API (in process): formats, idempotency, validation, NaN handling, limits."""

import gzip
import json
import math

import msgpack
import pytest
from sqlalchemy import text

from fp8mon.monitor.storage import SqlAlchemyStore as Store


def batch(batch_id="b1", run="run-a", steps=(1, 2), layers=("blocks.0.attn.qkv", "blocks.0.mlp.fc1"), **extra):
    n = len(steps) * len(layers)
    body = {
        "version": 1,
        "batch_id": batch_id,
        "run": run,
        "tensors": {
            "step": [s for s in steps for _ in layers],
            "layer": [layer for _ in steps for layer in layers],
            "site": ["input"] * n,
            "stats": {"amax": [float(i + 1) for i in range(n)], "kurtosis": [3.0] * n},
        },
        "scalars": {"step": list(steps), "name": ["loss"] * len(steps), "value": [2.0] * len(steps)},
    }
    body.update(extra)
    return body


def post(client, body, *, fmt="msgpack", gzipped=False, headers=None):
    data = msgpack.packb(body) if fmt == "msgpack" else json.dumps(body).encode()
    hdrs = {"content-type": f"application/{fmt}"}
    if gzipped:
        data = gzip.compress(data)
        hdrs["content-encoding"] = "gzip"
    hdrs.update(headers or {})
    return client.post("/api/v1/ingest", content=data, headers=hdrs)


def rows(url, sql):
    s = Store(url)
    try:
        with s.engine.connect() as conn:
            return conn.execute(text(sql)).all()
    finally:
        s.close()


@pytest.mark.parametrize("fmt,gzipped", [("msgpack", False), ("msgpack", True), ("json", False), ("json", True)])
def test_batch_is_stored_in_every_encoding(client, database_url, fmt, gzipped):
    r = post(client, batch(), fmt=fmt, gzipped=gzipped)
    assert r.status_code == 200, r.text
    assert r.json()["tensor_records"] == 4 and r.json()["scalar_records"] == 2 and not r.json()["duplicate"]
    stored = rows(database_url, "select step, amax from tensor_stats order by step, amax")
    assert [(s, float(a)) for s, a in stored] == [(1, 1.0), (1, 2.0), (2, 3.0), (2, 4.0)]


def test_retried_batch_is_stored_once(client, database_url):
    first = post(client, batch())
    again = post(client, batch())
    assert first.json()["duplicate"] is False and again.json()["duplicate"] is True
    assert rows(database_url, "select count(*) from tensor_stats")[0][0] == 4
    assert rows(database_url, "select count(*) from scalars")[0][0] == 2


def test_same_step_from_a_new_batch_replaces_the_earlier_values(client, database_url):
    post(client, batch("b1"))
    body = batch("b2", steps=(2,))
    body["tensors"]["stats"]["amax"] = [40.0, 50.0]
    assert post(client, body).status_code == 200
    stored = rows(database_url, "select amax from tensor_stats where step = 2 order by series_id")
    assert [float(v) for (v,) in stored] == [40.0, 50.0]


def test_nan_and_inf_are_stored_as_values_and_null_as_missing(client, database_url):
    body = batch(steps=(1,))
    body["tensors"]["stats"] = {"amax": [float("nan"), float("inf")], "kurtosis": [None, float("-inf")]}
    body["scalars"]["value"] = [float("nan")]
    assert post(client, body).status_code == 200
    amax, kurt = zip(*rows(database_url, "select amax, kurtosis from tensor_stats order by series_id"))
    assert math.isnan(float(amax[0])) and float(amax[1]) == math.inf
    assert kurt[0] is None and float(kurt[1]) == -math.inf
    assert math.isnan(float(rows(database_url, "select value from scalars")[0][0]))


def test_json_accepts_nan_as_string(client, database_url):
    body = batch(steps=(1,))
    body["tensors"]["stats"] = {"amax": ["NaN", "Infinity"]}
    r = post(client, body, fmt="json")
    assert r.status_code == 200, r.text
    (a0,), (a1,) = rows(database_url, "select amax from tensor_stats order by series_id")
    assert math.isnan(float(a0)) and float(a1) == math.inf


@pytest.mark.parametrize("mutate,field", [
    (lambda b: b["tensors"].update(site=["input", "residual"]), "tensors.site.1"),
    (lambda b: b["tensors"]["stats"].update(amax=[1.0]), "stats.amax has 1"),
    (lambda b: b["tensors"]["stats"].update(kurtosiss=[1.0, 2.0]), "tensors.stats.kurtosiss"),
    (lambda b: b["tensors"].update(step=[-1, 0]), "tensors.step"),
    (lambda b: b.update(version=2), "version"),
    (lambda b: b.update(run="bad name with spaces"), "run"),
    (lambda b: b["scalars"].update(value=["x"]), "scalars.value.0"),
    (lambda b: b.pop("batch_id"), "batch_id"),
])
def test_invalid_batch_is_rejected_naming_the_field_and_nothing_is_stored(client, database_url, mutate, field):
    body = batch(steps=(1,))
    mutate(body)
    r = post(client, body)
    assert r.status_code == 422
    assert field in r.json()["detail"]
    assert rows(database_url, "select count(*) from tensor_stats")[0][0] == 0
    # and the same batch id still goes through once corrected
    assert post(client, batch(steps=(1,))).json()["duplicate"] is False


@pytest.mark.parametrize("data,headers,status", [
    (b"\xc1garbage", {"content-type": "application/msgpack"}, 400),
    (b"{not json", {"content-type": "application/json"}, 422),
    (b"plain", {"content-type": "text/plain"}, 415),
    (b"not gzip", {"content-type": "application/json", "content-encoding": "gzip"}, 400),
    (b"x", {"content-type": "application/json", "content-encoding": "br"}, 415),
])
def test_malformed_bodies_get_clear_4xx(client, database_url, data, headers, status):
    r = client.post("/api/v1/ingest", content=data, headers=headers)
    assert r.status_code == status
    assert r.json()["detail"]


def test_request_size_is_bounded_before_and_after_gzip(app_factory):
    with app_factory(max_request_bytes=4096) as client:
        big = batch(steps=tuple(range(100)))
        assert post(client, big).status_code == 413
        # a small gzip body that inflates past the limit (a "zip bomb") is refused too
        bomb = gzip.compress(json.dumps(batch(steps=(1,))).encode() + b" " * 100_000)
        r = client.post("/api/v1/ingest", content=bomb,
                        headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert len(bomb) < 4096 and r.status_code == 413


def test_tokens_gate_ingest(app_factory):
    with app_factory(write_tokens=["w-secret"], read_tokens=["r-secret"]) as client:
        assert post(client, batch()).status_code == 401
        assert post(client, batch(), headers={"authorization": "Bearer r-secret"}).status_code == 403
        assert post(client, batch(), headers={"authorization": "Bearer w-secret"}).status_code == 200


def test_server_refuses_unmigrated_database(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "fp8mon", "serve", "--database-url",
                          f"sqlite:///{tmp_path / 'empty.db'}", "--port", "1"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "fp8mon db upgrade" in out.stderr
