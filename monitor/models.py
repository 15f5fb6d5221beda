"""SQLAlchemy ORM models: the monitor's schema (migrations/ creates it; this module describes it).

Volumes drive the design: a run produces layers x sites wide rows every reporting step, so the bulk
tables are keyed by a surrogate series id (run, layer, site) and clustered on (series, rank, step);
SQLite stores them WITHOUT ROWID so a series is one contiguous range of the primary-key b-tree.
The bulk tables carry no foreign keys: the store deletes them with their run, and per-row FK checks
would cost ingest speed.
"""

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fp8mon.agent.wire import TENSOR_STATS

# Buckets of the downsampling pyramid, in steps. Every bucket keeps min, max, sum, count and last per
# statistic, so a spike survives at any zoom level.
ROLLUP_WIDTHS = (16, 64, 256, 1024, 4096, 16384)
ROLLUP_AGGREGATES = ("min", "max", "sum", "n", "last")


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="running")
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    tags: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    first_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    # Steps below rollup_until are summarised in the rollup tables; a late batch below it sets
    # rollup_dirty_from so the compactor recomputes from there.
    rollup_until: Mapped[int] = mapped_column(BigInteger, default=0)
    rollup_dirty_from: Mapped[int | None] = mapped_column(BigInteger)


class TensorSeries(Base):
    """Catalogue of (layer, site) pairs of a run; `ordinal` is the order of first appearance (model order)."""

    __tablename__ = "tensor_series"
    __table_args__ = (UniqueConstraint("run_id", "layer", "site", name="uq_tensor_series"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    layer: Mapped[str] = mapped_column(String(300))
    site: Mapped[str] = mapped_column(String(32))
    ordinal: Mapped[int] = mapped_column(Integer)


class ScalarSeries(Base):
    __tablename__ = "scalar_series"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_scalar_series"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))


def _stat_columns() -> dict:
    return {name: mapped_column(Double, nullable=True) for name in TENSOR_STATS}


class TensorStats(Base):
    __tablename__ = "tensor_stats"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    locals().update(_stat_columns())
    log2_hist: Mapped[bytes | None] = mapped_column(LargeBinary)


class Scalar(Base):
    __tablename__ = "scalars"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    value: Mapped[float | None] = mapped_column(Double)


def _rollup_columns(stats) -> dict:
    return {
        f"{stat}_{agg}": mapped_column(BigInteger if agg == "n" else Double, nullable=True)
        for stat in stats
        for agg in ROLLUP_AGGREGATES
    }


class TensorRollup(Base):
    """One bucket of `width` steps of one series and rank: min/max/sum/n/last of every statistic."""

    __tablename__ = "tensor_rollups"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    width: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    step_first: Mapped[int] = mapped_column(BigInteger)
    step_last: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer)
    locals().update(_rollup_columns(TENSOR_STATS))


class ScalarRollup(Base):
    __tablename__ = "scalar_rollups"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    width: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    step_first: Mapped[int] = mapped_column(BigInteger)
    step_last: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer)
    locals().update(_rollup_columns(["value"]))


class IngestBatch(Base):
    """Client batch ids already stored: a retried batch is acknowledged and not written again."""

    __tablename__ = "ingest_batches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    n_values: Mapped[int] = mapped_column(Integer)


class Alert(Base):
    """One alert of the lifecycle in monitor.assessment. first_step: the finding first appeared (pending);
    fired_step: it fired; escalated_step: its severity last rose after firing (null if it never did);
    escalations: every rise after firing, [{"step", "severity", "from"}] in step order (null before migration
    0004); last_step: the finding last held; resolved_step: it resolved."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_fingerprint", "run_id", "fingerprint"),
                      Index("ix_alerts_state", "state"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    fingerprint: Mapped[str] = mapped_column(String(200))
    rule: Mapped[str] = mapped_column(String(100))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    layer: Mapped[str | None] = mapped_column(String(300))
    site: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    first_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    fired_step: Mapped[int | None] = mapped_column(BigInteger)
    escalated_step: Mapped[int | None] = mapped_column(BigInteger)
    escalations: Mapped[list | None] = mapped_column(JSON)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    acknowledged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Prediction(Base):
    __tablename__ = "predictions"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    risk: Mapped[float] = mapped_column(Double)
    steps_to_divergence: Mapped[float | None] = mapped_column(Double)
    signals: Mapped[dict] = mapped_column(JSON, default=dict)
    culprits: Mapped[list] = mapped_column(JSON, default=list)
