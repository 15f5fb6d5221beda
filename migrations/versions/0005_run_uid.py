"""Runs: a unique id (`uid`) beside the display name; every existing run gets one.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN, no batch rebuild: rebuilding `runs` on SQLite drops it, and the drop would
    # cascade-delete the catalogue, batches, alerts and predictions that reference it.
    op.add_column("runs", sa.Column("uid", sa.String(64), nullable=True))
    runs = sa.table("runs", sa.column("id", sa.Integer), sa.column("uid", sa.String))
    conn = op.get_bind()
    ids = conn.execute(sa.select(runs.c.id)).scalars().all()
    if ids:
        conn.execute(runs.update().where(runs.c.id == sa.bindparam("b_id")).values(uid=sa.bindparam("b_uid")),
                     [{"b_id": run_id, "b_uid": uuid.uuid4().hex} for run_id in ids])
    op.create_index("ux_runs_uid", "runs", ["uid"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_runs_uid", table_name="runs")
    op.drop_column("runs", "uid")  # in place, no rebuild (SQLite >= 3.35), for the reason above
