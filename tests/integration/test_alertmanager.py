"""fp8mon's alerts in a real Alertmanager (Debian's prometheus-alertmanager, with amtool) running the route that
docker-compose ships (dashboards/alertmanager.yml, its waits shortened to a second and a webhook receiver added):
the alerts arrive with their labels and dashboard link, one group per run and rule, info alerts notify nobody,
a critical alert holds back its run and rule's warnings, a silence by rule silences, a finished or deleted
run's alerts resolve, an Alertmanager that is down costs ingest nothing and hears everything once it is back, and
a restarted server announces its firing alerts again.
"""

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from fp8mon.monitor.localserver import free_port
from tests.integration.ready import wait_ready
from tests.integration.receiver import Receiver
from tests.integration.streams import LAYER_PREDICTOR, layer_stream

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
AMTOOL = shutil.which("amtool")
CONFIG = Path(__file__).resolve().parents[2] / "dashboards" / "alertmanager.yml"
PUBLIC = "http://fp8mon.test:8080"

pytestmark = [pytest.mark.skipif(ALERTMANAGER is None or AMTOOL is None,
                                 reason="Alertmanager not installed (Debian package 'prometheus-alertmanager'; "
                                        "scripts/test.sh installs it)")]


class Alertmanager:
    def __init__(self, directory: Path, receiver_url: str, port: int | None = None):
        config = yaml.safe_load(CONFIG.read_text())
        config["route"].update(group_wait="1s", group_interval="1s")
        for receiver in config["receivers"]:
            if receiver["name"] == "default":
                receiver["webhook_configs"] = [{"url": receiver_url, "send_resolved": True}]
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.directory = directory
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "Alertmanager":
        log = open(self.directory / "alertmanager.log", "ab")
        self.proc = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={self.directory / 'alertmanager.yml'}",
             f"--storage.path={self.directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address="], stdout=log, stderr=subprocess.STDOUT)
        wait_ready(self.proc, self.url, self.directory / "alertmanager.log", "alertmanager", timeout=20, poll=0.1)
        return self

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def amtool(self, *args) -> str:
        out = subprocess.run([AMTOOL, f"--alertmanager.url={self.url}", *args], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def alerts(self, run: str) -> list[dict]:
        return json.loads(self.amtool("alert", "query", "--active", "--silenced", "--inhibited", "-o", "json",
                                      f"run={run}"))

    def wait(self, what, predicate, timeout=15.0):
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not met in {timeout} s: {value}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory, receiver):
    am = Alertmanager(tmp_path_factory.mktemp("alertmanager"), receiver.url).start()
    yield am
    am.stop()


def kurtosis(step, layer, site):
    """From step 10: block 0 at warning, block 1 critical (the alerts fire at step 15)."""
    if step < 10:
        return 3.0
    return 80.0 if layer.startswith("blocks.1") else 30.0


def underflow(step, layer, site):
    return 0.2 if (layer, site) == ("blocks.0.mlp.fc1", "weight") else 0.0  # one info alert


@pytest.mark.sqlite_only
def test_alerts_arrive_grouped_per_run_and_rule_silenced_by_rule_and_resolved(app_factory, alertmanager, receiver):
    with app_factory(alertmanager_url=alertmanager.url, alertmanager_resend_seconds=1, public_url=PUBLIC,
                     predictor=LAYER_PREDICTOR) as c:
        for run in ("am/paging", "am/quiet"):
            for body in layer_stream(run, range(0, 30), kurtosis if run == "am/paging" else
                                     lambda s, la, si: 30.0 if s >= 10 else 3.0, underflow):
                assert c.post("/api/v1/ingest", json=body).status_code == 200
        paging = alertmanager.wait(lambda: alertmanager.alerts("am/paging"), lambda a: len(a) == 13)
        kurt = [a for a in paging if a["labels"]["rule"] == "kurtosis_growth"]
        assert {a["labels"]["layer"] for a in kurt} == {"blocks.0.attn.qkv", "blocks.0.mlp.fc1",
                                                        "blocks.1.attn.qkv", "blocks.1.mlp.fc1"}
        a = next(a for a in kurt if a["labels"]["layer"] == "blocks.1.mlp.fc1" and a["labels"]["site"] == "weight")
        assert a["labels"] == {"alertname": "kurtosis_growth", "run": "am/paging", "rule": "kurtosis_growth",
                               "severity": "critical", "layer": "blocks.1.mlp.fc1", "site": "weight"}
        assert a["annotations"]["dashboard"] == f"{PUBLIC}/?run=am%2Fpaging"
        assert "kurtosis 80.0 at blocks.1.mlp.fc1/weight" in a["annotations"]["description"]
        assert "critical kurtosis_growth on run am/paging" in a["annotations"]["summary"]
        # a critical alert holds back the warnings of its run and rule (not those of another run)
        for alert in kurt:
            inhibited = bool(alert["status"]["inhibitedBy"])
            assert inhibited == (alert["labels"]["severity"] == "warning"), alert
        quiet = alertmanager.wait(lambda: alertmanager.alerts("am/quiet"), lambda a: len(a) == 13)
        assert all(not a["status"]["inhibitedBy"] for a in quiet)

        # one group per run and rule, whatever the layers and sites
        groups = httpx.get(f"{alertmanager.url}/api/v2/alerts/groups", timeout=5).json()
        by_labels = {(g["labels"]["run"], g["labels"]["rule"]): g for g in groups
                     if g["labels"].get("run", "").startswith("am/")}
        assert set(by_labels) == {(run, rule) for run in ("am/paging", "am/quiet")
                                  for rule in ("kurtosis_growth", "underflow")}
        assert len(by_labels["am/paging", "kurtosis_growth"]["alerts"]) == 12
        assert by_labels["am/paging", "underflow"]["receiver"]["name"] == "null"  # the severity floor

        # the webhook receiver hears one notification per group, and nothing of the info alerts
        receiver.wait_for(lambda p: p["groupLabels"].get("run") == "am/quiet" and p["status"] == "firing")
        notified = [p for p in receiver.received if p["groupLabels"].get("run", "").startswith("am/")]
        assert {p["groupLabels"]["rule"] for p in notified} == {"kurtosis_growth"}
        firing = next(p for p in notified if p["groupLabels"]["run"] == "am/quiet")
        assert len(firing["alerts"]) == 12
        paging_note = next(p for p in notified if p["groupLabels"]["run"] == "am/paging")
        assert [a["labels"]["severity"] for a in paging_note["alerts"]] == ["critical"] * 6  # warnings held back

        # a silence by rule (and run) silences every layer and site of it
        silence = alertmanager.amtool("silence", "add", "rule=kurtosis_growth", "run=am/quiet", "--duration=1h",
                                      "--author=test", "--comment=known noisy run").strip()
        quiet = alertmanager.wait(lambda: alertmanager.alerts("am/quiet"),
                                  lambda a: sum(x["status"]["silencedBy"] == [silence] for x in a) == 12)
        assert [x["labels"]["rule"] for x in quiet if not x["status"]["silencedBy"]] == ["underflow"]
        assert json.loads(alertmanager.amtool("alert", "query", "-o", "json", "rule=kurtosis_growth",
                                              "run=am/quiet")) == []  # no longer active

        # the run finishes: its alerts resolve in Alertmanager, and the receiver hears it
        assert c.patch("/api/v1/runs/am/paging", json={"status": "finished"}).status_code == 200
        alertmanager.wait(lambda: alertmanager.alerts("am/paging"), lambda a: a == [])
        resolved = receiver.wait_for(lambda p: p["groupLabels"].get("run") == "am/paging"
                                     and p["status"] == "resolved")
        assert {a["status"] for a in resolved[0]["alerts"]} == {"resolved"}
        assert len(alertmanager.alerts("am/quiet")) == 13  # the other run's alerts still fire (re-sent)
        # a deleted run's alerts resolve too (they are no longer re-sent)
        assert c.delete("/api/v1/runs/am/quiet").status_code == 200
        alertmanager.wait(lambda: alertmanager.alerts("am/quiet"), lambda a: a == [])


def test_an_escalation_replaces_the_lower_severity_in_alertmanager(alertmanager):
    from fp8mon.monitor.alerting.alertmanager import AlertmanagerSender
    from fp8mon.monitor.alerting.lifecycle import AlertTracker
    from fp8mon.monitor.assessment import Finding

    def finding(severity):
        return Finding(rule="stale_scale", severity=severity, step=0, layer="blocks.0.mlp.fc2", site="grad_output",
                       message=f"stale scale ({severity})")

    tracker = AlertTracker()
    sender = AlertmanagerSender(alertmanager.url, base_url=PUBLIC, resend_seconds=1).start()
    try:
        sender.notify(tracker.update("am/escalating", 80, [finding("warning")])[0])
        alertmanager.wait(lambda: alertmanager.alerts("am/escalating"),
                          lambda a: [x["labels"]["severity"] for x in a] == ["warning"])
        sender.notify(tracker.update("am/escalating", 300, [finding("critical")])[0])
        (alert,) = alertmanager.wait(lambda: alertmanager.alerts("am/escalating"),
                                     lambda a: [x["labels"]["severity"] for x in a] == ["critical"])
        assert "fired at step 80; critical at step 300" in alert["annotations"]["description"]
        # re-sent every second with endsAt four re-sends ahead: Alertmanager never times it out while we live
        alertmanager.wait(lambda: alertmanager.alerts("am/escalating"),
                          lambda a: len(a) == 1 and a[0]["endsAt"] > alert["endsAt"], timeout=5)
    finally:
        sender.stop()


@pytest.mark.sqlite_only
def test_alertmanager_down_costs_ingest_nothing_and_hears_everything_once_back(app_factory, tmp_path, receiver,
                                                                               caplog):
    caplog.set_level(logging.INFO, logger="fp8mon.alertmanager")
    am = Alertmanager(tmp_path / "late", receiver.url)  # its port is chosen, nothing listens there yet
    try:
        with app_factory(alertmanager_url=am.url, alertmanager_resend_seconds=0.5, predictor=LAYER_PREDICTOR) as c:
            latencies = []
            for body in layer_stream("am/late", range(0, 30), kurtosis):
                t0 = time.monotonic()
                assert c.post("/api/v1/ingest", json=body).status_code == 200
                latencies.append(time.monotonic() - t0)
            assert c.app.state.pipeline.flush(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                failures = float(next(line.split()[-1] for line in c.get("/metrics").text.splitlines()
                                      if line.startswith("fp8mon_alertmanager_failures_total")))
                if failures >= 2:
                    break
                time.sleep(0.2)
            assert failures >= 2  # counted at every try
            am.start()
            alerts = am.wait(lambda: am.alerts("am/late"), lambda a: len(a) == 12)
            assert {a["labels"]["severity"] for a in alerts} == {"warning", "critical"}
        assert max(latencies) < 1.0, latencies
        outage = [r for r in caplog.records if r.name == "fp8mon.alertmanager"]
        assert [r.levelname for r in outage] == ["WARNING", "INFO"]  # logged once, and once more when back
        assert "cannot post alerts to Alertmanager" in outage[0].getMessage()
    finally:
        am.stop()


@pytest.mark.sqlite_only
def test_a_restarted_server_announces_its_firing_alerts_again(app_factory, alertmanager):
    settings = dict(alertmanager_url=alertmanager.url, alertmanager_resend_seconds=0.5, predictor=LAYER_PREDICTOR)
    with app_factory(**settings) as c:
        for body in layer_stream("am/restart", range(0, 20), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        alertmanager.wait(lambda: alertmanager.alerts("am/restart"), lambda a: len(a) == 12)
    # the server is gone: no more re-sends, Alertmanager lets the alerts expire (endsAt, 2 s ahead)
    alertmanager.wait(lambda: alertmanager.alerts("am/restart"), lambda a: a == [], timeout=10)
    with app_factory(**settings):  # back, with nothing ingested: the firing alerts come from the database
        alertmanager.wait(lambda: alertmanager.alerts("am/restart"), lambda a: len(a) == 12)
