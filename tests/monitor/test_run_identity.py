"""Run identity on the server: a run has a unique id beside its name; a batch goes to the run of its run_id (or, without
one, of its name); reusing a name for a new run makes a second run, never an overwrite; resume "must" of a missing
run is refused with 409. On SQLite and PostgreSQL."""

import pytest
from alembic import command
from sqlalchemy import text

from fp8mon.monitor.migrate import alembic_config, current_revision, head_revision, upgrade
from fp8mon.monitor.storage.engine import create_db_engine
from fp8mon.monitor.storage.errors import RunConflict
from fp8mon.monitor.wire import IngestBatch


def batch(batch_id, run, value, *, steps=range(5), **identity) -> IngestBatch:
    steps = list(steps)
    return IngestBatch.model_validate({
        "version": 1, "batch_id": batch_id, "run": run, **identity,
        "scalars": {"step": steps, "name": ["loss"] * len(steps), "value": [value] * len(steps)}})


def losses(store, run) -> list[tuple[int, float]]:
    points = store.series(run, scalar="loss").points
    return list(zip(points["step"], points["value"]))


def test_a_name_reused_by_a_new_run_makes_a_second_run_not_an_overwrite(store):
    first = store.ingest(batch("a-0", "llama", 1.0, run_id="first", resume="never"))
    second = store.ingest(batch("b-0", "llama", 2.0, run_id="second", resume="never"))
    third = store.ingest(batch("c-0", "llama", 3.0, run_id="third", resume="never"))
    assert (first.run, second.run, third.run) == ("llama", "llama-2", "llama-3")
    assert (first.run_uid, second.run_uid) == ("first", "second")
    assert losses(store, "llama") == [(s, 1.0) for s in range(5)]  # the first training's data is intact
    assert losses(store, "llama-2") == [(s, 2.0) for s in range(5)]
    # later batches of each run find it by its id, whatever name they carry
    store.ingest(batch("b-1", "llama", 2.5, run_id="second", resume="never", steps=[5]))
    assert losses(store, "llama-2")[-1] == (5, 2.5) and len(losses(store, "llama")) == 5
    listed = {r.name: r.uid for r in store.list_runs().runs}
    assert listed == {"llama": "first", "llama-2": "second", "llama-3": "third"}


def test_listeners_see_the_name_the_run_is_stored_under(store):
    """The prediction pipeline keys its per-run state by the stored name: two runs must not share a predictor."""
    seen = []
    store.add_ingest_listener(lambda b, result: seen.append((b.run, result.run_id)))
    store.ingest(batch("a-0", "p", 1.0, run_id="one", resume="never"))
    store.ingest(batch("b-0", "p", 2.0, run_id="two", resume="never"))
    assert [name for name, _ in seen] == ["p", "p-2"] and seen[0][1] != seen[1][1]


def test_a_batch_without_run_id_keeps_going_to_the_run_of_its_name(store):
    """Older agents and replayed exports: resume "allow" by name, the run they name (the explicit resume)."""
    store.ingest(batch("a-0", "legacy", 1.0, run_id="x", resume="never"))
    resumed = store.ingest(batch("b-0", "legacy", 2.0, steps=[5, 6]))
    assert resumed.run == "legacy" and resumed.run_uid == "x"
    assert losses(store, "legacy") == [*((s, 1.0) for s in range(5)), (5, 2.0), (6, 2.0)]
    created = store.ingest(batch("c-0", "fresh", 1.0))
    assert created.run == "fresh" and len(created.run_uid) == 32  # the server chose the id


def test_resume_must_continues_an_existing_run_and_refuses_a_missing_one(store):
    store.ingest(batch("a-0", "r", 1.0, run_id="rid", resume="never"))
    assert store.ingest(batch("b-0", "other-name", 2.0, steps=[5], run_id="rid", resume="must")).run == "r"
    assert store.ingest(batch("c-0", "r", 3.0, steps=[6], resume="must")).run == "r"  # by name
    with pytest.raises(RunConflict, match="no run with id 'nope' to resume"):
        store.ingest(batch("d-0", "r", 4.0, run_id="nope", resume="must"))
    with pytest.raises(RunConflict, match="no run with name 'missing'"):
        store.ingest(batch("e-0", "missing", 4.0, resume="must"))
    assert [r.name for r in store.list_runs().runs] == ["r"]
    assert losses(store, "r")[-2:] == [(5, 2.0), (6, 3.0)]


def test_resume_allow_with_an_unknown_id_creates_the_run_under_a_free_name(store):
    store.ingest(batch("a-0", "job", 1.0, run_id="job-1", resume="never"))
    made = store.ingest(batch("b-0", "job", 2.0, run_id="job-2", resume="allow"))
    again = store.ingest(batch("c-0", "job", 3.0, steps=[5], run_id="job-2", resume="allow"))
    assert made.run == again.run == "job-2" and made.run_uid == "job-2"  # "job-2": the free name, by chance too
    assert losses(store, "job") == [(s, 1.0) for s in range(5)]


def test_find_run_answers_what_a_resume_would_continue(store):
    assert store.find_run("r") is None and store.find_run("r", "rid") is None
    store.ingest(batch("a-0", "r", 1.0, run_id="rid", resume="never", steps=[0, 7]))
    by_name, by_id = store.find_run("r"), store.find_run("whatever", "rid")
    assert by_name == by_id and by_id.uid == "rid" and by_id.name == "r" and by_id.last_step == 7


def test_the_api_shows_ids_and_refuses_a_missing_resume_with_409(client):
    def post(body):
        return client.post("/api/v1/ingest", json={"version": 1, "scalars": {"step": 0, "name": ["loss"],
                                                                              "value": [1.0]}, **body})

    never = post({"batch_id": "a", "run": "n", "run_id": "n1", "resume": "never"})
    assert never.status_code == 200 and never.json()["run_uid"] == "n1" and never.json()["run"] == "n"
    assert post({"batch_id": "b", "run": "n", "run_id": "n2", "resume": "never"}).json()["run"] == "n-2"
    refused = post({"batch_id": "c", "run": "n", "run_id": "n3", "resume": "must"})
    assert refused.status_code == 409 and "resume" in refused.json()["detail"]
    no_id = post({"batch_id": "d", "run": "n", "resume": "never"})
    assert no_id.status_code == 422 and "run_id" in no_id.json()["detail"]
    assert client.get("/api/v1/runs/n-2").json()["uid"] == "n2"
    assert {r["uid"] for r in client.get("/api/v1/runs").json()["runs"]} == {"n1", "n2"}
    point = client.post("/api/v1/ingest/resume", json={"run": "n"}).json()
    assert point == {"exists": True, "run": "n", "run_uid": "n1", "last_step": 0}
    assert client.post("/api/v1/ingest/resume", json={"run": "n", "run_id": "zz"}).json()["exists"] is False


def test_migration_gives_every_existing_run_an_id_and_keeps_its_data(database_url):
    engine = create_db_engine(database_url)
    config = alembic_config()
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0003")
        with engine.begin() as conn:
            for name in ("old-a", "old-b"):
                conn.execute(text("insert into runs (name, status, config, tags, created_at, rollup_until) "
                                  "values (:n, 'finished', '{}', '{}', current_timestamp, 0)"), {"n": name})
            conn.execute(text("insert into tensor_series (run_id, layer, site, ordinal) "
                              "select id, 'l0', 'input', 0 from runs where name = 'old-a'"))
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            uids = conn.execute(text("select name, uid from runs order by name")).all()
            series = conn.execute(text("select count(*) from tensor_series")).scalar_one()
        assert [n for n, _ in uids] == ["old-a", "old-b"] and series == 1  # nothing cascaded away
        assert all(u and len(u) == 32 for _, u in uids) and uids[0][1] != uids[1][1]
    finally:
        engine.dispose()
