"""What the run view reads from the API: a run's status as the user should read it (stalled when its trainer went
silent, diverged once the loss met the divergence rule), the stored log2 histograms with the FP8 limits drawn at the
scale in use, and the worst k layers of a heatmap of hundreds. Each on every backend."""

import math
import time
from urllib.parse import quote

from fp8mon.agent import formats as agent_formats
from fp8mon.agent.core import DEFAULT_FORMATS
from fp8mon.agent.wire import LOG2_HIST_BINS, LOG2_HIST_LO
from fp8mon.monitor import fp8_formats
from fp8mon.monitor.alerting.lifecycle import Alert
from fp8mon.monitor.predictors.scalars import LossDivergence
from fp8mon.monitor.storage import SqlAlchemyStore
from fp8mon.monitor.storage.entities import AlertWrite, PredictionRecord
from fp8mon.monitor.storage.run_status import DIVERGENCE_RULE, StallPolicy
from fp8mon.monitor.wire import IngestBatch

API = "/api/v1"


def send(store, run: str, step: int, status: str | None = None, tensors: dict | None = None) -> None:
    body = {"version": 1, "batch_id": f"{run}-{step}-{time.monotonic_ns()}", "run": run,
            "scalars": {"step": [step], "name": ["loss"], "value": [2.0]}}
    if status:
        body["run_meta"] = {"status": status}
    if tensors:
        body["tensors"] = tensors
    store.ingest(IngestBatch.model_validate(body))


def loss_divergence_alert(store, run: str, fired: bool) -> None:
    run_id = store.list_runs(name=run).runs[0].id
    alert = Alert(run=run, rule=DIVERGENCE_RULE, layer=None, site=None, severity="critical",
                  state="resolved" if fired else "pending", message="loss above its minimum", first_step=1,
                  last_step=2, fired_step=1 if fired else None, resolved_step=2 if fired else None)
    store.record_assessments(run_id, [], [AlertWrite(alert, resolved=fired)], {})


def test_a_silent_run_reads_stalled_after_several_of_its_own_intervals_and_a_diverged_loss_reads_diverged(
        database_url, app_factory):
    assert DIVERGENCE_RULE == LossDivergence.name
    store = SqlAlchemyStore(database_url, stall=StallPolicy(intervals=5, min_seconds=1.0))
    try:
        for step in range(3):  # killed: three batches 50 ms apart, then nothing
            send(store, "killed", step)
            time.sleep(0.05)
        send(store, "slow", 0)  # a batch every ~0.7 s: silent for longer than the minimum, not for five intervals
        send(store, "done", 0, status="finished")
        send(store, "diverging", 0)  # silent too: diverged wins over stalled
        loss_divergence_alert(store, "diverging", fired=True)  # fired, and resolved since: still diverged
        time.sleep(0.7)
        send(store, "slow", 1)
        time.sleep(0.8)
        for step in range(3):
            send(store, "alive", step)
            time.sleep(0.1)
        send(store, "almost", 0)
        loss_divergence_alert(store, "almost", fired=False)  # pending only: the rule never held for long enough
        runs = {r.name: r for r in store.list_runs(limit=100).runs}
        assert {name: r.status for name, r in runs.items()} == {
            "killed": "stalled", "slow": "running", "done": "finished", "diverging": "diverged",
            "almost": "running", "alive": "running"}
        killed = runs["killed"]
        assert killed.reported_status == "running" and killed.ended_at is None
        assert 0.04 < killed.report_interval_s < 0.5
        assert killed.last_seen_at < runs["alive"].last_seen_at
        assert runs["slow"].report_interval_s > 0.6 and runs["done"].report_interval_s is None
        assert [r.name for r in store.list_runs(status=["stalled"]).runs] == ["killed"]
        assert {r.name for r in store.list_runs(status=["running"]).runs} == {"slow", "almost", "alive"}
        assert store.list_runs(order_by="status", limit=1).runs[0].status == "diverged"  # alphabetical, as before
        assert store.get_run("killed").run.status == "stalled"
    finally:
        store.close()

    # The server's settings give the policy; the default minute keeps a just-killed run "running" for a while.
    with app_factory(stall_min_seconds=1.0) as client:
        stalled = {r["name"] for r in client.get(f"{API}/runs", params={"status": "stalled"}).json()["runs"]}
        assert "killed" in stalled and not stalled & {"done", "diverging"}
        one = client.get(f"{API}/runs/killed").json()
        assert (one["status"], one["reported_status"]) == ("stalled", "running")
        assert one["last_seen_at"] is not None and one["report_interval_s"] > 0
        assert client.get(f"{API}/runs", params={"status": "asleep"}).status_code == 422
    with app_factory() as client:
        assert client.get(f"{API}/runs/killed").json()["status"] == "running"


def hist(peak: int, n: int = 1000) -> list[int]:
    counts = [0] * LOG2_HIST_BINS
    counts[peak - LOG2_HIST_LO] = n
    counts[0] = 1  # tiny values, far below any limit
    return counts


def test_histogram_endpoint_returns_the_stored_binades_and_the_format_limits_at_the_scale_in_use(
        client, store):
    run = "hist/run"
    for step in range(8):  # a histogram on even steps only; the scale doubles at step 4
        scale = 2.0 if step < 4 else 4.0
        even = step % 2 == 0
        send(store, run, step, tensors={
            "step": step, "layer": ["blocks.0.fc1"] * 3, "site": ["input", "grad_output", "output"],
            "stats": {"scale": [scale, 8.0, None]}, "log2_hist": [hist(step - 3), hist(-20), hist(0)] if even else None})

    got = client.get(f"{API}/runs/{quote(run)}/histogram", params={"layer": "blocks.0.fc1", "site": "input"}).json()
    assert (got["binade_lo"], got["bins"], got["per_column"]) == (LOG2_HIST_LO, LOG2_HIST_BINS, 1)
    assert got["step"] == [0, 2, 4, 6] == got["step_last"]
    assert got["counts"] == [hist(s - 3) for s in (0, 2, 4, 6)]
    limits = got["limits"]
    assert limits["format"]["name"] == "e4m3" and limits["format"]["max"] == 448.0
    # |x| saturates above 464 / s and becomes zero at or below 2^-10 / s
    assert limits["overflow_log2"] == [math.log2(464 / s) for s in (2, 2, 4, 4)]
    assert limits["underflow_log2"] == [-10 - math.log2(s) for s in (2, 2, 4, 4)]
    assert limits["min_normal_log2"] == [-6 - math.log2(s) for s in (2, 2, 4, 4)]

    summed = client.get(f"{API}/runs/{quote(run)}/histogram",
                        params={"layer": "blocks.0.fc1", "site": "input", "max_points": 2, "start": 1}).json()
    assert (summed["step"], summed["step_last"], summed["per_column"]) == ([2, 6], [4, 6], 2)
    assert summed["counts"][0] == [a + b for a, b in zip(hist(-1), hist(1))]
    assert (summed["scale_min"], summed["scale_max"]) == ([2.0, 4.0], [4.0, 4.0])
    assert summed["limits"]["overflow_log2"][0] == math.log2(464 / 4)  # the column's worst case

    grads = client.get(f"{API}/runs/{quote(run)}/histogram", params={"layer": "blocks.0.fc1",
                                                                     "site": "grad_output"}).json()
    assert grads["limits"]["format"]["name"] == "e5m2"
    assert grads["limits"]["underflow_log2"][0] == -17 - 3
    output = client.get(f"{API}/runs/{quote(run)}/histogram", params={"layer": "blocks.0.fc1",
                                                                      "site": "output"}).json()
    assert output["limits"] is None and output["counts"][0] == hist(0)
    chosen = client.get(f"{API}/runs/{quote(run)}/histogram", params={"layer": "blocks.0.fc1", "site": "output",
                                                                      "format": "e4m3"}).json()
    assert chosen["limits"]["overflow_log2"][0] == math.log2(464)  # no scale reported: drawn at s = 1
    missing = client.get(f"{API}/runs/{quote(run)}/histogram", params={"layer": "nope", "site": "input"})
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


def test_histograms_summed_over_ranks_are_all_ranks_values_together_with_every_ranks_scales(client, store):
    """What the dashboard draws under "worst over ranks": per step the ranks' histograms added (the merged rank -1
    left out beside them), the limits at the smallest and largest scale of any rank; columns still sum steps."""
    def ranked(run, rank, step, peak, scale):
        send(store, run, step, tensors={"step": step, "rank": rank, "layer": ["blocks.0.fc1"], "site": ["input"],
                                        "stats": {"scale": [scale]}, "log2_hist": [hist(peak, n=10 + rank)]})

    for step in (0, 2, 4):
        ranked("hist/ranks", 0, step, step - 3, 2.0)
        ranked("hist/ranks", 1, step, step - 1, 8.0)
        ranked("hist/ranks", -1, step, 5, 1.0)  # a merged record too: not counted twice
        ranked("hist/merged-only", -1, step, step, 4.0)
    params = {"layer": "blocks.0.fc1", "site": "input", "sum_over_ranks": "true"}

    got = client.get(f"{API}/runs/hist/ranks/histogram", params=params).json()
    assert got["rank"] is None and got["step"] == [0, 2, 4] == got["step_last"] and got["per_column"] == 1
    assert got["counts"] == [[a + b for a, b in zip(hist(s - 3, n=10), hist(s - 1, n=11))] for s in (0, 2, 4)]
    assert (got["scale_min"], got["scale_max"]) == ([2.0] * 3, [8.0] * 3)
    assert got["limits"]["overflow_log2"] == [math.log2(464 / 8)] * 3  # the largest scale saturates first
    one = client.get(f"{API}/runs/hist/ranks/histogram", params={**params, "sum_over_ranks": "false", "rank": 1})
    assert one.json()["rank"] == 1 and one.json()["counts"] == [hist(s - 1, n=11) for s in (0, 2, 4)]

    columns = client.get(f"{API}/runs/hist/ranks/histogram", params={**params, "max_points": 2}).json()
    assert (columns["step"], columns["step_last"], columns["per_column"]) == ([0, 4], [2, 4], 2)
    assert columns["counts"][1] == got["counts"][2]

    merged = client.get(f"{API}/runs/hist/merged-only/histogram", params=params).json()
    assert merged["counts"] == [hist(s, n=9) for s in (0, 2, 4)]


def test_the_servers_format_table_is_the_agents():
    for name, agent_fmt in agent_formats.FORMATS.items():
        mine = fp8_formats.FORMATS[name]
        assert (mine.max, mine.min_normal, mine.min_subnormal, mine.overflow, mine.underflow) == (
            agent_fmt.max, agent_fmt.min_normal, agent_fmt.min_subnormal, agent_fmt.overflow_threshold,
            agent_fmt.underflow_threshold)
    assert fp8_formats.SITE_FORMATS == DEFAULT_FORMATS


def test_worst_k_layers_of_560_put_the_planted_layer_first_with_its_name(client, store):
    layers = [f"blocks.{i // 5}.{['q', 'k', 'v', 'o', 'mlp'][i % 5]}" for i in range(560)]
    planted, broken, silent = 377, 12, 500
    steps = range(6)
    kurtosis = []
    for s in steps:
        for j in range(len(layers)):
            value = 3.0 + j / 1000
            if j == planted and s >= 3:
                value = 3.0 * 148
            if j == broken and s == 5:
                value = math.nan
            kurtosis.append(None if j == silent else value)
    store.ingest(IngestBatch.model_validate({
        "version": 1, "batch_id": "deep", "run": "deep",
        "tensors": {"step": [s for s in steps for _ in layers], "layer": layers * len(steps),
                    "site": ["input"] * len(kurtosis), "stats": {"kurtosis": kurtosis}}}))
    top = client.get(f"{API}/runs/deep/heatmap", params={"stat": "kurtosis", "top": 4}).json()
    assert top["layers"] == [layers[broken], layers[planted], layers[559], layers[558]]
    assert top["top"] == 4 and top["layer_count"] == 560
    assert top["values"][1] == [3.0 + planted / 1000] * 3 + [3.0 * 148] * 3
    assert top["values"][0][-1] == "NaN"
    every = client.get(f"{API}/runs/deep/heatmap", params={"stat": "kurtosis", "top": 600}).json()
    assert len(every["layers"]) == 559 and layers[silent] not in every["layers"]  # nothing reported: never ranks
    plain = client.get(f"{API}/runs/deep/heatmap", params={"stat": "kurtosis"}).json()
    assert plain["layers"] == layers and plain["top"] is None and plain["layer_count"] == 560
    assert client.get(f"{API}/runs/deep/heatmap", params={"stat": "kurtosis", "top": 0}).status_code == 422


def test_risk_only_predictions_keep_step_and_risk_and_leave_out_the_details(client, store):
    send(store, "risky", 1)
    run_id = store.list_runs(name="risky").runs[0].id
    store.record_assessments(run_id, [PredictionRecord(step=s, risk=s / 10, steps_to_divergence=None,
                                                       signals={"kurtosis_growth": 0.5},
                                                       culprits=[{"layer": "l", "site": "input"}]) for s in (1, 2, 3)],
                             [], {})
    full = client.get(f"{API}/runs/risky/predictions").json()["predictions"]
    brief = client.get(f"{API}/runs/risky/predictions", params={"risk_only": True, "from_step": 2}).json()
    assert [(p["step"], p["risk"]) for p in brief["predictions"]] == [(2, 0.2), (3, 0.3)]
    assert all(p["signals"] == {} and p["culprits"] == [] for p in brief["predictions"])
    assert full[0]["signals"] == {"kurtosis_growth": 0.5}

