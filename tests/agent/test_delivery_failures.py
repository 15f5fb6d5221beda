"""Delivery failures a user must fix are loud, counted and never lose a batch; a spool that cannot be written degrades
to memory; replay is linear in the spool's length. Real server (uvicorn on 127.0.0.1), real agent."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from fp8mon import Agent
from fp8mon.agent.spool import Spool
from fp8mon.agent.transport import Transport

pytest.importorskip("sqlalchemy", reason="the monitor extra: these tests read what a real server stored")

from tests.agent.child_runs import CHILD, stored_loss_steps  # noqa: E402

pytestmark = pytest.mark.sqlite_only  # the agent's side of delivery: the storage is not the subject


def train(agent: Agent, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    agent.watch(model)
    for step in range(steps):
        loss = model(torch.randn(2, 8)).pow(2).mean()
        loss.backward()
        agent.log(step, loss=loss)


def fp8mon_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fp8mon.agent" and r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def token_server(module_live_server, tmp_path_factory):
    """A second server on the module's database that takes only the write token w-secret (r-secret reads)."""
    from fp8mon.monitor.localserver import ServerProcess

    server = ServerProcess(module_live_server.database_url,
                           env={"FP8MON_WRITE_TOKENS": '["w-secret"]', "FP8MON_READ_TOKENS": '["r-secret"]'},
                           log=tmp_path_factory.mktemp("token-server") / "server.log").start()
    yield server
    server.stop()


def test_a_url_without_scheme_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"needs a scheme and a host, e\.g\. http://"):
        Agent("127.0.0.1:8080", run="r", spool_dir=tmp_path)


@pytest.mark.parametrize("token, code, hint", [(None, 401, "FP8MON_TOKEN"), ("wrong", 403, "FP8MON_TOKEN"),
                                               ("r-secret", 403, "write token")])
def test_a_refused_token_is_loud_counted_and_keeps_the_batches(token_server, tmp_path, caplog, token, code, hint):
    server = token_server  # shared by the three cases: it stores nothing it refuses
    agent = Agent(server.url, run="tok", token=token, spool_dir=tmp_path / "spool", flush_interval=0.05,
                  backoff=(0.05, 0.1))
    train(agent, 10)
    assert not agent.flush(timeout=10)
    status = agent.status()
    assert status.state == "refused" and status.pending >= 1 and status.delivered == 0
    assert agent.errors >= 1 and f"{code} from {server.url}/api/v1/ingest" in agent.last_error
    errors = fp8mon_errors(caplog)
    assert len(errors) == 1 and hint in errors[0]  # once, saying what to fix; no "unreachable"
    assert not any("unreachable" in r.getMessage() for r in caplog.records)
    assert not agent.close(timeout=5)  # the truth
    assert agent.status().pending >= 1  # still on disk for `fp8mon sync --token`
    assert stored_loss_steps(server.database_url, run="tok") == []


def test_a_wrong_path_sets_every_batch_aside_and_close_says_so(module_live_server, tmp_path, caplog):
    agent = Agent(module_live_server.url + "/monitor", run="path", spool_dir=tmp_path / "spool", flush_interval=0.05)
    train(agent, 5)
    assert agent.flush(timeout=10)  # nothing waits: refused batches do not hold the others back
    train(agent, 3)
    assert not agent.close(timeout=10)
    status = agent.status()
    assert status.set_aside >= 2 and status.pending == 0 and status.delivered == 0
    rejected = tmp_path / "spool" / "rejected"
    batches = sorted(rejected.glob("*.fp8b"))
    assert len(batches) == status.set_aside
    assert all("404 from" in b.with_suffix(".reason").read_text() for b in batches)
    assert agent.errors >= status.set_aside
    errors = fp8mon_errors(caplog)
    assert len(errors) == 2 and "base address" in errors[0]  # once, saying what to fix
    assert "not fully delivered" in errors[1] and "2 set aside" in errors[1].replace(str(status.set_aside), "2")


def test_an_unwritable_spool_directory_degrades_to_memory_and_delivers(module_live_server, tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    agent = Agent(module_live_server.url, run="ro", spool_dir=tmp_path / "a-file" / "spool", flush_interval=0.05)
    assert agent.status().state == "degraded"
    train(agent, 30)
    assert agent.close(timeout=20)
    assert stored_loss_steps(module_live_server.database_url, run="ro") == list(range(30))
    assert agent.errors == 1 and len(fp8mon_errors(caplog)) == 1  # one clear error, no flood
    assert "cannot be written" in fp8mon_errors(caplog)[0]


def test_a_bounded_memory_queue_says_what_it_lost(server_factory, tmp_path, caplog):
    server = server_factory()  # never started
    (tmp_path / "a-file").write_text("")
    transport = Transport(server.url, "lost", spool_dir=tmp_path / "a-file" / "spool", max_spool_bytes=1000,
                          flush_interval=0.01, backoff=(5.0, 5.0))
    for step in range(200):
        transport.send_scalars({"step": step, "name": ["loss"], "value": [float(step)]})
        if step % 20 == 0:
            transport.flush(timeout=5)
    assert not transport.close(timeout=5)
    status = transport.status()
    assert status.lost == 11 and status.pending == 0 and status.in_memory == 0  # 11 batches, all lost
    assert f"{status.lost} lost" in fp8mon_errors(caplog)[-1]


def test_a_full_spool_disk_mid_run_neither_stalls_nor_loses_the_run(module_live_server, tmp_path):
    server = module_live_server
    child = subprocess.run([sys.executable, str(CHILD), server.url, str(tmp_path / "spool"), "60", "full-disk",
                            "full-disk"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    status = json.loads(child.stdout.splitlines()[-1])
    assert status["closed"] and status["lost"] == 0 and status["in_memory"] == 0, status
    assert stored_loss_steps(server.database_url, run="full-disk") == list(range(60))
    assert child.stderr.count("cannot be written") == 1 and "Traceback" not in child.stderr, child.stderr


class _Listings:
    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("listdir", "scandir"):
            real = getattr(os, name)

            def counted(*args, _real=real, **kwargs):
                self.count += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(os, name, counted)


def test_replaying_a_long_spool_lists_its_directory_once(tmp_path, monkeypatch):
    """Linear replay: the directory is listed when the spool opens, never per batch (it was listed and sorted once
    per batch: 12,000 batches replayed at 21 per second)."""
    (tmp_path / "spool").mkdir()
    for i in range(3000):  # what a long outage leaves behind
        (tmp_path / "spool" / f"{i:016d}-{i:032x}.fp8b").write_bytes(b"x" * 16)
    listings = _Listings(monkeypatch)
    spool = Spool(tmp_path / "spool")  # a later process
    assert len(spool) == 3000 and listings.count == 1
    replayed = []
    while (head := spool.peek()) is not None:
        replayed.append(head[0].batch_id)
        spool.remove(head[0])
        len(spool)
    assert replayed == [f"{i:032x}" for i in range(3000)]
    assert listings.count == 1
    assert not any(p.suffix == ".fp8b" for p in (tmp_path / "spool").iterdir())


def test_a_transport_replays_a_spool_without_listing_it_again(module_live_server, tmp_path, monkeypatch):
    first = Transport("http://127.0.0.1:1", "replay", spool_dir=tmp_path / "spool", flush_interval=60)
    for step in range(300):
        first.spool.push(*first._encode(_pending(step)))
    first.close(timeout=1)
    listings = _Listings(monkeypatch)
    transport = Transport(module_live_server.url, "replay", spool_dir=tmp_path / "spool", flush_interval=0.05)
    assert transport.close(timeout=30)
    assert stored_loss_steps(module_live_server.database_url, run="replay") == list(range(300))
    assert listings.count == 1  # when the spool opened


def _pending(step: int):
    from fp8mon.agent.transport import _Pending

    pending = _Pending()
    pending.add("scalars", {"step": step, "name": ["loss"], "value": [float(step)]})
    return pending
