"""Alembic, driven from code: `fp8mon db upgrade` and the server's start-up schema check."""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from fp8mon import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent


class SchemaError(RuntimeError):
    """The database schema is not the one this version of fp8mon expects."""


def alembic_config(url: str | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def check_schema(engine: Engine) -> None:
    """Refuse to serve an un-migrated database or one migrated by a newer fp8mon."""
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    url = engine.url.render_as_string(hide_password=True)
    if current is None:
        raise SchemaError(f"database {url} has no fp8mon schema: run `fp8mon db upgrade --database-url {url}`")
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaError(f"database {url} is at schema revision {current!r}, newer than this fp8mon "
                          f"(knows up to {head!r}): upgrade fp8mon")
    raise SchemaError(f"database {url} is at schema revision {current!r}, this fp8mon needs {head!r}: "
                      f"run `fp8mon db upgrade --database-url {url}`")
