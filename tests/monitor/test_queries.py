"""Series, heatmap, latest, catalogue and run queries (storage.runs, storage.series) on SQLite and PostgreSQL,
exact against brute-force references computed from the raw data, before, during and after compaction."""

import math
import random

import numpy as np
import pytest
from sqlalchemy import text

from fp8mon.monitor.models import ROLLUP_WIDTHS
from fp8mon.monitor.storage import BadParameter, NotFound
from fp8mon.monitor.storage import series as series_queries
from fp8mon.monitor.storage.series import decompose, plan_buckets

LAYERS = ["blocks.2.mlp", "blocks.0.attn", "blocks.1.attn"]  # model order is not alphabetical


# -- pure planning -----------------------------------------------------------------------------------


def test_plan_buckets_properties():
    rnd = random.Random(0)
    for _ in range(3000):
        start = rnd.randrange(0, 10**6)
        end = start + rnd.choice([0, 5, 100, 999, 1000, 1001, 5000, 10**5, 10**6, 3 * 10**7]) + rnd.randrange(50)
        max_points = rnd.choice([1, 2, 3, 7, 100, 391, 1000, 4000])
        n_series = rnd.choice([1, 100])
        plan = plan_buckets(start, end, max_points, n_series)
        span = end - start + 1
        assert plan.columns <= max_points
        assert (plan.width == 1) == (span <= max_points)
        if plan.level is not None:
            assert plan.level in ROLLUP_WIDTHS and plan.width % plan.level == 0
        edges = plan.edges()
        assert edges[0] == start and edges[-1] == end + 1 and len(edges) == plan.columns + 1
        assert all(b > a for a, b in zip(edges, edges[1:]))
        assert all(e % plan.width == 0 for e in edges[1:-1])


def test_plan_prefers_resolution_for_one_series_and_direct_rollups_for_many():
    one = plan_buckets(0, 99_999, 1000, n_series=1)
    many = plan_buckets(0, 99_999, 1000, n_series=100)
    assert (one.width, one.level) == (128, 64)  # two level-64 buckets per point, 782 points
    assert (many.width, many.level) == (256, 256)  # one rollup row per cell, 391 columns
    assert plan_buckets(0, 1999, 1000).width == 2  # below the first level: raw rows grouped by 2


def test_decompose_covers_the_range_with_valid_buckets():
    rnd = random.Random(1)
    levels = ROLLUP_WIDTHS[:4]
    for _ in range(3000):
        lo = rnd.randrange(0, 5000)
        hi = lo + rnd.randrange(1, 20000)
        horizon = rnd.randrange(0, 30000) // 16 * 16
        segs = decompose(lo, hi, horizon, levels)
        assert segs[0][1] == lo and segs[-1][2] == hi
        assert all(a[2] == b[1] for a, b in zip(segs, segs[1:]))
        raw = 0
        for w, a, b in segs:
            assert b > a
            if w == 1:
                raw += b - a
            else:
                assert a % w == 0 and b % w == 0 and b <= horizon // w * w
        # raw rows only at the edges and above the horizon
        assert raw <= 2 * 15 + max(0, hi - max(lo, horizon // 16 * 16))


# -- data --------------------------------------------------------------------------------------------


def mixed(kit, rng, n_steps, n_layers):
    vals = kit.dyadic(rng, (n_steps, n_layers)).astype(object)
    for value, count in ((math.nan, 8), (math.inf, 5), (-math.inf, 5), (None, 30)):
        for i, j in zip(rng.integers(0, n_steps, count), rng.integers(0, n_layers, count)):
            vals[i, j] = value
    return vals


@pytest.fixture
def loaded(store, kit):
    """Run "r": LAYERS x input (+ a weight site), 4000 steps with NaN/Inf/None; scalar loss; a second run."""
    rng = np.random.default_rng(7)
    n = 4000
    vals = mixed(kit, rng, n, len(LAYERS))
    weight = kit.dyadic(rng, (n, len(LAYERS)))
    loss = [float(x) for x in kit.dyadic(rng, n)]
    loss[2222] = math.nan
    kit.ingest(store, "r", steps=range(n), layers=LAYERS, values={"amax": vals, "kurtosis": weight},
               scalars={"loss": loss}, batch_steps=1000)
    kit.ingest(store, "r", steps=range(n), layers=LAYERS, values={"amax": weight}, site="weight", batch_steps=2000)
    kit.ingest(store, "other", steps=range(100), layers=LAYERS, values={"amax": np.full((100, 3), 99.0)})
    raw = {("amax", layer): {s: vals[s][j] for s in range(n)} for j, layer in enumerate(LAYERS)}
    raw.update({("kurtosis", layer): {s: float(weight[s][j]) for s in range(n)} for j, layer in enumerate(LAYERS)})
    raw[("loss", None)] = dict(enumerate(loss))
    return raw


def compaction_states(store, kit, raw):
    """Yields after each state of the pyramid: none, compacted, a late batch (dirty), recompacted."""
    yield "raw"
    store.compact()
    yield "compacted"
    late = np.full((30, len(LAYERS)), 512.0)
    kit.ingest(store, "r", steps=range(1000, 1030), layers=LAYERS, values={"amax": late}, batch_prefix="late")
    for j, layer in enumerate(LAYERS):
        for s in range(1000, 1030):
            raw[("amax", layer)][s] = 512.0
    yield "dirty"
    store.compact()
    yield "recompacted"


def check_series(kit, out, pairs_by_step, start, end):
    points = out["points"]
    if not out["downsampled"]:
        want = [(s, v) for s, v in sorted(pairs_by_step.items()) if start <= s <= end and v is not None]
        assert points["step"] == [s for s, _ in want]
        assert all(kit.same(a, b) for a, b in zip(points["value"], [v for _, v in want]))
        return
    width = out["bucket_width"]
    expected = []
    b = start // width
    while b * width <= end:
        lo, hi = max(start, b * width), min(end, (b + 1) * width - 1)
        ref = kit.bucket([(s, pairs_by_step[s]) for s in range(lo, hi + 1) if s in pairs_by_step])
        if ref["n"]:
            expected.append((lo, ref))
        b += 1
    assert points["step"] == [lo for lo, _ in expected]
    for name in ("min", "max", "mean", "last"):
        for i, (lo, ref) in enumerate(expected):
            assert kit.same(points[name][i], ref[name]), (name, lo, points[name][i], ref[name], out["bucket_width"])
    assert points["count"] == [ref["n"] for _, ref in expected]


RANGES = [(None, None, 1000), (None, None, 37), (0, 3999, 4000), (5, 3990, 100), (1013, 1029, 5), (333, 2900, 250),
          (17, 3333, 7), (1000, 1000, 1)]


def test_series_is_exact_in_every_compaction_state(store, kit, loaded):
    for state in compaction_states(store, kit, loaded):
        for start, end, max_points in RANGES:
            lo = 0 if start is None else start
            hi = 3999 if end is None else end
            for layer in LAYERS[:2]:
                out = store.series("r", stat="amax", layer=layer, site="input", start=start, end=end,
                                     max_points=max_points).to_dict()
                assert (out["start"], out["end"]) == (lo, hi)
                check_series(kit, out, loaded[("amax", layer)], lo, hi)
            out = store.series("r", scalar="loss", start=start, end=end, max_points=max_points).to_dict()
            check_series(kit, out, loaded[("loss", None)], lo, hi)


@pytest.mark.parametrize("budget", [None, 0], ids=["finest", "direct"])
def test_heatmap_is_exact_in_every_compaction_state(store, kit, loaded, monkeypatch, budget):
    if budget is not None:
        monkeypatch.setattr(series_queries, "SCAN_BUDGET", budget)
    for state in compaction_states(store, kit, loaded):
        for start, end, max_points in RANGES[:6]:
            for agg in ("max", "min", "mean", "last"):
                out = store.heatmap("r", stat="amax", site="input", start=start, end=end,
                                      max_points=max_points, agg=agg).to_dict()
                assert out["layers"] == LAYERS
                edges = out["edges"]
                assert len(edges) - 1 <= max_points and all(len(row) == len(edges) - 1 for row in out["values"])
                for j, layer in enumerate(LAYERS):
                    raw = loaded[("amax", layer)]
                    for c, (a, b) in enumerate(zip(edges, edges[1:])):
                        ref = kit.bucket([(s, raw[s]) for s in range(a, b) if s in raw])
                        want = ref[agg] if ref["n"] or agg == "last" else None
                        assert kit.same(out["values"][j][c], want), (state, agg, layer, a, b, out["values"][j][c], want)


def test_heatmap_of_another_site_and_statistic(store, kit, loaded):
    store.compact()
    out = store.heatmap("r", stat="kurtosis", site="input", max_points=10, agg="mean").to_dict()
    for j, layer in enumerate(LAYERS):
        raw = loaded[("kurtosis", layer)]
        for c, (a, b) in enumerate(zip(out["edges"], out["edges"][1:])):
            assert kit.same(out["values"][j][c], kit.bucket([(s, raw[s]) for s in range(a, b)])["mean"])
    weight = store.heatmap("r", stat="amax", site="weight", max_points=10, agg="max").to_dict()
    assert weight["layers"] == LAYERS
    empty = store.heatmap("r", stat="amax", site="grad_output").to_dict()
    assert empty["layers"] == [] and empty["values"] == []


def test_a_spike_and_a_nan_survive_every_zoom_level(store, kit):
    n = 100_000
    vals = np.ones((n, 1))
    spike, nan_at = 61_234, 7_777
    vals[spike, 0] = 1e6
    vals[nan_at, 0] = math.nan
    kit.ingest(store, "s", steps=range(n), layers=["l"], values={"amax": vals}, batch_steps=25_000)
    store.compact()
    levels_used = set()
    for max_points in (6250, 1563, 1000, 391, 98, 25, 7, 3, 1):
        plan = plan_buckets(0, n - 1, max_points)
        levels_used.add(plan.level)
        out = store.series("s", stat="amax", layer="l", site="input", max_points=max_points).to_dict()
        points = out["points"]
        assert len(points["step"]) <= max_points and out["bucket_width"] == plan.width
        spike_col = max(i for i, s in enumerate(points["step"]) if s <= spike)
        nan_col = max(i for i, s in enumerate(points["step"]) if s <= nan_at)
        if spike_col != nan_col:
            assert points["max"][spike_col] == 1e6 and points["min"][spike_col] == 1.0
        assert points["max"][nan_col] == "NaN" and points["min"][nan_col] == "NaN"
        assert points["mean"][nan_col] == "NaN"
        assert all(points["max"][i] == 1.0 for i in range(len(points["step"])) if i not in (spike_col, nan_col))
        heat = store.heatmap("s", stat="amax", site="input", max_points=max_points).to_dict()
        row = heat["values"][0]
        assert row.count("NaN") == 1 and (row.count(1e6) == 1 or spike_col == nan_col)
    assert levels_used >= set(ROLLUP_WIDTHS)


def test_latest_and_catalogue(store, kit, loaded):
    kit.ingest(store, "r", steps=[4100], layers=LAYERS[:1], values={"amax": [[7.5]], "nonfinite": [[math.inf]]},
               rank=1)
    latest = store.latest("r").to_dict()
    assert [(s["layer"], s["site"]) for s in latest["series"]] == [(layer, site) for site in ("input", "weight")
                                                                    for layer in LAYERS]
    first = latest["series"][0]
    assert first["step"] == 3999
    assert kit.same(first["values"]["amax"], loaded[("amax", LAYERS[0])][3999])
    assert first["values"]["numel"] is None
    assert latest["scalars"][0]["name"] == "loss" and latest["scalars"][0]["step"] == 3999
    rank1 = store.latest("r", rank=1).to_dict()
    assert rank1["series"] == [{"layer": LAYERS[0], "site": "input", "step": 4100,
                                "values": {**{s: None for s in rank1["stats"]}, "amax": 7.5,
                                           "nonfinite": "Infinity"}}]
    cat = store.catalogue("r").to_dict()
    assert [entry["layer"] for entry in cat["layers"]] == LAYERS
    assert all(entry["sites"] == ["input", "weight"] for entry in cat["layers"])
    assert cat["sites"] == ["input", "weight"] and cat["scalars"] == ["loss"] and cat["ranks"] == [0, 1]
    assert (cat["first_step"], cat["last_step"]) == (0, 4100) and "kurtosis" in cat["stats"]


def test_unknown_things_and_bad_parameters(store, kit, loaded):
    with pytest.raises(NotFound, match="run 'nope' not found"):
        store.series("nope", scalar="loss").to_dict()
    with pytest.raises(NotFound, match="no series for layer 'x'"):
        store.series("r", stat="amax", layer="x", site="input").to_dict()
    with pytest.raises(NotFound, match="no scalar 'lr'"):
        store.series("r", scalar="lr").to_dict()
    with pytest.raises(BadParameter, match="^layer: required"):
        store.series("r", stat="amax", site="input").to_dict()
    with pytest.raises(BadParameter, match="^scalar: give either"):
        store.series("r", scalar="loss", stat="amax").to_dict()
    with pytest.raises(BadParameter, match=r"start \(9\) must be <= end \(3\)"):
        store.heatmap("r", stat="amax", site="input", start=9, end=3).to_dict()
    # a range past the data is empty, not an error
    out = store.series("r", scalar="loss", start=10**6, end=10**6 + 10**5).to_dict()
    assert out["points"]["step"] == []


def test_run_listing_filters_and_pages(store, kit):
    for i in range(7):
        meta = {"tags": {"team": "a" if i % 2 else "b", "seq": str(i)}, "status": "finished" if i < 3 else "running"}
        kit.ingest(store, f"exp/{i}-{'big' if i > 4 else 'small'}", steps=[i], layers=["l"], values={"amax": [[1.0]]},
                   run_meta=meta)
    page = store.list_runs(order_by="name", limit=3, offset=0).to_dict()
    assert page["total"] == 7 and [r["name"] for r in page["runs"]] == ["exp/0-small", "exp/1-small", "exp/2-small"]
    page2 = store.list_runs(order_by="name", limit=3, offset=6).to_dict()
    assert [r["name"] for r in page2["runs"]] == ["exp/6-big"]
    names = lambda **kw: [r["name"] for r in store.list_runs(order_by="name", **kw).to_dict()["runs"]]  # noqa: E731
    assert names(status=["finished"]) == ["exp/0-small", "exp/1-small", "exp/2-small"]
    assert names(name="BIG") == ["exp/5-big", "exp/6-big"]
    assert names(name="exp/?-s*") == ["exp/0-small", "exp/1-small", "exp/2-small", "exp/3-small", "exp/4-small"]
    assert names(name="%") == [] and names(name="_") == []  # LIKE wildcards are literal
    assert names(tags=["team=a"]) == ["exp/1-small", "exp/3-small", "exp/5-big"]
    assert names(tags=["team=a", "seq=3"]) == ["exp/3-small"]
    assert names(tags=["seq"]) == names() and names(tags=["nope"]) == []
    assert names(status=["running"], tags=["team=b"]) == ["exp/4-small", "exp/6-big"]
    assert [r["last_step"] for r in store.list_runs(order_by="-last_step").to_dict()["runs"]] == [6, 5, 4, 3, 2, 1, 0]
    newest = store.list_runs().to_dict()["runs"][0]
    assert newest["name"] == "exp/6-big" and newest["created_at"].endswith("+00:00")
    from datetime import datetime, timedelta
    created = datetime.fromisoformat(newest["created_at"])
    assert names(created_since=created) == ["exp/6-big"]
    assert len(names(updated_since=created - timedelta(hours=1))) == 7
    assert names(created_since=created + timedelta(seconds=1)) == []
    with pytest.raises(BadParameter, match="^order_by"):
        store.list_runs(order_by="colour").to_dict()


def test_patch_and_delete(store, kit, loaded):
    store.compact()
    out = store.patch_run("r", status="diverged", tags={"note": "x"}, config={"lr": 3e-4}).to_dict()
    assert out["status"] == "diverged" and out["ended_at"] and out["tags"] == {"note": "x"}
    assert out["config"] == {"lr": 3e-4}
    out = store.patch_run("r", tags={"more": "y"}).to_dict()
    assert out["tags"] == {"note": "x", "more": "y"} and out["config"] == {"lr": 3e-4}
    assert store.patch_run("r", status="running").to_dict()["ended_at"] is None

    def counts():
        with store.engine.connect() as conn:
            return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                    for t in ("tensor_stats", "scalars", "tensor_rollups", "scalar_rollups", "tensor_series",
                              "scalar_series", "ingest_batches", "runs")}

    before = counts()
    assert all(before[t] > 0 for t in before)
    deleted = store.delete_run("r").to_dict()
    assert deleted["deleted_rows"]["tensor_stats"] == 4000 * 6
    after = counts()
    # only the other run is left: 3 layers x 100 steps (rolled up to step 64: 3 x (4 + 1) buckets), no scalars
    assert after == {"tensor_stats": 300, "scalars": 0, "tensor_rollups": 15, "scalar_rollups": 0,
                     "tensor_series": 3, "scalar_series": 0, "ingest_batches": 1, "runs": 1}
    with pytest.raises(NotFound):
        store.get_run("r").to_dict()
    with pytest.raises(NotFound):
        store.delete_run("r").to_dict()
    # the name can be used again, from scratch (the store forgot its cached ids)
    kit.ingest(store, "r", steps=[5], layers=["new"], values={"amax": [[2.0]]}, batch_prefix="again")
    assert store.catalogue("r").to_dict()["layers"] == [{"layer": "new", "sites": ["input"]}]
    assert store.get_run("r").to_dict()["first_step"] == 5
