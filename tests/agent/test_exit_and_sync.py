"""A run is never lost by how its process ends: an agent never closed flushes at exit and on SIGTERM, and `fp8mon sync`
delivers what a killed training left in its spool, once. Real training processes, real server, real CLI."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy", reason="the monitor extra: these tests read what a real server stored")

from tests.agent.child_runs import CHILD, stored_loss_steps  # noqa: E402


def start_child(url: str, spool: Path, steps: int, mode: str, run: str = "child-run") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), url, str(spool), str(steps), mode, run],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, want) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if want(lines[-1]):
            return lines
    raise AssertionError(f"child ended early: {proc.wait()} {proc.stderr.read()}")


def sync(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp8mon", "sync", *args], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.sqlite_only
def test_a_training_that_never_calls_close_still_delivers_at_exit(module_live_server, tmp_path):
    server = module_live_server  # shared: each test of it trains a run of its own name
    child = subprocess.run([sys.executable, str(CHILD), server.url, str(tmp_path / "spool"), "40", "no-close",
                            "no-close"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert stored_loss_steps(server.database_url, run="no-close") == list(range(40))
    assert not list((tmp_path / "spool").glob("*.fp8b"))


@pytest.mark.sqlite_only
@pytest.mark.parametrize("mode", ["forever", "own-handler"])
def test_sigterm_delivers_what_was_logged_and_keeps_the_programs_handling(module_live_server, tmp_path, mode):
    """Without a handler of its own the process ends as SIGTERM ends it; a program's own handler still runs (here it
    stops the loop and the process ends normally)."""
    proc = start_child(module_live_server.url, tmp_path / "spool", 0, mode, run=f"sigterm-{mode}")
    logged = read_until(proc, lambda line: int(line) >= 30)
    proc.send_signal(signal.SIGTERM)
    logged += [line.strip() for line in proc.stdout]
    assert proc.wait(timeout=30) == (-signal.SIGTERM if mode == "forever" else 0), proc.stderr.read()
    assert (logged[-1] == "stopped") == (mode == "own-handler")
    logged = [line for line in logged if line != "stopped"]
    stored = stored_loss_steps(module_live_server.database_url, run=f"sigterm-{mode}")
    assert stored == list(range(len(stored))) and len(stored) >= len(logged)  # every logged step, each once


@pytest.mark.sqlite_only
def test_an_exit_with_the_monitor_down_leaves_the_run_in_the_spool_for_sync(server_factory, tmp_path):
    server = server_factory()  # not started
    home = {**os.environ, "HOME": str(tmp_path)}
    spool = tmp_path / ".cache" / "fp8mon" / "spool" / "child-run"  # the default spool of the run
    child = subprocess.run([sys.executable, str(CHILD), server.url, str(spool), "20", "no-close"],
                           capture_output=True, text=True, timeout=60, env=home)
    assert child.returncode == 0 and "fp8mon sync replays them" in child.stderr, child.stderr
    assert list(spool.glob("*.fp8b"))
    server.start()
    done = sync("--url", server.url, env=home)  # every run under the default spool root
    assert done.returncode == 0, done.stderr
    assert stored_loss_steps(server.database_url) == list(range(20))
    assert not list(spool.glob("*.fp8b"))


def test_sync_replays_the_spool_of_a_killed_training_once(server_factory, tmp_path):
    server = server_factory()  # down while the training runs
    spool = tmp_path / "spool"
    proc = start_child(server.url, spool, 25, "spooled")
    read_until(proc, lambda line: line == "spooled")
    proc.kill()  # kill -9: no exit handler runs
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    left = sorted(spool.glob("*.fp8b"))
    assert left
    shutil.copytree(spool, tmp_path / "copy")

    failed = sync(str(spool), "--url", server.url)  # the monitor is still down
    assert failed.returncode == 1 and "ConnectError" in failed.stderr.splitlines()[-1]
    assert sorted(spool.glob("*.fp8b")) == left  # nothing lost by a failed sync

    server.start()
    done = sync(str(spool), "--url", server.url)
    assert done.returncode == 0, done.stderr
    assert f"{len(left)} batches delivered (0 of them already stored)" in done.stderr
    assert "batch/s" in done.stderr or "it/s" in done.stderr  # the progress bar
    assert not list(spool.glob("*.fp8b"))
    assert stored_loss_steps(server.database_url) == list(range(25))

    again = sync(str(tmp_path / "copy"), "--url", server.url)  # the same batches once more: stored once
    assert again.returncode == 0 and f"({len(left)} of them already stored)" in again.stderr
    assert stored_loss_steps(server.database_url) == list(range(25))


def test_sync_errors_are_one_line_and_fail(tmp_path, monkeypatch):
    monkeypatch.delenv("FP8MON_URL", raising=False)
    no_url = sync(str(tmp_path))
    assert no_url.returncode == 2 and no_url.stderr.strip() == "fp8mon sync: no monitor address: pass --url or set " \
                                                               "FP8MON_URL"
    bad_url = sync(str(tmp_path), "--url", "localhost:8080")
    assert bad_url.returncode == 1 and len(bad_url.stderr.splitlines()) == 1 and "http://" in bad_url.stderr
    missing = sync(str(tmp_path / "nope"), "--url", "http://127.0.0.1:1")
    assert missing.returncode == 1 and "is not a spool directory" in missing.stderr
    no_spool_yet = sync("--url", "http://127.0.0.1:1", env={**os.environ, "HOME": str(tmp_path / "nope")})
    assert no_spool_yet.returncode == 0 and "nothing to replay" in no_spool_yet.stderr
