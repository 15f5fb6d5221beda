"""`fp8mon demo` end to end: a real server process and a real (very small) FP8 training with the agent
attached, posting over HTTP; then the database and the printed links."""

import json
import math
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
from sqlalchemy import text

from fp8mon.agent.wire import SITES
from fp8mon.monitor.localserver import free_port
from fp8mon.monitor.storage import SqlAlchemyStore as Store

# A smaller model than the demo's default, so the test trains in seconds on two cores.
SMALL = ["--", "--n-layer", "2", "--d-model", "64", "--n-head", "2", "--d-ff", "128", "--seq-len", "32",
         "--batch-size", "2", "--threads", "1"]



def demo(database_url: str, cwd, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fp8mon", "demo", "--database-url", database_url, *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)


def query(url: str, sql: str, **params):
    store = Store(url)
    try:
        with store.engine.connect() as conn:
            return conn.execute(text(sql), params).all()
    finally:
        store.close()


def test_demo_trains_in_fp8_and_streams_the_statistics_through_the_api(database_url, tmp_path):
    port = free_port()
    out = demo(database_url, tmp_path, "--port", str(port), "--run", "demo-test", "--steps", "6", "--device", "cpu",
               "--exit-after-train", *SMALL)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "training llama fp8 tiny for 6 steps as run 'demo-test'" in out.stdout
    assert f"http://127.0.0.1:{port}/docs" in out.stdout
    assert f"http://127.0.0.1:{port}/api/v1/runs/demo-test" in out.stdout

    [(run_id, status, config)] = query(database_url, "select id, status, config from runs where name = 'demo-test'")
    assert status == "finished"
    config = json.loads(config) if isinstance(config, str) else config  # SQLite hands JSON back as text
    assert config["train"]["precision"] == "fp8" and config["model"]["n_layer"] == 2
    layers = 2 * 4  # qkv, attention out, MLP in, MLP out per block
    assert query(database_url, "select count(distinct layer), count(distinct site) from tensor_series")[0] == (
        layers, len(SITES))
    # --monitor-every 5 over steps 0..5: statistics at steps 0 and 5, every layer and site
    assert query(database_url, "select distinct step from tensor_stats order by step") == [(0,), (5,)]
    assert query(database_url, "select count(*) from tensor_stats")[0][0] == 2 * layers * len(SITES)
    loss = [float(v) for (v,) in query(database_url, """
        select v.value from scalars v join scalar_series s on s.id = v.series_id
        where s.name = 'loss' order by v.step""")]
    assert len(loss) == 6 and all(math.isfinite(v) for v in loss)
    assert abs(loss[0] - math.log(256)) < 1.0  # a fresh byte-level model starts near ln(vocab)
    # a real FP8 cast was observed: weights in E4M3 report their scale, with nothing overflowing
    scale, overflow = query(database_url, """
        select t.scale, t.overflow_frac from tensor_stats t join tensor_series s on s.id = t.series_id
        where s.layer = 'blocks.0.attn.qkv' and s.site = 'weight' and t.step = 0""")[0]
    assert float(scale) > 1 and float(overflow) == 0


def test_demo_serves_until_interrupted_and_its_links_work(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8mon", "demo", "--database-url", f"sqlite:///{tmp_path / 'd.db'}",
         "--port", str(port), "--steps", "2", "--device", "cpu", "--run", "team/demo-1", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, stdin=subprocess.DEVNULL)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving until Ctrl-C" in line:
                break
        output = "".join(lines)
        assert "serving until Ctrl-C" in output, output
        urls = re.findall(rf"(http://127\.0\.0\.1:{port}/\S*)", output.split("stored,", 1)[1])
        gets = [u for u in urls if not u.endswith("/api/v1/ingest")]
        assert f"http://127.0.0.1:{port}/docs" in gets
        assert f"http://127.0.0.1:{port}/api/v1/runs/team/demo-1" in gets
        assert f"http://127.0.0.1:{port}/?run=team%2Fdemo-1" in gets  # the dashboard, opened on the run
        for url in gets:
            assert httpx.get(url, timeout=10).status_code == 200, url
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def refused(capsys, monkeypatch, tmp_path, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `fp8mon demo` in this process: the refusals come before anything starts, so
    they need no process of their own."""
    from fp8mon.cli import main as fp8mon

    monkeypatch.chdir(tmp_path)
    code = fp8mon(["demo", "--database-url", f"sqlite:///{tmp_path / 'd.db'}", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_refuses_a_busy_port_it_was_asked_for(capsys, monkeypatch, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, _, err = refused(capsys, monkeypatch, tmp_path, "--port", str(port), "--exit-after-train")
    assert code == 2 and "cannot listen" in err


def test_demo_rejects_bad_trainer_flags_before_starting(capsys, monkeypatch, tmp_path):
    code, out, err = refused(capsys, monkeypatch, tmp_path, "--port", "0", "--exit-after-train",
                             "--", "--arch", "transformerXL")
    assert code == 2 and "transformerXL" in err
    assert "listening" not in out
    code, _, err = refused(capsys, monkeypatch, tmp_path, "--port", "0", "--steps", "0")
    assert code == 2 and "--steps" in err
