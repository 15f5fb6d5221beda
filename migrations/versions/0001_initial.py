"""Initial schema: runs, catalogues, wide tensor statistics, scalars, rollups, batches, alerts, predictions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copies: a migration must not change when the application's constants do.
STATS = (
    "numel", "amax", "rms", "mean", "std", "kurtosis", "kurtosis_central", "crest", "underflow_frac",
    "overflow_frac", "outlier_frac", "zero_frac", "nonfinite", "scale", "amax_history_max",
)
AGGREGATES = ("min", "max", "sum", "n", "last")
TZ = sa.DateTime(timezone=True)


def _key_columns():
    return [
        sa.Column("series_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("rank", sa.SmallInteger, primary_key=True, autoincrement=False),
    ]


def _rollup_columns(stats):
    return [
        sa.Column(f"{s}_{a}", sa.BigInteger if a == "n" else sa.Double, nullable=True)
        for s in stats
        for a in AGGREGATES
    ]


def _bucket_columns():
    return [
        sa.Column("width", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("bucket", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("step_first", sa.BigInteger, nullable=False),
        sa.Column("step_last", sa.BigInteger, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("tags", sa.JSON, nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("started_at", TZ),
        sa.Column("ended_at", TZ),
        sa.Column("last_seen_at", TZ),
        sa.Column("first_step", sa.BigInteger),
        sa.Column("last_step", sa.BigInteger),
        sa.Column("rollup_until", sa.BigInteger, nullable=False),
        sa.Column("rollup_dirty_from", sa.BigInteger),
    )
    for table, name_cols in (("tensor_series", ("layer", "site")), ("scalar_series", ("name",))):
        cols = [sa.Column(c, sa.String(300 if c == "layer" else 32 if c == "site" else 200), nullable=False)
                for c in name_cols]
        if table == "tensor_series":
            cols.append(sa.Column("ordinal", sa.Integer, nullable=False))
        op.create_table(
            table,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
            *cols,
            sa.UniqueConstraint("run_id", *name_cols, name=f"uq_{table}"),
        )
        op.create_index(f"ix_{table}_run_id", table, ["run_id"])

    op.create_table(
        "tensor_stats",
        *_key_columns(),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        *[sa.Column(s, sa.Double, nullable=True) for s in STATS],
        sa.Column("log2_hist", sa.LargeBinary),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "scalars",
        *_key_columns(),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("value", sa.Double),
        sqlite_with_rowid=False,
    )
    op.create_table("tensor_rollups", *_key_columns(), *_bucket_columns(), *_rollup_columns(STATS),
                    sqlite_with_rowid=False)
    op.create_table("scalar_rollups", *_key_columns(), *_bucket_columns(), *_rollup_columns(("value",)),
                    sqlite_with_rowid=False)
    op.create_table(
        "ingest_batches",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("batch_id", sa.String(128), primary_key=True),
        sa.Column("received_at", TZ, nullable=False),
        sa.Column("n_values", sa.Integer, nullable=False),
    )
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("fingerprint", sa.String(200), nullable=False),
        sa.Column("rule", sa.String(100), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("layer", sa.String(300)),
        sa.Column("site", sa.String(32)),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("details", sa.JSON, nullable=False),
        sa.Column("first_step", sa.BigInteger),
        sa.Column("last_step", sa.BigInteger),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("updated_at", TZ, nullable=False),
        sa.Column("resolved_at", TZ),
        sa.Column("acknowledged_at", TZ),
    )
    op.create_index("ix_alerts_run_id", "alerts", ["run_id"])
    op.create_table(
        "predictions",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("risk", sa.Double, nullable=False),
        sa.Column("steps_to_divergence", sa.Double),
        sa.Column("signals", sa.JSON, nullable=False),
        sa.Column("culprits", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    for table in ("predictions", "alerts", "ingest_batches", "scalar_rollups", "tensor_rollups", "scalars",
                  "tensor_stats", "scalar_series", "tensor_series", "runs"):
        op.drop_table(table)
