"""GET /metrics of the application: names and units, bounded labels, counters that follow ingest, per-run
gauges from the predictor, firing gauges that follow acknowledgements, and runs leaving the exposition (bound, end
of run, deletion)."""

import re
import shutil
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fp8mon.monitor.metrics import Metrics
from tests.integration.streams import FAKE_PREDICTOR, kurtosis_stream


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def runs_of(samples, name="fp8mon_run_last_step"):
    return {dict(labels)["run"] for (n, labels) in samples if n == name}


def wait_until(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not (result := fn()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met")
        time.sleep(0.05)
    return result


def test_metrics_follow_ingest_predictions_and_run_lifetimes(app_factory):
    with app_factory(metrics_max_runs=2, metrics_run_grace_seconds=1, predictor=FAKE_PREDICTOR) as c:
        before = scrape(c)
        assert value(before, "fp8mon_ingest_batches_total") == 0
        assert value(before, "fp8mon_predictor_queue_depth") == 0
        assert runs_of(before) == set()

        bodies = list(kurtosis_stream("r1", range(0, 30), lambda s: 60.0 if s >= 20 else 3.0))
        stored_values = 0
        for body in bodies:
            stored_values += c.post("/api/v1/ingest", json=body).json()["values"]
        assert c.post("/api/v1/ingest", json=bodies[0]).json()["duplicate"] is True
        assert c.post("/api/v1/ingest", json={"version": 1, "run": "r1"}).status_code == 422

        def caught_up():
            m = scrape(c)
            return m if value(m, "fp8mon_run_last_step", run="r1") == 29 else None

        s = wait_until(caught_up)
        assert value(s, "fp8mon_ingest_batches_total") == len(bodies)
        assert value(s, "fp8mon_ingest_values_total") == stored_values
        assert value(s, "fp8mon_ingest_duplicate_batches_total") == 1
        assert value(s, "fp8mon_ingest_rejected_total") == 1
        assert value(s, "fp8mon_ingest_request_duration_seconds_count") == len(bodies) + 2
        assert value(s, "fp8mon_run_risk_score", run="r1") == 1.0  # kurtosis 60 >= 50
        assert value(s, "fp8mon_run_worst_kurtosis", run="r1") == 60.0
        assert value(s, "fp8mon_run_worst_underflow_ratio", run="r1") == 0.001
        assert value(s, "fp8mon_run_worst_overflow_ratio", run="r1") == 0.0
        assert value(s, "fp8mon_run_steps_to_divergence", run="r1") == 0.0
        assert value(s, "fp8mon_run_nonfinite_tensors", run="r1") == 0
        assert value(s, "fp8mon_alerts_firing", run="r1", severity="critical") == 1
        assert value(s, "fp8mon_alerts_firing", run="r1", severity="warning") == 0
        assert time.time() - value(s, "fp8mon_run_last_seen_timestamp_seconds", run="r1") < 60
        assert value(s, "fp8mon_alert_events_total", severity="critical") == 1

        # labels are bounded: run and severity only (le for histogram buckets; build info's one series)
        assert {k for (name, labels) in s for k, _ in labels if name != "fp8mon_build_info"} <= {"run", "severity",
                                                                                                 "le"}

        # at most FP8MON_METRICS_MAX_RUNS=2 runs, the most recently active
        for run in ("r2", "r3"):
            for body in kurtosis_stream(run, range(0, 5), lambda s: 3.0):
                c.post("/api/v1/ingest", json=body)
        assert wait_until(lambda: runs_of(scrape(c)) == {"r2", "r3"})
        for body in kurtosis_stream("r1", range(30, 35), lambda s: 3.0):
            c.post("/api/v1/ingest", json=body)
        assert wait_until(lambda: runs_of(scrape(c)) == {"r1", "r3"})
        assert runs_of(scrape(c), "fp8mon_alerts_firing") == {"r1", "r3"}

        # deletion drops the run's series at once; a finished run's after the grace period (1 s)
        assert c.delete("/api/v1/runs/r3").status_code == 200
        assert "r3" not in runs_of(scrape(c), "fp8mon_alerts_firing")
        c.post("/api/v1/ingest", json={"version": 1, "batch_id": "end", "run": "r1",
                                       "run_meta": {"status": "finished"}})
        time.sleep(0.3)
        assert "r1" in runs_of(scrape(c))
        assert wait_until(lambda: "r1" not in runs_of(scrape(c)), timeout=10)


def test_acknowledging_takes_an_alert_out_of_the_firing_gauge_as_out_of_the_dashboard_count(app_factory):
    with app_factory(predictor=FAKE_PREDICTOR) as c:
        for body in kurtosis_stream("acked", range(0, 30), lambda s: 60.0 if s >= 20 else 3.0):
            c.post("/api/v1/ingest", json=body)

        def firing():
            return value(scrape(c), "fp8mon_alerts_firing", run="acked", severity="critical")

        def listed():
            return c.get("/api/v1/runs", params={"q": "acked"}).json()["runs"][0]["firing_by_severity"]

        wait_until(lambda: firing() == 1)
        assert listed() == {"critical": 1}
        alert = c.get("/api/v1/runs/acked/alerts", params={"state": "firing"}).json()["alerts"][0]

        assert c.post(f"/api/v1/alerts/{alert['id']}/ack").status_code == 200
        assert firing() == 0 and listed() == {}
        # the next batch keeps it out: the alert goes on firing, acknowledged
        for body in kurtosis_stream("acked", range(30, 40), lambda s: 60.0):
            c.post("/api/v1/ingest", json=body)
        wait_until(lambda: value(scrape(c), "fp8mon_run_last_step", run="acked") == 39)
        assert firing() == 0 and listed() == {}

        assert c.post(f"/api/v1/alerts/{alert['id']}/unack").status_code == 200
        assert firing() == 1 and listed() == {"critical": 1}
        assert c.post("/api/v1/runs/acked/alerts/ack").json()["acknowledged"] == [alert["id"]]
        assert firing() == 0 and listed() == {}


def test_exposition_passes_promtool_lint():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; scripts/test.sh installs it)")
    from prometheus_client import generate_latest

    m = Metrics()
    m.runs.update("exp/a", {"risk": 0.4, "last_step": 10, "worst_kurtosis": 5.0}, {"critical": 1})
    m.ingest_duration.observe(0.01)
    m.alert_events.labels("critical").inc()
    out = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(m.registry), capture_output=True)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    names = set(re.findall(r"^(fp8mon_\w+?)(?:_bucket|_count|_sum)?[{ ]", generate_latest(m.registry).decode(), re.M))
    assert names and all(n.startswith("fp8mon_") for n in names)
