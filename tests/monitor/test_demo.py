"""`fp8mon demo` end to end: a real server process fed the synthetic run over HTTP, then the database."""

import math
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import text

from agent.wire import SITES, TENSOR_STATS
from monitor.demo import DemoConfig, SyntheticRun
from monitor.schemas import IngestBatch
from monitor.store import Store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_demo(database_url: str, cwd, *args: str) -> subprocess.CompletedProcess:
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "demo", "--database-url", database_url, "--port", str(port),
         "--exit-after-feed", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert f"http://127.0.0.1:{port}/docs" in out.stdout
    assert f"http://127.0.0.1:{port}/api/v1/ingest" in out.stdout
    return out


def query(url: str, sql: str, **params):
    store = Store(url)
    try:
        with store.engine.connect() as conn:
            return conn.execute(text(sql), params).all()
    finally:
        store.close()


def test_demo_feeds_a_diverging_run_through_the_api(database_url, tmp_path):
    out = run_demo(database_url, tmp_path, "--run", "demo-test")
    assert "fed 30 batches (0 already stored): 48000 tensor records, 1200 scalar records" in out.stdout

    [(run_id, status, config)] = query(database_url, "select id, status, config from runs where name = 'demo-test'")
    assert status == "diverged"
    assert query(database_url, "select count(*) from tensor_stats")[0][0] == 300 * 32 * len(SITES)
    assert query(database_url, "select count(*) from scalars")[0][0] == 300 * 4
    assert query(database_url, "select count(*) from ingest_batches where run_id = :r", r=run_id)[0][0] == 30
    assert query(database_url, "select count(distinct layer), count(distinct site) from tensor_series")[0] == (32, 5)

    # The story: the culprit's kurtosis creeps up by orders of magnitude, the loss ends non-finite.
    kurt = [float(k) for (k,) in query(database_url, """
        select t.kurtosis from tensor_stats t join tensor_series s on s.id = t.series_id
        where s.layer = 'blocks.5.mlp.fc2' and s.site = 'input' order by t.step""")]
    assert kurt[0] < 20 and kurt[-2] > 50 * kurt[0] and math.isnan(kurt[-1])
    loss = [float(v) for (v,) in query(database_url, """
        select v.value from scalars v join scalar_series s on s.id = v.series_id
        where s.name = 'loss' order by v.step""")]
    assert loss[0] > 8 and min(loss[:-1]) < 3.5 and math.isnan(loss[-1])

    # Run again under the same name: the same batch ids, recognised as already stored.
    again = run_demo(database_url, tmp_path, "--run", "demo-test")
    assert "fed 30 batches (30 already stored)" in again.stdout
    assert query(database_url, "select count(*) from tensor_stats")[0][0] == 300 * 32 * len(SITES)


def test_demo_serves_until_interrupted_and_its_links_work(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "monitor.cli", "demo", "--database-url", f"sqlite:///{tmp_path / 'd.db'}",
         "--port", str(port), "--steps", "40", "--blocks", "2", "--run", "team/demo-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, stdin=subprocess.DEVNULL)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving until Ctrl-C" in line:
                break
        output = "".join(lines)
        assert "serving until Ctrl-C" in output, output
        urls = re.findall(rf"(http://127\.0\.0\.1:{port}/\S*)", output.split("the story:", 1)[1])
        gets = [u for u in urls if not u.endswith("/api/v1/ingest")]
        assert f"http://127.0.0.1:{port}/docs" in gets and len(gets) >= 1
        for url in gets:
            assert httpx.get(url, timeout=10).status_code == 200, url
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_demo_batches_follow_the_wire_format():
    run = SyntheticRun(DemoConfig(run="unit", steps=40, blocks=2, steps_per_batch=7))
    batches = list(run.batches())
    assert [b["batch_id"] for b in batches][:2] == ["steps-0000000-0000006", "steps-0000007-0000013"]
    assert len({b["batch_id"] for b in batches}) == len(batches) == 6
    for batch in batches:
        parsed = IngestBatch.model_validate(batch)
        assert set(parsed.tensors.stats) == set(TENSOR_STATS)
    assert batches[0]["run_meta"]["config"]["synthetic"] is True
    assert batches[-1]["run_meta"]["status"] == "diverged"


def test_demo_refuses_a_busy_port_it_was_asked_for(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "monitor.cli", "demo", "--database-url",
                              f"sqlite:///{tmp_path / 'd.db'}", "--port", str(port), "--exit-after-feed"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "cannot listen" in out.stderr


@pytest.mark.parametrize("flag", [["--steps", "5"], ["--blocks", "0"]])
def test_demo_rejects_bad_sizes(tmp_path, flag):
    out = subprocess.run([sys.executable, "-m", "monitor.cli", "demo", "--database-url",
                          f"sqlite:///{tmp_path / 'd.db'}", "--port", "0", "--exit-after-feed", *flag],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr
