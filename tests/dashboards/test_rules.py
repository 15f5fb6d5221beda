"""dashboards/: the Prometheus config and alert rules pass promtool (syntax and unit tests), and every metric the
rules and the Grafana dashboard use is one a real monitor exports at /metrics."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.streams import FAKE_PREDICTOR, kurtosis_stream

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
RULES = DASHBOARDS / "rules" / "fp8mon.yml"
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus'; "
                                                              "scripts/test.sh installs it)")


def promtool(*args, cwd=None):
    out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


@needs_promtool
def test_rules_are_valid():
    assert "SUCCESS: 9 rules found" in promtool("check", "rules", str(RULES))


@needs_promtool
def test_rules_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "fp8mon_test.yml", cwd=DASHBOARDS / "rules")


@needs_promtool
def test_prometheus_config_is_valid_and_loads_the_rules(tmp_path):
    # promtool opens the read-token file, which docker compose provides: here, a copy of the config points at one
    config = (DASHBOARDS / "prometheus.yml").read_text()
    assert "credentials_file: /etc/prometheus/fp8mon-read-token" in config
    (tmp_path / "token").write_text("t")
    config = config.replace("/etc/prometheus/fp8mon-read-token", str(tmp_path / "token")).replace(
        '"rules/', f'"{DASHBOARDS}/rules/')
    (tmp_path / "prometheus.yml").write_text(config)
    out = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert "1 rule files found" in out and "rules/fp8mon.yml" in out


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (Debian package 'prometheus-alertmanager')")
def test_alertmanager_config_is_valid_and_routes_per_run_and_rule_with_a_warning_floor():
    out = subprocess.run([AMTOOL, "check-config", str(DASHBOARDS / "alertmanager.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())

    def receiver(**labels):
        args = [f"{k}={v}" for k, v in labels.items()]
        routed = subprocess.run([AMTOOL, "config", "routes", "test", f"--config.file={DASHBOARDS / 'alertmanager.yml'}",
                                 *args], capture_output=True, text=True, timeout=60)
        return routed.stdout.strip()

    assert {"alertname", "run", "rule"} <= set(config["route"]["group_by"])
    assert receiver(alertname="kurtosis_growth", rule="kurtosis_growth", run="r", severity="info") == "null"
    assert receiver(alertname="kurtosis_growth", rule="kurtosis_growth", run="r", severity="warning") == "default"


def test_compose_mounts_the_files_it_names():
    compose = yaml.safe_load((DASHBOARDS.parent / "docker-compose.yml").read_text())
    services = compose["services"]
    am = services["alertmanager"]
    assert "--config.file=/etc/fp8mon-dashboards/alertmanager.yml" in am["command"]
    assert "./dashboards:/etc/fp8mon-dashboards:ro" in am["volumes"]
    assert services["monitor"]["environment"]["FP8MON_ALERTMANAGER_URL"].endswith("http://alertmanager:9093}")
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    assert config["route"]["receiver"] in {r["name"] for r in config["receivers"]}
    provider = yaml.safe_load(compose["configs"]["grafana-dashboards"]["content"])
    path = provider["providers"][0]["options"]["path"]
    assert path == "/etc/fp8mon-dashboards/grafana" and (DASHBOARDS / "grafana" / "fp8mon.json").exists()


def used_metric_names() -> dict[str, set[str]]:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((DASHBOARDS / "grafana" / "fp8mon.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = {}
    for source, texts in (("rules", exprs), ("grafana", queries)):
        names[source] = {n for text in texts for n in re.findall(r"\b(fp8mon_[a-z0-9_]+)", text)}
    return names


@pytest.mark.sqlite_only
def test_every_metric_used_by_rules_and_grafana_is_exported(app_factory):
    used = used_metric_names()
    assert len(used["rules"]) >= 6 and len(used["grafana"]) >= 10
    with app_factory(predictor=FAKE_PREDICTOR) as c:
        for body in kurtosis_stream("run-1", range(0, 20), lambda s: 30.0 if s > 5 else 3.0):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        deadline = time.monotonic() + 20
        while True:
            text = c.get("/metrics").text
            exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
            if "fp8mon_run_steps_to_divergence" in exported or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    for source, names in used.items():
        assert names <= exported, f"{source} uses metrics /metrics does not export: {sorted(names - exported)}"
