"""Alerts: the steps at which an alert fired and resolved; indexes for the alert listing and the pipeline's
lookup of a run's active alerts.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("fired_step", sa.BigInteger))
        batch.add_column(sa.Column("resolved_step", sa.BigInteger))
    op.create_index("ix_alerts_run_fingerprint", "alerts", ["run_id", "fingerprint"])
    op.create_index("ix_alerts_state", "alerts", ["state"])


def downgrade() -> None:
    op.drop_index("ix_alerts_state", "alerts")
    op.drop_index("ix_alerts_run_fingerprint", "alerts")
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("resolved_step")
        batch.drop_column("fired_step")
