"""Every common mistake with the `fp8mon` command ends in one clear line on stderr and a non-zero exit, no traceback;
`--debug` shows the traceback; `--help` and `--version` work in an install with the agent only. Each case runs the
command in a subprocess, as a user would."""

import http.server
import socket
import subprocess
import sys
import threading

import pytest

from fp8mon import __version__
from fp8mon.agent.spool import Spool

SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "pydantic", "pydantic_settings",
                   "prometheus_client")
# An agent-only install: importing any server package fails, as it would if it were not installed.
AGENT_ONLY = (f"import sys\nfor name in {SERVER_PACKAGES!r}: sys.modules[name] = None\n"
              "from fp8mon.cli import main\nsys.exit(main())")
REFUSED_PG = "postgresql+psycopg://postgres@127.0.0.1:1/nothing"  # port 1: nothing listens


def fp8mon(*args: str, agent_only: bool = False) -> subprocess.CompletedProcess:
    head = ["-c", AGENT_ONLY] if agent_only else ["-m", "fp8mon"]
    return subprocess.run([sys.executable, *head, *map(str, args)], capture_output=True, text=True, timeout=60)


def one_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    err = result.stderr.strip()
    assert result.returncode != 0, result.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def test_help_and_version_work_in_an_agent_only_install():
    helped = fp8mon("--help", agent_only=True)
    assert helped.returncode == 0 and "serve" in helped.stdout and "sync" in helped.stdout, helped.stderr
    assert fp8mon("serve", "--help", agent_only=True).returncode == 0
    version = fp8mon("--version", agent_only=True)
    assert version.returncode == 0 and version.stdout.strip() == f"fp8mon {__version__}"


def test_serve_in_an_agent_only_install_names_the_missing_extra(tmp_path):
    one_line(fp8mon("serve", "--database-url", f"sqlite:///{tmp_path / 'x.db'}", agent_only=True),
             "fp8mon serve: needs ", "pip install 'fp8mon[monitor]'")


@pytest.mark.parametrize("args, expected", [
    (("serve", "--database-url", "not a url"), "bad database URL"),
    (("db", "upgrade", "--database-url", "mysql://u@h/db"), "unsupported database URL"),
    (("db", "upgrade", "--database-url", REFUSED_PG), "cannot use the database: connection failed"),
    (("serve", "--database-url", REFUSED_PG), "Connection refused"),
])
def test_a_bad_or_unreachable_database_is_one_line(args, expected):
    command = " ".join(args[:2] if args[0] == "db" else args[:1])
    one_line(fp8mon(*args), f"fp8mon {command}: ", expected)


def test_an_unmigrated_database_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    one_line(fp8mon("serve", "--database-url", url), "has no fp8mon schema", "fp8mon db upgrade")


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = fp8mon("serve", "--migrate", "--port", port, "--database-url", f"sqlite:///{tmp_path / 'a.db'}")
    one_line(result, f"cannot listen on 127.0.0.1:{port}", "--port")


def test_sync_to_a_monitor_that_is_not_running_is_one_line(tmp_path):
    Spool(tmp_path / "spool").push("b1", b"not even a batch: never sent")
    result = fp8mon("sync", tmp_path / "spool", "--url", "http://127.0.0.1:1")
    one_line(result, "cannot reach the monitor at http://127.0.0.1:1", "1 batches left in place")
    assert len(list((tmp_path / "spool").glob("*.fp8b"))) == 1  # left for the next sync


def test_sync_to_a_wrong_address_is_one_line_and_sets_nothing_aside(tmp_path):
    """Another web server where the monitor was expected: every batch would get 404."""
    Spool(tmp_path / "spool").push("b1", b"not even a batch: never stored")
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFoundHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        result = fp8mon("sync", tmp_path / "spool", "--url", f"http://127.0.0.1:{other.server_port}")
    finally:
        other.shutdown()
    one_line(result, "404 from", "base address", "1 batches left in place")
    assert len(list((tmp_path / "spool").glob("*.fp8b"))) == 1 and not (tmp_path / "spool" / "rejected").exists()


class NotFoundHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the stdlib's name)
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_debug_shows_the_traceback():
    result = fp8mon("--debug", "db", "upgrade", "--database-url", "not a url")
    assert result.returncode != 0 and "Traceback" in result.stderr and "ArgumentError" in result.stderr
    after = fp8mon("db", "upgrade", "--debug", "--database-url", "not a url")
    assert "Traceback" in after.stderr
