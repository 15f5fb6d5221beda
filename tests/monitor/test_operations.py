"""What an operator relies on: `fp8mon serve` refuses unsafe set-ups (an open server beyond loopback, several
workers with predictors), logs carry a timestamp and a level and never a token, /readyz tells a database that is
not ready, /metrics has build and process metrics, SQLite fsyncs each acknowledged commit, and the deployment files
(docker-compose.yml, Dockerfile, LICENSE) are safe by default."""

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import yaml
from sqlalchemy import text

from fp8mon import cli
from fp8mon.monitor.localserver import ServerProcess
from fp8mon.monitor.logconfig import log_config
from fp8mon.monitor.storage.engine import create_db_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def uvicorn_calls(monkeypatch, tmp_path):
    """`fp8mon serve` in process, up to uvicorn.run (recorded, not run), on a migrated SQLite file."""
    import uvicorn

    from fp8mon.monitor.migrate import upgrade

    for name in ("FP8MON_HOST", "FP8MON_WORKERS", "FP8MON_PREDICTOR", "FP8MON_WRITE_TOKENS", "FP8MON_READ_TOKENS",
                 "FP8MON_ALLOW_OPEN"):
        monkeypatch.delenv(name, raising=False)
    url = f"sqlite:///{tmp_path / 'fp8mon.db'}"
    engine = create_db_engine(url)
    upgrade(engine)
    engine.dispose()
    calls: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setenv("FP8MON_DATABASE_URL", url)
    before = dict(os.environ)
    yield calls
    os.environ.clear()  # `fp8mon serve` exports its settings for uvicorn's workers: none may reach later tests
    os.environ.update(before)


def test_serving_beyond_loopback_without_tokens_needs_allow_open_and_warns(uvicorn_calls, capsys, monkeypatch):
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--allow-open" in err and "FP8MON_WRITE_TOKENS" in err and len(err.strip().splitlines()) == 1
    assert not uvicorn_calls
    assert cli.main(["serve", "--host", "0.0.0.0", "--allow-open"]) == 0
    assert "WARNING" in capsys.readouterr().err and uvicorn_calls[-1]["host"] == "0.0.0.0"
    monkeypatch.setenv("FP8MON_WRITE_TOKENS", '["w"]')
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 0  # tokens: no flag needed, no warning
    assert "WARNING" not in capsys.readouterr().err
    assert cli.main(["serve"]) == 0  # loopback: as before


def test_several_workers_are_refused_while_predictors_run(uvicorn_calls, capsys, monkeypatch):
    assert cli.main(["serve", "--workers", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "own predictors" in err and "FP8MON_PREDICTOR=''" in err
    assert not uvicorn_calls
    monkeypatch.setenv("FP8MON_PREDICTOR", "")
    assert cli.main(["serve", "--workers", "4"]) == 0
    assert uvicorn_calls[-1]["workers"] == 4


@pytest.mark.sqlite_only
def test_the_server_log_has_timestamps_and_levels_and_no_token(database_url, tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(database_url, log=log, quiet=False,
                           env={"FP8MON_READ_TOKENS": '["s3cret-read"]', "FP8MON_WRITE_TOKENS": '["s3cret-write"]'})
    server.start()
    try:
        # the dashboard URL the README recommends, and a token in an API query
        assert httpx.get(f"{server.url}/?token=s3cret-read", timeout=10).status_code == 200
        httpx.get(f"{server.url}/api/v1/runs?token=s3cret-write&limit=5", timeout=10)
    finally:
        server.stop()
    lines = log.read_text().splitlines()
    assert not [line for line in lines if "s3cret" in line]
    access = [line for line in lines if "GET /?token=" in line]
    assert access and "token=[redacted]" in access[0]
    assert any("/api/v1/runs?token=[redacted]&limit=5" in line for line in lines)
    stamped = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")
    assert all(stamped.match(line) for line in lines if line.strip()), lines[:5]


def test_json_log_lines(capsys):
    import logging.config

    logging.config.dictConfig(log_config("info", "json"))
    try:
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/?token=abc",
                                                 "1.1", 200)
        entry = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        for name in ("uvicorn", "uvicorn.access", "fp8mon"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
    assert entry["level"] == "INFO" and entry["logger"] == "uvicorn.access" and entry["time"].endswith("Z")
    assert "token=[redacted]" in entry["message"] and "abc" not in entry["message"]


@pytest.mark.sqlite_only
def test_readyz_says_whether_the_schema_is_current(app_factory, database_url):
    with app_factory() as client:
        assert client.get("/healthz").json() == {"ok": True}
        assert client.get("/readyz").json() == {"ready": True}
        engine = create_db_engine(database_url)
        with engine.begin() as conn:
            (current,) = conn.execute(text("select version_num from alembic_version")).one()
            conn.execute(text("update alembic_version set version_num = '0001'"))
        r = client.get("/readyz")
        assert r.status_code == 503 and "fp8mon db upgrade" in r.json()["reason"]
        with engine.begin() as conn:
            conn.execute(text("delete from alembic_version"))
        r = client.get("/readyz")
        assert r.status_code == 503 and "no fp8mon schema" in r.json()["reason"]
        assert client.get("/healthz").status_code == 200  # the process is still alive
        with engine.begin() as conn:
            conn.execute(text("insert into alembic_version values (:v)"), {"v": current})
        engine.dispose()
        assert client.get("/readyz").status_code == 200


@pytest.mark.sqlite_only
def test_metrics_export_build_info_and_process_metrics(client):
    from fp8mon import __version__

    body = client.get("/metrics").text
    (info,) = [line for line in body.splitlines() if line.startswith("fp8mon_build_info{")]
    assert f'version="{__version__}"' in info and 'python="3.' in info and info.endswith(" 1.0")
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert re.search(rf"^{name} \d", body, re.M), name


def test_sqlite_fsyncs_every_commit_unless_told_otherwise(tmp_path):
    for suffix, expected in (("", 2), ("?synchronous=normal", 1), ("?synchronous=FULL", 2)):  # 2 FULL, 1 NORMAL
        engine = create_db_engine(f"sqlite:///{tmp_path / 'x.db'}{suffix}")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("pragma synchronous").scalar() == expected, suffix
            assert conn.exec_driver_sql("pragma journal_mode").scalar() == "wal"
        engine.dispose()
    with pytest.raises(ValueError, match="full or normal"):
        create_db_engine(f"sqlite:///{tmp_path / 'x.db'}?synchronous=off")


def test_compose_publishes_on_loopback_and_needs_tokens_and_a_grafana_password():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    published = [(name, port) for name, service in compose["services"].items() for port in service.get("ports", [])]
    assert published
    for name, port in published:
        spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}:{port['target']}"
        host_ip = spec.rsplit(":", 2)[0] if spec.count(":") >= 2 else ""
        assert host_ip == "${FP8MON_BIND:-127.0.0.1}", f"{name} publishes {spec} on every interface"
    monitor_env = compose["services"]["monitor"]["environment"]
    grafana_env = compose["services"]["grafana"]["environment"]
    for value in (monitor_env["FP8MON_WRITE_TOKENS"], monitor_env["FP8MON_READ_TOKENS"],
                  grafana_env["GF_SECURITY_ADMIN_PASSWORD"]):
        assert re.search(r"\$\{[A-Z0-9_]+:\?[^}]+\}", value), f"{value!r} does not refuse to start when unset"
    assert "0.0.0.0" not in json.dumps(compose["services"]["monitor"].get("ports", []))


def test_the_image_installs_pinned_dependencies_and_the_license_is_there():
    dockerfile = (ROOT / "Dockerfile").read_text()
    lock = ROOT / "requirements" / "monitor.lock"
    assert f"COPY {lock.relative_to(ROOT).as_posix()}" in dockerfile and "-c requirements/monitor.lock" in dockerfile
    pins = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", pin) for pin in pins), pins[:3]
    names = {pin.split("==")[0].lower().replace("_", "-") for pin in pins}
    assert {"fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "prometheus-client"} <= names
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()

