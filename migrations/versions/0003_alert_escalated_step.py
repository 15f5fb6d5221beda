"""Alerts: the step at which an alert's severity last rose after it fired.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("escalated_step", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("escalated_step")
