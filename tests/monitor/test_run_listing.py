"""The run listing at scale (firing counts and worst severity per run from the server, search, sort by severity)
and the heatmap per rank (a rank's own map, the merged rank -1, the worst over ranks), on each backend."""

import math

import pytest

from fp8mon.monitor.storage import BadParameter
from tests.monitor.fleet import SEARCHED, WORST, make_fleet

API = "/api/v1"
SEVERITY_ORDER = ["info", "warning", "critical"]


def worst_of(counts: dict) -> str | None:
    return max(counts, key=SEVERITY_ORDER.index) if counts else None


def test_every_run_has_its_own_firing_counts_and_the_worst_sorts_first(store):
    fleet = make_fleet(store, n=160, noisy_from=100)
    page = store.list_runs(limit=1000)
    assert page.total == 160 and len(page.runs) == 160
    for run in page.runs:
        expected = fleet.firing.get(run.name, {})
        assert run.firing_by_severity == expected, run.name
        assert run.worst_severity == worst_of(expected)
        assert run.to_dict()["firing"] == store.list_alerts(run=run.name, state=["firing"]).total

    by_severity = store.list_runs(order_by="-severity", limit=30).runs
    assert by_severity[0].name == WORST and by_severity[0].risk == pytest.approx(0.95)
    levels = [(SEVERITY_ORDER.index(r.worst_severity) + 1 if r.worst_severity else 0,
               sum(r.firing_by_severity.values())) for r in by_severity]
    assert levels == sorted(levels, reverse=True)
    mildest = store.list_runs(order_by="severity", limit=1).runs[0]
    assert mildest.worst_severity is None

    assert store.list_runs(order_by="-firing", limit=1).runs[0].name == WORST
    assert store.list_runs(order_by="-risk", limit=1).runs[0].name == WORST

    found = store.list_runs(name="fog", order_by="name")
    assert found.total == 5 and [r.name for r in found.runs] == sorted(SEARCHED)
    assert store.list_runs(tags=["team=fog"]).total == 5
    second_page = store.list_runs(order_by="-severity", limit=2, offset=1).runs
    assert [r.name for r in second_page] == [r.name for r in by_severity[1:3]]
    with pytest.raises(BadParameter, match="order_by"):
        store.list_runs(order_by="-worst")


def test_runs_endpoint_keeps_its_contract_and_adds_the_health_fields(client, store):
    make_fleet(store, n=40, noisy_from=30)
    body = client.get(f"{API}/runs", params={"order_by": "-severity", "limit": 3}).json()
    assert body["total"] == 40 and body["limit"] == 3 and body["offset"] == 0
    first = body["runs"][0]
    assert first["name"] == WORST
    assert (first["firing"], first["firing_by_severity"], first["worst_severity"]) == (
        6, {"critical": 5, "warning": 1}, "critical")
    assert math.isclose(first["risk"], 0.95)
    default = client.get(f"{API}/runs").json()
    created = [r["created_at"] for r in default["runs"]]
    assert len(created) == 40 and created == sorted(created, reverse=True)  # newest first, as before
    assert {"id", "status", "config", "tags", "created_at", "last_step"} <= set(default["runs"][0])
    r = client.get(f"{API}/runs", params={"order_by": "-bogus"})
    assert r.status_code == 422 and "severity" in r.json()["detail"]


def _ranked(kit, store, run, ranks, layers=("l0", "l1"), steps=range(6)):
    """Kurtosis of layer j at step s on rank r: 3 + r + s/10 + j (rank -1 is the merged rank)."""
    for r in ranks:
        values = {"kurtosis": [[3 + r + s / 10 + j for j in range(len(layers))] for s in steps]}
        kit.ingest(store, run, steps=steps, layers=list(layers), values=values, rank=r)


def test_heatmap_per_rank_merged_rank_and_worst_over_ranks(client, store, kit):
    _ranked(kit, store, "dp8", range(8))
    _ranked(kit, store, "reduced", [-1])

    def heatmap(run, **params):
        r = client.get(f"{API}/runs/{run}/heatmap", params={"stat": "kurtosis", **params})
        assert r.status_code == 200, r.text
        return r.json()

    three = heatmap("dp8", rank=3)
    assert three["run_ranks"] == list(range(8)) and three["ranks"] == [3]
    assert three["values"][1][2] == pytest.approx(3 + 3 + 0.2 + 1)
    worst = heatmap("dp8", worst_over_ranks="true")
    assert worst["rank"] is None and worst["ranks"] == list(range(8))
    assert worst["values"][0] == pytest.approx([3 + 7 + s / 10 for s in range(6)])
    assert heatmap("dp8", worst_over_ranks="true", agg="min", max_points=2)["values"][0][0] == pytest.approx(10.0)

    merged = heatmap("reduced", rank=-1)
    assert merged["values"][0][0] == pytest.approx(2.0) and merged["run_ranks"] == [-1]
    assert heatmap("reduced", worst_over_ranks="true")["values"] == merged["values"]
    on_zero = heatmap("reduced")  # the old default: rank 0, which this run does not have
    assert on_zero["run_ranks"] == [-1] and all(v is None for row in on_zero["values"] for v in row)
    assert client.get(f"{API}/runs/reduced/catalogue").json()["ranks"] == [-1]
