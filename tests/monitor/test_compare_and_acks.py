"""What the dashboard's comparison, alerts panel and polling rely on, through the REST API (TestClient):
acknowledging changes a run's firing counts and can be undone; two runs' difference heatmap on one grid; runs
paired by a config key with their loss gap; conditional GETs (ETag -> 304) and gzip; /docs and /redoc offline."""

import gzip
import math

import numpy as np
import pytest

from fp8mon.monitor.compare import _rebucket, pair_runs
from fp8mon.monitor.storage.entities import Run
from tests.monitor.fleet import add_alerts, add_run
from tests.monitor.twins import LAYERS, ingest

API = "/api/v1"


def listed(client, name: str) -> dict:
    runs = client.get(f"{API}/runs", params={"name": name}).json()["runs"]
    return next(r for r in runs if r["name"] == name)


def test_acknowledging_takes_alerts_out_of_the_firing_counts_and_undoing_puts_them_back(client, store):
    run_id = add_run(store, "acked")
    add_alerts(store, run_id, "acked", [("critical", "firing"), ("warning", "firing"), ("warning", "pending"),
                                        ("info", "firing"), ("critical", "resolved")])
    alerts = {a["message"]: a for a in client.get(f"{API}/runs/acked/alerts").json()["alerts"]}
    assert (listed(client, "acked")["firing"], listed(client, "acked")["worst_severity"]) == (3, "critical")

    critical = alerts["critical firing 0"]["id"]
    body = client.post(f"{API}/alerts/{critical}/ack").json()
    assert body["acknowledged_at"] is not None and body["newly_acknowledged"] and body["state"] == "firing"
    run = listed(client, "acked")
    assert (run["firing"], run["firing_by_severity"], run["worst_severity"]) == (
        2, {"warning": 1, "info": 1}, "warning")

    body = client.post(f"{API}/alerts/{critical}/unack").json()
    assert body["acknowledged_at"] is None and body["state"] == "firing"
    assert (listed(client, "acked")["firing"], listed(client, "acked")["worst_severity"]) == (3, "critical")

    # acknowledge all, warning and above: the firing warning, the pending warning and the critical; not the info
    # alert, not the resolved one
    body = client.post(f"{API}/runs/acked/alerts/ack", params={"severity": ["warning", "critical"]}).json()
    assert sorted(body["acknowledged"]) == sorted(alerts[m]["id"] for m in (
        "critical firing 0", "warning firing 1", "warning pending 2"))
    run = listed(client, "acked")
    assert (run["firing"], run["worst_severity"]) == (1, "info")
    assert client.post(f"{API}/runs/acked/alerts/ack").json()["acknowledged"] == [alerts["info firing 3"]["id"]]
    assert listed(client, "acked")["firing"] == 0
    assert client.post(f"{API}/alerts/999999/unack").status_code == 404
    assert client.post(f"{API}/runs/no-such-run/alerts/ack").status_code == 404


def test_difference_heatmap_subtracts_cell_by_cell_over_the_shared_layers_and_steps(client, store):
    ingest(store, "bf16-a", precision="bf16", seed=1, steps=range(0, 20), kurtosis=lambda j, s: 3.0 + j)
    # the other run: steps 5..29, one extra layer, a 10x spike on layer 1 at step 12
    ingest(store, "fp8-a", precision="fp8", seed=1, steps=range(5, 30), layers=[*LAYERS, "blocks.3.mlp"],
           kurtosis=lambda j, s: 30.0 + 3.0 if (j, s) == (1, 12) else 3.0 + 2 * j)
    body = client.get(f"{API}/compare/heatmap", params={"base": "bf16-a", "other": "fp8-a", "stat": "kurtosis",
                                                       "site": "input"}).json()
    assert body["layers"] == LAYERS and body["only_in"] == {"bf16-a": [], "fp8-a": ["blocks.3.mlp"]}
    assert body["edges"][0] == 5 and body["edges"][-1] == 20 and body["bucket_width"] == 1
    column = body["edges"].index(12)
    assert [row[0] for row in body["values"]] == [0.0, 1.0, 2.0]  # (3 + 2j) - (3 + j)
    assert body["values"][1][column] == pytest.approx(33.0 - 4.0)

    ratio = client.get(f"{API}/compare/heatmap", params={"base": "bf16-a", "other": "fp8-a", "stat": "kurtosis",
                                                        "mode": "log10_ratio"}).json()
    assert ratio["values"][1][column] == pytest.approx(math.log10(33 / 4))
    assert client.get(f"{API}/compare/heatmap", params={"base": "bf16-a", "other": "gone",
                                                       "stat": "kurtosis"}).status_code == 404


def test_a_finer_grid_folds_into_the_coarser_one_by_the_bucket_aggregate():
    values = np.array([[1.0, 5.0, np.nan, 2.0, 7.0, 3.0]])
    bad = np.array([[False, False, True, False, False, False]])
    edges, coarse = [0, 1, 2, 3, 4, 5, 6], [0, 4, 6]
    folded, folded_bad = _rebucket(values, bad, edges, coarse, "max")
    assert folded.tolist() == [[5.0, 7.0]] and folded_bad.tolist() == [[True, False]]
    assert _rebucket(values, bad, edges, coarse, "last")[0].tolist() == [[2.0, 3.0]]
    assert _rebucket(values, bad, edges, coarse, "mean")[0].tolist() == [[8 / 3, 5.0]]


def test_difference_heatmap_of_downsampled_runs_keeps_a_one_step_spike(client, store):
    ingest(store, "long-a", precision="bf16", seed=3, steps=range(0, 4000), kurtosis=lambda j, s: 3.0)
    ingest(store, "long-b", precision="fp8", seed=3, steps=range(0, 4000),
           kurtosis=lambda j, s: 50.0 if (j, s) == (2, 3001) else 4.0)
    store.compact()
    body = client.get(f"{API}/compare/heatmap", params={"base": "long-a", "other": "long-b", "stat": "kurtosis",
                                                       "max_points": 100}).json()
    assert body["bucket_width"] > 1 and len(body["edges"]) - 1 <= 100
    spike = max(range(len(body["edges"]) - 1), key=lambda c: body["values"][2][c])
    assert body["edges"][spike] <= 3001 < body["edges"][spike + 1]
    assert body["values"][2][spike] == pytest.approx(47.0) and body["values"][0][0] == pytest.approx(1.0)


def test_parity_pairs_runs_equal_but_for_the_key_and_gives_the_loss_gap(client, store):
    for seed in (1, 2):
        ingest(store, f"bf16-s{seed}", precision="bf16", seed=seed, loss=lambda s: 3.0 - 0.1 * s)
        ingest(store, f"fp8-s{seed}", precision="fp8", seed=seed, loss=lambda s, k=seed: 3.0 - 0.1 * s + 0.01 * k * s)
    ingest(store, "fp8-s3", precision="fp8", seed=3)  # no bf16 twin
    body = client.get(f"{API}/compare/parity").json()
    assert body["key"] == "precision" and body["reference"] == "bf16" and body["keys"][0] == "precision"
    assert [(p["reference"], p["other"], p["value"]) for p in body["pairs"]] == [
        ("bf16-s1", "fp8-s1", "fp8"), ("bf16-s2", "fp8-s2", "fp8")]
    assert body["unpaired"] == ["fp8-s3"]
    gap = body["pairs"][1]["gap"]
    assert gap["step"] == list(range(10))
    assert gap["gap"] == pytest.approx([0.02 * s for s in range(10)])

    chosen = client.get(f"{API}/compare/parity", params={"run": ["bf16-s1", "fp8-s1", "fp8-s2"]}).json()
    assert [p["other"] for p in chosen["pairs"]] == ["fp8-s1"] and chosen["unpaired"] == ["fp8-s2"]
    by_seed = client.get(f"{API}/compare/parity", params={"key": "seed", "reference": "1"}).json()
    assert [(p["reference"], p["other"]) for p in by_seed["pairs"]] == [
        ("bf16-s1", "bf16-s2"), ("fp8-s1", "fp8-s2"), ("fp8-s1", "fp8-s3")]


def test_pairing_reads_nested_keys_and_ignores_what_names_the_run():
    def run(name, **train):
        return Run(id=0, uid=name, name=name, status="running", config={"train": {"run_name": name, **train}}, tags={},
                   created_at=None, started_at=None, ended_at=None, last_seen_at=None, first_step=0, last_step=1)

    runs = [run("a", precision="bf16", lr=1), run("b", precision="fp8", lr=1), run("c", precision="fp8", lr=2),
            run("d", lr=1)]
    pairing = pair_runs(runs, "precision")
    assert [(r.name, o.name) for r, o, _ in pairing.pairs] == [("a", "b")]
    assert pairing.unpaired == ["c", "d"]
    assert [(r.name, o.name) for r, o, _ in pair_runs(runs, "precision", ignore=["lr"]).pairs] == [
        ("a", "b"), ("a", "c")]
    assert pair_runs(runs, "train.precision", reference="fp8").reference == "fp8"


def test_an_unchanged_answer_is_304_without_a_body_and_a_changed_one_has_a_new_etag(client, store):
    ingest(store, "polled", precision="fp8", seed=1)
    paths = [("/runs", {}), ("/runs/polled", {}), ("/runs/polled/catalogue", {}),
             ("/runs/polled/series", {"scalar": "loss"}),
             ("/runs/polled/heatmap", {"stat": "kurtosis", "site": "input"}),
             ("/runs/polled/alerts", {}), ("/runs/polled/predictions", {"limit": 1})]
    tags = {}
    for path, params in paths:
        first = client.get(API + path, params=params)
        assert first.status_code == 200 and first.headers["etag"].startswith('W/"'), path
        assert "no-cache" in first.headers["cache-control"]
        again = client.get(API + path, params=params, headers={"If-None-Match": first.headers["etag"]})
        assert (again.status_code, again.content) == (304, b""), path
        assert again.headers["etag"] == first.headers["etag"]
        tags[path] = first.headers["etag"]
    ingest(store, "polled", precision="fp8", seed=1, steps=range(10, 12), tag="more")
    for path, params in paths[3:5]:
        later = client.get(API + path, params=params, headers={"If-None-Match": tags[path]})
        assert later.status_code == 200 and later.headers["etag"] != tags[path], path
    assert client.get(f"{API}/runs/none", headers={"If-None-Match": "*"}).status_code == 404


def test_the_compactor_catching_up_on_an_idle_run_changes_no_answer_the_dashboard_polls(app_factory, store):
    # the background compactor off: this test runs the pass itself, between two polls of the same tab
    ingest(store, "settled", precision="fp8", seed=1, steps=range(400))
    paths = [("/runs", {}), ("/runs/settled", {}), ("/runs/settled/series", {"scalar": "loss", "max_points": 20}),
             ("/runs/settled/series", {"stat": "kurtosis", "layer": LAYERS[0], "site": "input", "max_points": 20}),
             ("/runs/settled/heatmap", {"stat": "kurtosis", "site": "input", "max_points": 20})]
    with app_factory(rollup_interval_s=0) as client:
        tags = [client.get(API + path, params=params).headers["etag"] for path, params in paths]
        assert store.compact().buckets > 0
        for (path, params), tag in zip(paths, tags):
            again = client.get(API + path, params=params, headers={"If-None-Match": tag})
            assert again.status_code == 304, (path, params, again.text)


def test_api_answers_are_gzipped_and_plotly_is_not_compressed_twice(client, store):
    ingest(store, "zipped", precision="fp8", seed=1, steps=range(200))
    response = client.get(f"{API}/runs/zipped/heatmap", params={"stat": "kurtosis"},
                          headers={"Accept-Encoding": "gzip"})
    assert response.headers["content-encoding"] == "gzip"
    assert int(response.headers["content-length"]) < len(response.content) / 3  # httpx decoded it
    plotly = client.get("/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert plotly.headers["content-encoding"] == "gzip"
    assert plotly.content.lstrip().startswith(b"/**") or b"plotly" in plotly.content[:2000].lower()
    raw = client.stream("GET", "/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    with raw as r:
        body = b"".join(r.iter_raw())
    assert gzip.decompress(body) == plotly.content


def test_docs_and_redoc_load_their_assets_from_the_monitor(client):
    for page, assets in (("/docs", ("swagger-ui-bundle.js", "swagger-ui.css")), ("/redoc", ("redoc.standalone.js",))):
        html = client.get(page).text
        assert "cdn" not in html.lower() and "fonts.googleapis" not in html
        for name in assets:
            assert f"/static/docs/{name}?v=" in html
            asset = client.get(f"/static/docs/{name}")
            assert asset.status_code == 200 and len(asset.content) > 100_000
            assert "max-age=31536000" in asset.headers["cache-control"]
    assert client.get("/static/docs/../../etc/passwd").status_code == 404
    assert client.get("/static/docs/secret.js").status_code == 404
