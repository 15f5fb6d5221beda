"""The heatmap's "worst k layers" (?top=k) and its rounded values (?digits=n), on SQLite and PostgreSQL: the k layers
are those whose largest cell is largest (a NaN or +Infinity first, ties in model order, silent layers never), before
and after compaction, on one rank and over ranks; their cells are exact; rounding keeps 4 significant digits."""

import math

import numpy as np
import pytest

from fp8mon.monitor.jsonvalues import significant

LAYERS = [f"blocks.{j}.mlp" for j in range(8)]
STEPS = 3000
NAN_AT, INF_AT, SPIKE_AT = 2500, 100, 1777


@pytest.fixture
def planted(store, kit):
    """Rank 0: dyadic noise in [-64, 64) with a NaN (layer 1), +Infinity (layer 2), nothing at all (layer 3), a
    1000 spike (layer 4), a tie at 500 (layers 5 and 6), -Infinity (layer 7). Rank 1: layer 0 at 9999 once."""
    rng = np.random.default_rng(3)
    vals = kit.dyadic(rng, (STEPS, len(LAYERS))).astype(object)
    vals[NAN_AT, 1] = math.nan
    vals[INF_AT, 2] = math.inf
    vals[:, 3] = None
    vals[SPIKE_AT, 4] = 1000.0
    vals[1500, 5] = vals[1600, 6] = 500.0
    vals[1200, 7] = -math.inf
    kit.ingest(store, "planted", steps=range(STEPS), layers=LAYERS, values={"amax": vals}, batch_steps=1000)
    other = np.ones((STEPS, len(LAYERS)))
    other[1400, 0] = 9999.0
    kit.ingest(store, "planted", steps=range(STEPS), layers=LAYERS, values={"amax": other}, rank=1,
               batch_steps=1000)
    return vals


def largest(values) -> float | None:
    """A row's largest value as the worst-k view ranks it: NaN and +Infinity largest of all; None: no value."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return math.inf if any(math.isnan(v) or v == math.inf for v in present) else max(present)


def worst_first(scores: list) -> list[int]:
    return sorted((j for j, s in enumerate(scores) if s is not None), key=lambda j: (-scores[j], j))


@pytest.mark.parametrize("start, end, max_points", [(None, None, 600), (1000, 2000, 50), (0, 2999, 7)])
def test_top_layers_are_the_worst_with_exact_cells_before_and_after_compaction(store, kit, planted, start, end,
                                                                              max_points):
    lo, hi = start or 0, STEPS - 1 if end is None else end
    want = worst_first([largest(planted[lo:hi + 1, j]) for j in range(len(LAYERS))])
    assert 3 not in want  # the silent layer never ranks
    for state in ("raw", "compacted"):
        if state == "compacted":
            store.compact()
        for k in (1, 3, 8):
            out = store.heatmap("planted", stat="amax", site="input", start=start, end=end, max_points=max_points,
                                top=k).to_dict()
            assert out["layers"] == [LAYERS[j] for j in want[:k]], (state, k)
            assert (out["top"], out["layer_count"]) == (k, len(LAYERS))
            edges = out["edges"]
            assert len(edges) - 1 <= max_points
            for layer, row in zip(out["layers"], out["values"]):
                j = LAYERS.index(layer)
                for c, (a, b) in enumerate(zip(edges, edges[1:])):
                    ref = kit.bucket([(s, planted[s, j]) for s in range(a, b)])
                    assert kit.same(row[c], ref["max"] if ref["n"] else None), (state, layer, a, b)


def test_the_whole_run_ranks_the_nan_and_the_infinity_first_then_the_spike_and_the_tie_in_model_order(store, planted):
    out = store.heatmap("planted", stat="amax", site="input", top=5).to_dict()
    assert out["layers"] == [LAYERS[1], LAYERS[2], LAYERS[4], LAYERS[5], LAYERS[6]]


@pytest.mark.parametrize("agg", ["min", "mean", "last"])
def test_top_of_other_aggregates_ranks_the_cells_of_the_full_map(store, planted, agg):
    store.compact()
    full = store.heatmap("planted", stat="amax", site="input", max_points=40, agg=agg).to_dict()

    def score(row):
        cells = [{"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v) for v in row]
        return largest(cells)

    want = worst_first([score(row) for row in full["values"]])
    out = store.heatmap("planted", stat="amax", site="input", max_points=40, agg=agg, top=4).to_dict()
    assert out["layers"] == [full["layers"][j] for j in want[:4]]
    assert out["values"] == [full["values"][j] for j in want[:4]]


def test_top_over_ranks_finds_a_spike_of_another_rank(store, planted):
    store.compact()
    one = store.heatmap("planted", stat="amax", site="input", start=1000, end=2000, top=1).to_dict()
    assert one["layers"] == [LAYERS[4]]  # rank 0's spike
    worst = store.heatmap("planted", stat="amax", site="input", rank=None, start=1000, end=2000, top=1).to_dict()
    assert worst["layers"] == [LAYERS[0]] and worst["ranks"] == [0, 1]
    assert 9999.0 in worst["values"][0]


def test_a_run_without_steps_has_no_worst_layers(store, kit):
    kit.ingest(store, "quiet", steps=range(5), layers=LAYERS[:2], values={"amax": [[None, None]] * 5})
    out = store.heatmap("quiet", stat="amax", site="input", top=3).to_dict()
    assert out["layers"] == [] and out["values"] == [] and out["layer_count"] == 2


def test_digits_round_to_significant_digits_and_keep_nan_and_gaps(store, kit):
    row = [1 / 3, 123456.7, -0.000123456, math.nan, None, 2.0, math.inf]
    kit.ingest(store, "round", steps=range(len(row)), layers=["l"], values={"amax": [[v] for v in row]})
    exact = store.heatmap("round", stat="amax", site="input").to_dict()["values"][0]
    rounded = store.heatmap("round", stat="amax", site="input", digits=4).to_dict()["values"][0]
    assert exact[0] == 1 / 3
    assert rounded == [0.3333, 123500.0, -0.0001235, "NaN", None, 2.0, "Infinity"]


def test_significant_gives_the_short_decimal_and_leaves_extremes_alone():
    values = np.array([0.1 + 0.2, 9.99951, 99999.0, 7.77777e200, 5e-324, 0.0, -1.23456e-7])
    assert [repr(v) for v in significant(values, 4).tolist()] == [
        "0.3", "10.0", "100000.0", "7.778e+200", "5e-324", "0.0", "-1.235e-07"]
