"""End to end: a real `fp8mon serve` fed a diverging run over HTTP, scraped by a real Prometheus server that
evaluates dashboards/rules/fp8mon.yml (its `for:` durations shortened to seconds); the run-level divergence alert
fires in Prometheus for that run, the monitor's own REST alert list shows it firing, and a stable run fires
nothing critical in either (nothing at all with the synthetic streams; with the fixtures, warning-level findings
on stable runs are the predictors' false alerts, which bench/predict.py reports).

The streams: the labelled CPU fixtures (tests/fixtures/runs/*.json.gz) replayed through the real predictors when
the corpus has a diverging and a stable one; otherwise a synthetic stream (kurtosis of one layer growing past the
thresholds) through the deterministic stand-in predictor of tests/integration/fake_predictor.py.
"""

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.localserver import free_port
from tests.integration.ready import wait_ready
from tests.integration.streams import fake_predictor_env, kurtosis_stream

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
RULES = Path(__file__).resolve().parents[2] / "dashboards" / "rules" / "fp8mon.yml"
ALERT = "FP8RunDivergenceRisk"

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="prometheus server not installed (Debian package "
                                                            "'prometheus'; scripts/test.sh installs it)"),
              pytest.mark.sqlite_only]


def streams():
    """(diverging run, its batches), (stable run, its batches), server env, source description."""
    try:
        from fp8mon.monitor.fixtures import fixture_paths, load_fixture

        diverging = stable = None
        for path in fixture_paths(profile="cpu"):
            f = load_fixture(path)
            if f.diverged and diverging is None:
                diverging = f
            elif not f.diverged and stable is None:
                stable = f
            if diverging and stable:
                return ((diverging.batches[0]["run"], diverging.batches), (stable.batches[0]["run"], stable.batches),
                        {}, "fixtures")
    except ImportError:
        pass
    bad = list(kurtosis_stream("synthetic/diverging", range(0, 200), lambda s: 3.0 * 1.03 ** s, per_batch=20))
    good = list(kurtosis_stream("synthetic/stable", range(0, 200), lambda s: 3.0, per_batch=20))
    return ("synthetic/diverging", bad), ("synthetic/stable", good), fake_predictor_env(), "synthetic"


@pytest.fixture
def prometheus(tmp_path):
    """Start a Prometheus server scraping `target` every second; stopped (killed if need be) whatever happens."""
    procs = []

    def start(target: str) -> str:
        rules = re.sub(r"(?m)^(\s*for:\s*)\S+", r"\g<1>2s", RULES.read_text())
        (tmp_path / "rules.yml").write_text(rules)
        (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [rules.yml]
scrape_configs:
  - job_name: fp8mon
    metrics_path: /metrics
    static_configs: [{{targets: ["{target}"]}}]
""")
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_ready(procs[-1], url, tmp_path / "prometheus.log", "prometheus", timeout=30, poll=0.2)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_diverging_run_fires_in_prometheus_and_the_monitor(server_factory, prometheus, tmp_path):
    (bad_run, bad), (good_run, good), env, source = streams()
    server = server_factory(**env).start()
    prom = prometheus(f"127.0.0.1:{server.port}")
    with httpx.Client(base_url=server.url, timeout=30, headers={CLIENT_HEADER: "tests"}) as c:
        for body in good + bad:
            r = c.post("/api/v1/ingest", json=body)
            assert r.status_code == 200, r.text

        deadline = time.monotonic() + 60
        firing, seen = [], []
        while time.monotonic() < deadline:
            seen = httpx.get(f"{prom}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
            firing = [a for a in seen if a["labels"].get("alertname") == ALERT and a["state"] == "firing"]
            if firing:
                break
            time.sleep(0.5)
        assert firing, (f"{ALERT} not firing after 60 s ({source}); alerts: {seen}; "
                        f"prometheus log: {(tmp_path / 'prometheus.log').read_text()[-1500:]}")
        assert {a["labels"]["run"] for a in firing} == {bad_run}
        assert firing[0]["labels"]["severity"] == "critical"
        time.sleep(2)  # the stable run's series were scraped as long: give its rules the same chance to fire
        seen = httpx.get(f"{prom}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        stable_alerts = [a for a in seen if a["labels"].get("run") == good_run]
        if source == "synthetic":
            assert stable_alerts == []
        else:
            assert [a for a in stable_alerts if a["labels"]["severity"] == "critical"] == [], stable_alerts

        # the monitor's own alerts fired (they resolved when the run's last batch said it finished)
        params = [("state", "firing"), ("state", "resolved")]
        rest = c.get(f"/api/v1/runs/{bad_run}/alerts", params=params).json()
        fired = [a for a in rest["alerts"] if a["fired_step"] is not None]
        assert {a["severity"] for a in fired} & {"warning", "critical"}, rest
        stable_rest = c.get(f"/api/v1/runs/{good_run}/alerts", params=params).json()["alerts"]
        if source == "synthetic":
            assert stable_rest == []
        else:
            assert [a for a in stable_rest if a["severity"] == "critical"] == [], stable_rest
        target = httpx.get(f"{prom}/api/v1/targets", timeout=5).json()["data"]["activeTargets"][0]
        assert target["health"] == "up", target
