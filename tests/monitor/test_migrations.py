"""The Alembic migrations build exactly the schema the models describe, on both databases."""

import subprocess
import sys
from datetime import UTC, datetime

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import insert, inspect, select, text

from fp8mon.monitor.migrate import (
    SchemaError,
    alembic_config,
    check_schema,
    current_revision,
    head_revision,
    upgrade,
)
from fp8mon.monitor.models import Alert, Base, Run
from fp8mon.monitor.storage.engine import create_db_engine


def test_migrated_schema_matches_the_models(database_url):
    engine = create_db_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_escalated_step_migration_downgrades_and_upgrades_keeping_the_alerts(database_url):
    engine = create_db_engine(database_url)

    def alert_columns():
        return {c["name"] for c in inspect(engine).get_columns("alerts")}

    try:
        assert "escalated_step" in alert_columns()
        now = datetime.now(UTC)
        with engine.begin() as conn:
            run_id = conn.execute(insert(Run).values(name="r", created_at=now).returning(Run.id)).scalar_one()
            conn.execute(insert(Alert).values(run_id=run_id, fingerprint="fp", rule="stale_scale", severity="warning",
                                              state="firing", message="m", fired_step=80, escalated_step=300,
                                              started_at=now, updated_at=now))
        config = alembic_config()
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0002")
        assert current_revision(engine) == "0002"
        assert "escalated_step" not in alert_columns() and "fired_step" in alert_columns()
        with engine.connect() as conn:
            assert conn.execute(text("select rule, fired_step from alerts")).all() == [("stale_scale", 80)]
        upgrade(engine)
        assert current_revision(engine) == head_revision() and "escalated_step" in alert_columns()
        with engine.connect() as conn:
            assert conn.execute(select(Alert.fired_step, Alert.escalated_step)).all() == [(80, None)]
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def test_escalations_migration_downgrades_and_upgrades_keeping_the_last_rise(database_url):
    from fp8mon.monitor.storage import SqlAlchemyStore

    engine = create_db_engine(database_url)
    history = [{"step": 300, "severity": "warning", "from": "info"}]
    try:
        now = datetime.now(UTC)
        with engine.begin() as conn:
            run_id = conn.execute(insert(Run).values(name="r", created_at=now).returning(Run.id)).scalar_one()
            for fp, esc in (("fp1", history), ("fp2", None)):
                conn.execute(insert(Alert).values(run_id=run_id, fingerprint=fp, rule="stale_scale",
                                                  severity="warning", state="firing", message="m", fired_step=80,
                                                  escalated_step=300, escalations=esc, started_at=now,
                                                  updated_at=now))
        config = alembic_config()
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0003")
        assert "escalations" not in {c["name"] for c in inspect(engine).get_columns("alerts")}
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    store = SqlAlchemyStore(database_url)
    try:
        alerts = store.list_alerts(run="r").alerts
    finally:
        store.close()
    # what the rows knew before 0004 (their last rise) is read as a one-entry history
    assert [a.escalations for a in alerts] == [[{"step": 300, "severity": "warning", "from": None}]] * 2


def test_server_refuses_a_schema_newer_than_itself(database_url):
    engine = create_db_engine(database_url)
    try:
        check_schema(engine)
        with engine.begin() as conn:
            conn.execute(text("update alembic_version set version_num = '9999_future'"))
        with pytest.raises(SchemaError, match="newer than this fp8mon"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_db_upgrade_command_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "fp8mon", "db", "upgrade", "--database-url", url],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert f"at revision {head_revision()}" in out.stdout
