"""The query endpoints over HTTP: JSON shapes, NaN/Infinity strings, 404/422 messages, pagination and filters,
PATCH/DELETE, tokens, names with '/', OpenAPI (in process), and the background compactors of a real
`fp8mon serve` with two worker processes."""

import math
import time

import httpx
import msgpack
from sqlalchemy import text

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.storage import SqlAlchemyStore as Store

API = "/api/v1"


def post_batch(client, body, token=None):
    headers = {"content-type": "application/msgpack", CLIENT_HEADER: "tests"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    r = client.post(f"{API}/ingest", content=msgpack.packb(body), headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def batch(run, steps, layers=("blocks.0.attn", "blocks.1.mlp"), batch_id=None, amax=None, loss=None, meta=None):
    n = len(steps) * len(layers)
    body = {"version": 1, "batch_id": batch_id or f"{run}-{steps[0]}-{steps[-1]}", "run": run,
            "tensors": {"step": [s for s in steps for _ in layers], "layer": [x for _ in steps for x in layers],
                        "site": ["input"] * n,
                        "stats": {"amax": amax if amax is not None else [float(s % 7) for s in steps for _ in layers]}},
            "scalars": {"step": list(steps), "name": ["loss"] * len(steps),
                        "value": loss if loss is not None else [1.0] * len(steps)}}
    if meta:
        body["run_meta"] = meta
    return body


def get(client, path, token=None, **params):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return client.get(f"{API}{path}", params=params, headers=headers)


def test_series_heatmap_latest_catalogue_over_http_with_nan_and_inf(client, database_url):
    steps = list(range(300))
    amax = [float(s) for s in steps for _ in range(2)]
    amax[2 * 150] = math.nan  # layer 0, step 150
    amax[2 * 200 + 1] = math.inf  # layer 1, step 200
    amax[2 * 299] = -math.inf  # layer 0, last step
    loss = [0.5] * 300
    loss[42] = math.nan
    post_batch(client, batch("team/run-1", steps, amax=amax, loss=loss))

    r = get(client, "/runs/team/run-1/series", stat="amax", layer="blocks.0.attn", site="input", start=140,
            end=160)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["downsampled"] is False and body["points"]["step"] == list(range(140, 161))
    assert body["points"]["value"][10] == "NaN" and body["points"]["value"][0] == 140.0

    r = get(client, "/runs/team/run-1/series", stat="amax", layer="blocks.0.attn", site="input", max_points=10)
    body = r.json()
    assert body["downsampled"] and body["bucket_width"] == 32 and len(body["points"]["step"]) == 10
    nan_bucket = body["points"]["step"].index(128)
    assert body["points"]["max"][nan_bucket] == "NaN" and body["points"]["mean"][nan_bucket] == "NaN"
    assert body["points"]["min"][-1] == "-Infinity" and body["points"]["last"][-1] == "-Infinity"
    assert body["points"]["max"][0] == 31.0 and body["points"]["min"][0] == 0.0 and body["points"]["count"][0] == 32

    r = get(client, "/runs/team/run-1/series", scalar="loss", max_points=300)
    assert r.json()["points"]["value"][42] == "NaN"

    r = get(client, "/runs/team/run-1/heatmap", stat="amax", site="input", max_points=10)
    heat = r.json()
    assert heat["layers"] == ["blocks.0.attn", "blocks.1.mlp"] and heat["edges"] == [*range(0, 300, 32), 300]
    assert heat["values"][0][4] == "NaN" and heat["values"][1][6] == "Infinity" and heat["values"][1][0] == 31.0
    r = get(client, "/runs/team/run-1/heatmap", stat="amax", agg="last", max_points=10)
    assert r.json()["values"][0][-1] == "-Infinity"

    latest = get(client, "/runs/team/run-1/latest").json()
    assert latest["series"][0]["step"] == 299 and latest["series"][0]["values"]["amax"] == "-Infinity"
    assert latest["scalars"] == [{"name": "loss", "step": 299, "value": 0.5}]

    cat = get(client, "/runs/team/run-1/catalogue").json()
    assert [x["layer"] for x in cat["layers"]] == ["blocks.0.attn", "blocks.1.mlp"]
    assert cat["scalars"] == ["loss"] and cat["ranks"] == [0] and (cat["first_step"], cat["last_step"]) == (0, 299)

    run = get(client, "/runs/team/run-1").json()
    assert run["name"] == "team/run-1" and run["tensor_series"] == 2 and run["scalar_series"] == 1
    # the '/' may also come percent-encoded
    assert client.get(f"{API}/runs/team%2Frun-1/catalogue").status_code == 200


ERROR_CASES = [
    ("/runs/nope", {}, 404, "run 'nope' not found"),
    ("/runs/nope/series", {"scalar": "loss"}, 404, "run 'nope' not found"),
    ("/runs/nope/heatmap", {"stat": "amax"}, 404, "run 'nope' not found"),
    ("/runs/nope/latest", {}, 404, "run 'nope' not found"),
    ("/runs/nope/catalogue", {}, 404, "run 'nope' not found"),
    ("/runs/r/series", {"stat": "amax", "layer": "nope", "site": "input"}, 404, "no series for layer 'nope'"),
    ("/runs/r/series", {"scalar": "lr"}, 404, "no scalar 'lr'"),
    ("/runs/r/series", {"stat": "amax", "site": "input"}, 422, "layer: required"),
    ("/runs/r/series", {}, 422, "stat: required"),
    ("/runs/r/series", {"scalar": "loss", "start": 9, "end": 3}, 422, "start (9) must be <= end (3)"),
    ("/runs/r/series", {"scalar": "loss", "max_points": 0}, 422, "max_points"),
    ("/runs/r/series", {"scalar": "loss", "start": -1}, 422, "start"),
    ("/runs/r/series", {"stat": "amaxx", "layer": "blocks.0.attn", "site": "input"}, 422, "stat"),
    ("/runs/r/heatmap", {}, 422, "stat"),
    ("/runs/r/heatmap", {"stat": "amax", "agg": "median"}, 422, "agg"),
    ("/runs/r/heatmap", {"stat": "amax", "site": "residual"}, 422, "site"),
    ("/runs/r/heatmap", {"stat": "amax", "max_points": 100000}, 422, "max_points"),
    ("/runs", {"order_by": "colour"}, 422, "order_by"),
    ("/runs", {"limit": 0}, 422, "limit"),
    ("/runs", {"status": "paused"}, 422, "status"),
    ("/runs", {"created_since": "yesterday"}, 422, "created_since"),
    ("/runs", {"tag": "=x"}, 422, "tag"),
    ("/runs", {"offset": 7175645888532389551931392}, 422, "offset"),  # past 64 bits: was a 500 (fuzzing found it)
    ("/alerts", {"offset": 2**63}, 422, "offset"),
]


def test_errors_name_the_problem(client, database_url):
    post_batch(client, batch("r", [1, 2]))
    for path, params, status, needle in ERROR_CASES:
        r = get(client, path, **params)
        assert (r.status_code, needle in r.json()["detail"] if isinstance(r.json()["detail"], str) else
                needle in r.text) == (status, True), (path, params, r.status_code, r.text)


def test_runs_list_filters_and_pages(client, database_url):
    for i in range(5):
        meta = {"tags": {"team": "a" if i % 2 else "b"}, "status": "finished" if i < 2 else "running"}
        post_batch(client, batch(f"exp-{i}", [i], meta=meta))
    r = get(client, "/runs", order_by="name", limit=2, offset=2)
    body = r.json()
    assert body["total"] == 5 and body["limit"] == 2 and body["offset"] == 2
    assert [x["name"] for x in body["runs"]] == ["exp-2", "exp-3"]
    r = client.get(f"{API}/runs", params=[("status", "running"), ("tag", "team=b")])
    assert [x["name"] for x in r.json()["runs"]] == ["exp-4", "exp-2"]  # newest first by default
    r = get(client, "/runs", name="EXP-?", order_by="-last_step", limit=1)
    assert r.json()["total"] == 5 and r.json()["runs"][0]["name"] == "exp-4"
    assert get(client, "/runs", status="failed").json() == {"total": 0, "limit": 50, "offset": 0, "runs": []}


def test_patch_and_delete_over_http(client, database_url):
    post_batch(client, batch("a/b", list(range(100)), meta={"tags": {"k": "v"}}))
    post_batch(client, batch("keep", list(range(10))))
    r = client.patch(f"{API}/runs/a/b", json={"status": "failed", "tags": {"why": "nan"}})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "failed" and r.json()["tags"] == {"k": "v", "why": "nan"} and r.json()["ended_at"]
    r = client.patch(f"{API}/runs/a/b", json={"status": "paused"})
    assert r.status_code == 422 and "status" in r.text
    r = client.patch(f"{API}/runs/nope", json={"status": "failed"})
    assert r.status_code == 404

    store = Store(database_url)
    try:
        store.compact(lag=0)

        def count(table):
            with store.engine.connect() as conn:
                return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()

        assert count("tensor_rollups") > 0 and count("scalar_rollups") > 0
        r = client.delete(f"{API}/runs/a/b")
        assert r.status_code == 200, r.text
        assert r.json()["deleted_rows"]["tensor_stats"] == 200 and r.json()["deleted_rows"]["scalars"] == 100
        assert get(client, "/runs/a/b").status_code == 404
        assert client.delete(f"{API}/runs/a/b").status_code == 404
        assert count("tensor_stats") == 20 and count("scalars") == 10 and count("runs") == 1
        assert count("tensor_rollups") == 0 and count("scalar_rollups") == 0  # "keep" has no complete bucket
        assert count("tensor_series") == 2 and count("ingest_batches") == 1
    finally:
        store.close()
    # the server forgot the deleted run: the same name starts afresh
    post_batch(client, batch("a/b", [5], batch_id="again"))
    assert get(client, "/runs/a/b").json()["first_step"] == 5


def test_read_and_write_scopes(app_factory):
    with app_factory(write_tokens=["w"], read_tokens=["r"]) as client:
        post_batch(client, batch("x", [1]), token="w")
        assert get(client, "/runs").status_code == 401
        assert get(client, "/runs", token="r").status_code == 200
        assert get(client, "/runs/x/heatmap", token="r", stat="amax").status_code == 200
        assert get(client, "/runs/x/series", token="nope", scalar="loss").status_code == 403
        headers = {"authorization": "Bearer r"}
        assert client.patch(f"{API}/runs/x", json={}, headers=headers).status_code == 403
        assert client.delete(f"{API}/runs/x", headers=headers).status_code == 403
        r = client.delete(f"{API}/runs/x", headers={"authorization": "Bearer w"})
        assert r.status_code == 200, r.text


def test_openapi_describes_the_queries(client, database_url):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/api/v1/runs", "/api/v1/runs/{run}", "/api/v1/runs/{run}/series", "/api/v1/runs/{run}/heatmap",
                 "/api/v1/runs/{run}/latest", "/api/v1/runs/{run}/catalogue"):
        assert path in paths, sorted(paths)
    assert set(paths["/api/v1/runs/{run}"]) == {"get", "patch", "delete"}
    params = {p["name"] for p in paths["/api/v1/runs/{run}/heatmap"]["get"]["parameters"]}
    assert {"run", "stat", "site", "agg", "rank", "start", "end", "max_points"} <= params
    assert "HeatmapOut" in spec["components"]["schemas"]
    assert client.get("/docs").status_code == 200


def test_the_server_compacts_in_the_background(server_factory):
    # two worker processes (predictions off, as --workers 2 needs): two compactors racing on the same runs
    server = server_factory(FP8MON_ROLLUP_INTERVAL_S="0.1", FP8MON_WORKERS="2", FP8MON_PREDICTOR="").start()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        _compacts_in_the_background(client, server.database_url)


def _compacts_in_the_background(client, database_url):
    post_batch(client, batch("bg", list(range(400))))
    deadline = time.monotonic() + 30
    store = Store(database_url)
    try:
        def query(sql):
            with store.engine.connect() as conn:
                return conn.execute(text(sql)).all()

        while query("SELECT rollup_until FROM runs")[0][0] != (399 - 32) // 16 * 16:
            assert time.monotonic() < deadline, "the background compactor did not advance rollup_until"
            time.sleep(0.1)
        # a late batch below the horizon: reflected at once (raw rows), and folded into the rollups again
        post_batch(client, batch("bg", [10], batch_id="late", amax=[1000.0, 1000.0]))
        r = get(client, "/runs/bg/series", stat="amax", layer="blocks.0.attn", site="input", max_points=4)
        assert r.json()["points"]["max"][0] == 1000.0
        while query("SELECT rollup_dirty_from FROM runs")[0][0] is not None:
            assert time.monotonic() < deadline, "the late batch was not compacted"
            time.sleep(0.1)
        widths = dict(query("SELECT width, count(*) FROM tensor_rollups GROUP BY width"))
        maxima = [float(m) for (m,) in query("SELECT amax_max FROM tensor_rollups WHERE width = 16 "
                                             "ORDER BY series_id, bucket")]
    finally:
        store.close()
    assert widths == {16: 2 * 22, 64: 2 * 5, 256: 2 * 1}  # each bucket once, up to step 352
    assert maxima == 2 * ([1000.0] + [6.0] * 21)
    r = get(client, "/runs/bg/series", stat="amax", layer="blocks.0.attn", site="input", max_points=4)
    assert r.json()["points"]["max"] == [1000.0, 6.0, 6.0, 6.0]
