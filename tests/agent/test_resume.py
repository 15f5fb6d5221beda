"""Run identity with a real agent and a real server (uvicorn on 127.0.0.1): two trainings under one name make two runs
(before: the second overwrote the first's steps); resume="allow" continues a run and drops, counting them, the steps
it has stored already; resume="must" of a missing run fails loudly at construction, or at first contact (409)."""

import logging

import httpx
import pytest
import torch

from fp8mon import Agent
from fp8mon.agent.delivery import ResumeRefused
from fp8mon.agent.transport import Transport


def train(agent: Agent, steps, loss_of=float) -> Agent:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    agent.watch(model)
    for step in steps:
        model(torch.randn(2, 8)).pow(2).mean().backward()
        agent.log(step, loss=loss_of(step))
    return agent


def losses(url, run) -> list[tuple[int, float]]:
    points = httpx.get(f"{url}/api/v1/runs/{run}/series", params={"scalar": "loss"}).json()["points"]
    return list(zip(points["step"], points["value"]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (a start costs seconds on a busy machine); each test uses its own run names. The
    storage of run identity is tested on both databases in tests/monitor/test_run_identity.py."""
    from fp8mon.monitor.localserver import ServerProcess

    url = f"sqlite:///{tmp_path_factory.mktemp('identity') / 'fp8mon.db'}"
    process = ServerProcess(url, args=("--migrate",)).start(timeout=60)
    yield process
    process.stop()


def run_names(server) -> set[str]:
    return {r["name"] for r in httpx.get(f"{server.url}/api/v1/runs", params={"limit": 1000}).json()["runs"]}


def test_two_trainings_with_one_name_make_two_runs(server, tmp_path, one_torch_thread):
    first = train(Agent(server.url, run="same", spool_dir=tmp_path / "a", flush_interval=0.05), range(5))
    assert first.close(timeout=20)
    second = train(Agent(server.url, run="same", spool_dir=tmp_path / "b", flush_interval=0.05), range(5),
                   loss_of=lambda s: 100.0 + s)
    assert second.close(timeout=20)
    assert first.run_id != second.run_id and first.status().run == "same" and second.status().run == "same-2"
    assert losses(server.url, "same") == [(s, float(s)) for s in range(5)]  # not overwritten by the second
    assert losses(server.url, "same-2") == [(s, 100.0 + s) for s in range(5)]
    uids = {name: httpx.get(f"{server.url}/api/v1/runs/{name}").json()["uid"] for name in ("same", "same-2")}
    assert uids == {"same": first.run_id, "same-2": second.run_id} and "same-3" not in run_names(server)
    assert first.errors == second.errors == 0


def test_resume_allow_continues_and_drops_the_steps_it_has_stored(server, tmp_path, caplog, one_torch_thread):
    assert train(Agent(server.url, run="res", spool_dir=tmp_path / "a", flush_interval=0.05), range(5)).close(20)
    resumed = Agent(server.url, run="res", resume="allow", spool_dir=tmp_path / "b", flush_interval=0.05)
    train(resumed, range(3, 8), loss_of=lambda s: 100.0 + s)  # restarted from a checkpoint of step 2
    assert resumed.close(timeout=20)
    assert resumed.errors == 2 and "step 4 is at or below step 4" in resumed.last_error  # steps 3 and 4, counted
    warned = [r.getMessage() for r in caplog.records if r.name == "fp8mon.agent" and r.levelno >= logging.ERROR]
    assert len(warned) == 1 and "at or below" in warned[0]  # logged once
    assert losses(server.url, "res") == [*((s, float(s)) for s in range(5)), *((s, 100.0 + s) for s in (5, 6, 7))]
    assert "res-2" not in run_names(server)
    assert resumed.run_id == httpx.get(f"{server.url}/api/v1/runs/res").json()["uid"]


def test_resume_allow_by_id_creates_the_run_when_missing(server, tmp_path, one_torch_thread):
    agent = train(Agent(server.url, run="job", run_id="slurm-42", resume="allow", spool_dir=tmp_path,
                        flush_interval=0.05), range(3))
    assert agent.close(timeout=20) and agent.errors == 0
    assert httpx.get(f"{server.url}/api/v1/runs/job").json()["uid"] == "slurm-42"


def test_resume_must_of_a_missing_run_fails_at_construction(server, tmp_path):
    with pytest.raises(ResumeRefused, match="no run with id 'nope' to resume"):
        Agent(server.url, run="r", run_id="nope", resume="must", spool_dir=tmp_path)
    with pytest.raises(ValueError, match="resume='allow' or 'must'"):
        Agent(server.url, run="r", run_id="x", spool_dir=tmp_path)  # never + an id: a contradiction


def test_resume_must_refused_at_first_contact_is_loud_and_counted(server, tmp_path):
    """As when the monitor could not be asked at construction: the batches are refused (409), each counted."""
    transport = Transport(server.url, "r", run_id="gone", resume="must", spool_dir=tmp_path, flush_interval=0.05)
    errors = []
    transport.on_error = errors.append  # what Agent counts in agent.errors
    transport.send_scalars({"step": 0, "name": ["loss"], "value": [1.0]})
    assert not transport.close(timeout=20)  # the truth: nothing was stored
    status = transport.status()
    assert status.set_aside == 1 and status.delivered == 0 and "409" in status.last_error
    assert [type(e) for e in errors] == [ResumeRefused] and "resume='must'" in str(errors[0])
    assert "r" not in run_names(server)
