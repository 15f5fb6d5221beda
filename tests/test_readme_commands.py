"""The README's two commands, the scripts behind them, .ci/run, and the docker-compose stack's files.

The scripts' setup is exercised for real by running them (CI runs .ci/run on a clean clone); here they are
checked for syntax and for the exit-status rules of scripts/test.sh, on the already installed venv.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def readme_commands() -> list[str]:
    """The command lines of the README's first code block, which must open the README after its title."""
    body = README.split("\n", 1)[1].lstrip("\n") if README.startswith("# ") else README
    match = re.match(r"```(?:bash|sh|console)?\n(.*?)\n```", body, re.S)
    assert match, "README.md must begin (after its title) with a code block of commands"
    return [line.split(" #")[0].strip() for line in match.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_begins_with_exactly_the_demo_and_test_commands():
    assert readme_commands() == ["./scripts/demo.sh", "./scripts/test.sh"]


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/test.sh", ".ci/run"])
def test_scripts_are_executable_bash(script):
    path = ROOT / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(path)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "lib.sh")], check=True)


def test_ci_runs_the_test_command_on_postgresql():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "postgresql+psycopg://postgres@127.0.0.1:5432/test" in ci and "export FP8MON_TEST_DATABASE_URL" in ci
    commands = [line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "set ", "export "))]
    assert len(commands) == 1 and "scripts/test.sh" in commands[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("body,rc,message", [
    ("def test_ok():\n    pass\n", 0, None),
    ("def test_bad():\n    assert False\n", 1, None),
    ("import pytest\n\ndef test_skipped():\n    pytest.skip('no')\n", 1, "no test ran"),
    ("", 1, "collected no tests"),
])
def test_test_script_fails_when_tests_fail_or_none_ran(tmp_path, body, rc, message):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(body)
    env = {**os.environ, "FP8MON_NO_SETUP": "1", "FP8MON_VENV": sys.prefix}
    env.pop("FP8MON_TEST_DATABASE_URL", None)
    # the exit status is the script's own logic, whatever the workers: the failing cases run in one process, the
    # passing one on the script's workers, as CI runs it
    if rc:
        env["FP8MON_TEST_WORKERS"] = "0"
    else:
        env.pop("FP8MON_TEST_WORKERS", None)
    out = subprocess.run([str(ROOT / "scripts" / "test.sh"), "-p", "no:cacheprovider", str(test_file)],
                         capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == rc, out.stdout + out.stderr
    if message:
        assert message in out.stderr


# -- docker compose -------------------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_the_whole_stack():
    services = compose()["services"]
    assert set(services) >= {"monitor", "postgres", "prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        assert "image" in service or "build" in service, name


def test_compose_monitor_migrates_then_serves_on_postgres():
    spec = compose()
    monitor, postgres = spec["services"]["monitor"], spec["services"]["postgres"]
    build = monitor["build"]
    dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file()
    command = " ".join(monitor["command"]) if isinstance(monitor["command"], list) else monitor["command"]
    assert re.search(r"fp8mon db upgrade\s*&&\s*exec fp8mon serve .*--host 0\.0\.0\.0", command), command
    url = urlsplit(monitor["environment"]["FP8MON_DATABASE_URL"])
    env = postgres["environment"]
    assert url.scheme == "postgresql+psycopg" and url.hostname == "postgres"
    assert (url.username, url.password, url.path.lstrip("/")) == (
        env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"])
    assert monitor["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "${FP8MON_BIND:-127.0.0.1}:8080:8080" in monitor["ports"]


def test_compose_files_exist_and_prometheus_scrapes_the_monitor():
    spec = compose()
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source}"
        for config in service.get("configs", []):
            assert config["source"] in spec["configs"], f"{name}: {config['source']}"
    for config in spec.get("configs", {}).values():
        yaml.safe_load(config["content"])
    prometheus = spec["services"]["prometheus"]
    config_flag = next(arg for arg in prometheus["command"] if arg.startswith("--config.file="))
    mount = next(v for v in prometheus["volumes"] if v.startswith("./dashboards:"))
    container_dir = mount.split(":")[1]
    config_file = ROOT / "dashboards" / Path(config_flag.split("=", 1)[1]).relative_to(container_dir)
    prom = yaml.safe_load(config_file.read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    job = jobs["fp8mon"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert "monitor:8080" in job["static_configs"][0]["targets"]
    targets = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["alertmanager:9093"]


def test_dockerfile_installs_the_monitor_without_torch():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.M)
    assert 'pip install -c requirements/monitor.lock ".[monitor]"' in dockerfile and "torch" not in dockerfile.split("pip install", 1)[1].split("\n")[0]
    for path in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / path).exists(), path


def _has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="docker compose (v2) is not installed")
def test_docker_compose_accepts_the_file():
    subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], check=True)
