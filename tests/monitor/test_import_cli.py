"""`fp8mon import`: the labelled runs land in a database with their configs, predictions and alerts, and runs
labelled diverged get that status; importing again adds nothing."""

import httpx

from fp8mon.cli import main
from fp8mon.monitor.fixtures import FIXTURE_DIR, load_fixture
from fp8mon.monitor.storage import SqlAlchemyStore

MATCH = "cpu-llama-fp8-frozen-s1[15]-div*"  # two small diverging runs (4 and 6 batches)


def test_import_stores_the_labelled_runs_with_predictions_and_is_idempotent(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'corpus.db'}"
    assert main(["import", "--database-url", url, "--match", MATCH]) == 0
    printed = capsys.readouterr().out
    names = sorted(p.name.removesuffix(".json.gz") for p in FIXTURE_DIR.glob(MATCH))
    assert len(names) == 2 and all(name in printed for name in names)
    store = SqlAlchemyStore(url)
    try:
        page = store.list_runs(limit=10, order_by="name")
        assert [r.name for r in page.runs] == names
        for run in page.runs:
            fixture = load_fixture(FIXTURE_DIR / f"{run.name}.json.gz")
            assert run.status == "diverged" and fixture.diverged
            assert run.config["train"]["precision"] == "fp8"
            assert run.last_step == fixture.last_step()
            assert store.list_predictions(run.name).predictions  # the pipeline ran over the batches
    finally:
        store.close()
    assert main(["import", "--database-url", url, "--match", MATCH, "--no-predict"]) == 0
    assert "already there" in capsys.readouterr().out


def test_import_says_when_nothing_matches(tmp_path, capsys):
    assert main(["import", "--database-url", f"sqlite:///{tmp_path / 'x.db'}", "--match", "no-such-run"]) == 1
    assert "no fixture" in capsys.readouterr().err


def test_import_into_a_running_server_posts_the_batches(live_server, capsys):
    one = "cpu-llama-fp8-frozen-s11-div"
    assert main(["import", "--url", live_server.url, "--match", one]) == 0
    assert f"open {live_server.url}/" in capsys.readouterr().out
    run = httpx.get(f"{live_server.url}/api/v1/runs/{one}").json()
    fixture = load_fixture(FIXTURE_DIR / f"{one}.json.gz")
    assert (run["status"], run["last_step"]) == ("diverged", fixture.last_step())
