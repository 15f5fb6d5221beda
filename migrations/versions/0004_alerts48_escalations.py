"""Alerts: the history of an alert's severity rises (step, severity, previous severity), not only the last.

Revision ID: 0004_alerts48
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_alerts48"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("escalations", sa.JSON))
    # Rows written before keep what they knew: their last rise (read as a one-entry history, see storage.alerts).


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("escalations")
