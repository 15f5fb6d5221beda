"""A layer's statistic or a scalar read "worst over ranks" (?worst_over_ranks=true), on SQLite and PostgreSQL: at
each step the largest value over the series' ranks, a NaN winning, the merged rank -1 left out while per-rank ones
exist; in buckets each aggregate the largest of the ranks'."""

import math

import numpy as np
import pytest

LAYERS = ["blocks.0.mlp", "blocks.1.mlp"]
STEPS = 400


@pytest.fixture
def three_ranks(store, kit):
    """Rank r: amax 10 r + layer index at every step, loss 1 + r; rank 1 has a NaN at step 50 (layer 0) and 99 at
    step 300 (layer 1, and its loss); rank 2 reports only even steps; a merged rank -1 holds 1000 everywhere."""
    for rank in (0, 1, 2):
        vals = np.array([[10.0 * rank + j for j in range(len(LAYERS))] for _ in range(STEPS)], dtype=object)
        loss = [1.0 + rank] * STEPS
        if rank == 1:
            vals[50, 0] = math.nan
            vals[300, 1] = 99.0
            loss[300] = 99.0
        if rank == 2:
            vals[1::2, :] = None
            loss = [v if s % 2 == 0 else None for s, v in enumerate(loss)]
        kit.ingest(store, "ddp", steps=range(STEPS), layers=LAYERS, values={"amax": vals}, rank=rank,
                   scalars={"loss": loss})
    kit.ingest(store, "ddp", steps=range(STEPS), layers=LAYERS, values={"amax": np.full((STEPS, 2), 1000.0)},
               rank=-1)


def reference(rank_values: list[list], step: int):
    present = [v[step] for v in rank_values if v[step] is not None]
    return math.nan if any(math.isnan(v) for v in present) else max(present)


@pytest.mark.parametrize("compacted", [False, True], ids=["raw", "compacted"])
def test_raw_points_are_the_largest_over_ranks_at_each_step(store, three_ranks, compacted):
    if compacted:
        store.compact()
    out = store.series("ddp", stat="amax", layer=LAYERS[1], site="input", rank=None).to_dict()
    assert out["rank"] is None and out["ranks"] == [0, 1, 2] and not out["downsampled"]
    points = out["points"]
    assert points["step"] == list(range(STEPS))
    want = [20.0 + 1 if s % 2 == 0 else 10.0 + 1 for s in range(STEPS)]
    want[300] = 99.0
    assert points["value"] == want

    nan = store.series("ddp", stat="amax", layer=LAYERS[0], site="input", rank=None, start=49, end=51).to_dict()
    assert nan["points"]["value"] == [10.0, "NaN", 10.0]  # at step 50 rank 1's NaN wins over rank 2's 20

    loss = store.series("ddp", scalar="loss", rank=None).to_dict()
    assert loss["ranks"] == [0, 1, 2]
    assert loss["points"]["value"][298:303] == [3.0, 2.0, 99.0, 2.0, 3.0]  # rank 2 only at even steps


def test_buckets_hold_the_largest_of_each_ranks_aggregate(store, kit, three_ranks):
    store.compact()
    out = store.series("ddp", stat="amax", layer=LAYERS[1], site="input", rank=None, max_points=10).to_dict()
    assert out["downsampled"]
    width = out["bucket_width"]
    per_rank = {r: store.series("ddp", stat="amax", layer=LAYERS[1], site="input", rank=r,
                                max_points=10).to_dict()["points"] for r in (0, 1, 2)}
    points = out["points"]
    assert points["step"] == per_rank[0]["step"]
    for i, first in enumerate(points["step"]):
        for agg in ("min", "max", "mean", "last"):
            values = [kit.decode(per_rank[r][agg][i]) for r in (0, 1, 2)]
            assert kit.same(points[agg][i], max(v for v in values if v is not None)), (agg, first, width)
        assert points["count"][i] == max(per_rank[r]["count"][i] for r in (0, 1, 2))
    assert 99.0 in points["max"] and 1000.0 not in points["max"]  # the merged rank stays out


def test_a_run_of_the_merged_rank_only_reads_it(store, kit):
    kit.ingest(store, "merged", steps=range(3), layers=LAYERS[:1], values={"amax": [[1.0], [2.0], [3.0]]}, rank=-1)
    out = store.series("merged", stat="amax", layer=LAYERS[0], site="input", rank=None).to_dict()
    assert out["ranks"] == [-1] and out["points"]["value"] == [1.0, 2.0, 3.0]


def test_the_api_reads_worst_over_ranks(app_factory, kit):
    with app_factory() as client:
        store = client.app.state.store
        for rank in (0, 3):
            kit.ingest(store, "api", steps=range(4), layers=LAYERS[:1],
                       values={"amax": [[float(rank + s)] for s in range(4)]}, rank=rank)
        body = client.get("/api/v1/runs/api/series", params={"stat": "amax", "layer": LAYERS[0], "site": "input",
                                                             "worst_over_ranks": "true", "rank": 0}).json()
        assert body["rank"] is None and body["ranks"] == [0, 3]
        assert body["points"]["value"] == [3.0, 4.0, 5.0, 6.0]
        one = client.get("/api/v1/runs/api/series", params={"stat": "amax", "layer": LAYERS[0], "site": "input",
                                                            "rank": 0}).json()
        assert one["rank"] == 0 and one["ranks"] == [0] and one["points"]["value"] == [0.0, 1.0, 2.0, 3.0]
