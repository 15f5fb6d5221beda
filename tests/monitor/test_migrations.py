"""The Alembic migrations build exactly the schema the models describe, on both databases."""

import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from monitor.db import create_db_engine
from monitor.migrate import SchemaError, check_schema, head_revision
from monitor.models import Base


def test_migrated_schema_matches_the_models(database_url):
    engine = create_db_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


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
        out = subprocess.run([sys.executable, "-m", "monitor.cli", "db", "upgrade", "--database-url", url],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert f"at revision {head_revision()}" in out.stdout
