"""Request and response bodies of the REST API (pydantic), apart from the ORM models.

The ingest body is the versioned wire contract of docs/wire-format.md: columnar blocks, so a batch of
thousands of records validates and stores without a Python object per value.
"""

import math
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from fp8mon.agent.wire import (LOG2_HIST_BINS, MAX_LAYER_NAME, MAX_RUN_NAME, MAX_SCALAR_NAME, RUN_NAME_PATTERN,
                        SCALAR_NAME_PATTERN, SITES, TENSOR_STATS, WIRE_VERSION)

RunName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_RUN_NAME, pattern=RUN_NAME_PATTERN)]
LayerName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LAYER_NAME)]
ScalarName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SCALAR_NAME, pattern=SCALAR_NAME_PATTERN)]
Step = Annotated[int, Field(ge=0, le=2**62)]
Rank = Annotated[int, Field(ge=-1, le=32767)]  # -1: statistics reduced over all ranks
Value = float | None  # None: not reported; NaN and +-Inf are values and are stored as such
RunStatus = Literal["running", "finished", "failed", "diverged"]

MAX_RECORDS_PER_BLOCK = 1_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ColumnarBlock(_Strict):
    """Shared rule of the columnar blocks: every list column has one entry per record."""

    def _check_lengths(self, columns: dict) -> int:
        lengths = {name: len(col) for name, col in columns.items() if isinstance(col, list)}
        if not lengths:
            raise ValueError("block has no list column, so no records")
        n = max(lengths.values())
        bad = [f"{name} has {length}" for name, length in lengths.items() if length != n]
        if bad:
            raise ValueError(f"columns must have one entry per record ({n} records): " + ", ".join(bad))
        if n > MAX_RECORDS_PER_BLOCK:
            raise ValueError(f"{n} records in one block; at most {MAX_RECORDS_PER_BLOCK}")
        return n


class TensorBlock(_ColumnarBlock):
    """Per-tensor statistics: record i is (step[i], layer[i], site[i], rank[i]) with stats[name][i]."""

    step: Step | list[Step]
    layer: list[LayerName]
    site: list[Literal[SITES]]  # type: ignore[valid-type]
    rank: Rank | list[Rank] = 0
    stats: dict[Literal[TENSOR_STATS], list[Value]] = Field(default_factory=dict)  # type: ignore[valid-type]
    log2_hist: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=LOG2_HIST_BINS,
                                                                         max_length=LOG2_HIST_BINS)] | None] | None = None

    @model_validator(mode="after")
    def _same_lengths(self):
        columns = {"step": self.step, "layer": self.layer, "site": self.site, "rank": self.rank}
        columns.update({f"stats.{k}": v for k, v in self.stats.items()})
        if self.log2_hist is not None:
            columns["log2_hist"] = self.log2_hist
        self._n = self._check_lengths(columns)
        return self

    def __len__(self) -> int:
        return self._n


class ScalarBlock(_ColumnarBlock):
    """Model-level scalars: record i is (step[i], name[i], rank[i]) = value[i]."""

    step: Step | list[Step]
    name: list[ScalarName]
    value: list[Value]
    rank: Rank | list[Rank] = 0

    @model_validator(mode="after")
    def _same_lengths(self):
        self._n = self._check_lengths({"step": self.step, "name": self.name, "value": self.value, "rank": self.rank})
        return self

    def __len__(self) -> int:
        return self._n


class RunMeta(_Strict):
    config: dict | None = None
    tags: dict[str, str] | None = None
    status: RunStatus | None = None


class IngestBatch(_Strict):
    version: Literal[WIRE_VERSION] = Field(description="wire format version; this server speaks 1")  # type: ignore[valid-type]
    batch_id: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        description="client-chosen id; a batch sent again with the same id is stored once")
    run: RunName
    run_meta: RunMeta | None = None
    tensors: TensorBlock | None = None
    scalars: ScalarBlock | None = None
    sent_at: float | None = None

    @model_validator(mode="after")
    def _not_empty(self):
        if self.tensors is None and self.scalars is None and self.run_meta is None:
            raise ValueError("batch carries nothing: give tensors, scalars or run_meta")
        return self

    def value_count(self) -> int:
        n = 0
        if self.tensors is not None:
            n += sum(len(col) - col.count(None) for col in self.tensors.stats.values())
        if self.scalars is not None:
            n += len(self.scalars)
        return n


class IngestResult(BaseModel):
    batch_id: str
    run: str
    run_id: int
    duplicate: bool = Field(description="true when this batch id was already stored; nothing was written")
    tensor_records: int
    scalar_records: int
    values: int


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    status: RunStatus
    config: dict
    tags: dict
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    last_seen_at: datetime | None
    first_step: int | None
    last_step: int | None


class RunPatch(_Strict):
    status: RunStatus | None = None
    tags: dict[str, str] | None = None
    config: dict | None = None


def finite_or_none(x: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: the API writes them as the strings "NaN", "Infinity", "-Infinity"."""
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


# -- query responses (GET /api/v1/runs...) ----------------------------------------------------------

JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"] | None  # null: not reported / empty bucket


class RunList(BaseModel):
    total: int = Field(description="runs matching the filters, over all pages")
    limit: int
    offset: int
    runs: list[RunOut]


class RunDetail(RunOut):
    tensor_series: int = Field(description="layer x site series in the catalogue")
    scalar_series: int
    rollup_until: int = Field(description="steps below this are served from the rollup pyramid")


class RunDeleted(BaseModel):
    run: str
    id: int
    deleted_rows: dict[str, int] = Field(description="bulk rows removed per table")


class CatalogueLayer(BaseModel):
    layer: str
    sites: list[str]


class Catalogue(BaseModel):
    run: str
    first_step: int | None
    last_step: int | None
    layers: list[CatalogueLayer] = Field(description="in model order (first appearance)")
    sites: list[str]
    stats: list[str] = Field(description="statistic names of every layer x site series")
    scalars: list[str]
    ranks: list[int]


class SeriesPoints(BaseModel):
    step: list[int] = Field(description="raw: the step; downsampled: the bucket's first step (clipped to start)")
    value: list[JsonFloat] | None = Field(None, description="raw points only")
    count: list[int] | None = Field(None, description="downsampled: values in the bucket (NaN included)")
    min: list[JsonFloat] | None = Field(None, description="downsampled; NaN if the bucket holds a NaN")
    max: list[JsonFloat] | None = Field(None, description="downsampled; NaN if the bucket holds a NaN")
    mean: list[JsonFloat] | None = Field(None, description="downsampled; NaN if the bucket holds a NaN")
    last: list[JsonFloat] | None = Field(None, description="downsampled: the value at the bucket's last step")


class SeriesOut(BaseModel):
    run: str
    rank: int
    stat: str | None
    layer: str | None
    site: str | None
    scalar: str | None
    start: int | None
    end: int | None
    bucket_width: int = Field(description="steps per point; 1: raw points")
    downsampled: bool
    points: SeriesPoints


class HeatmapOut(BaseModel):
    run: str
    stat: str
    site: str
    rank: int
    agg: Literal["max", "min", "mean", "last"]
    start: int | None
    end: int | None
    bucket_width: int = Field(description="steps per column; 1: one column per step")
    downsampled: bool
    edges: list[int] = Field(description="column i covers steps [edges[i], edges[i+1])")
    layers: list[str] = Field(description="matrix rows, in model order")
    values: list[list[JsonFloat]] = Field(description="values[layer][column]; null: nothing reported there")


class LatestSeries(BaseModel):
    layer: str
    site: str
    step: int
    values: dict[str, JsonFloat]


class LatestScalar(BaseModel):
    name: str
    step: int
    value: JsonFloat


class LatestOut(BaseModel):
    run: str
    rank: int
    last_step: int | None
    stats: list[str]
    series: list[LatestSeries] = Field(description="one entry per layer x site, in model order")
    scalars: list[LatestScalar]


# -- alerts and predictions (GET /api/v1/alerts, /api/v1/runs/{run}/alerts, .../predictions) -------------

AlertState = Literal["pending", "firing", "resolved"]
Severity = Literal["info", "warning", "critical"]


class AlertOut(BaseModel):
    id: int
    run: str
    fingerprint: str = Field(description="identity of (run, rule, layer, site); a re-fired alert is a new id")
    rule: str
    severity: Severity
    state: AlertState
    layer: str | None
    site: str | None
    message: str
    details: dict = Field(description="value: the signal's value; for_steps; risk and steps_to_divergence at "
                                      "the last update")
    first_step: int | None = Field(description="step at which the finding first appeared (pending)")
    fired_step: int | None = Field(description="step at which the alert fired; null while pending")
    escalated_step: int | None = Field(description="step at which the severity last rose after the alert fired "
                                                   "(it fired at a lower severity); null if it never rose")
    last_step: int | None = Field(description="last step at which the finding held")
    resolved_step: int | None
    started_at: datetime
    updated_at: datetime
    resolved_at: datetime | None
    acknowledged_at: datetime | None


class AlertList(BaseModel):
    total: int = Field(description="alerts matching the filters, over all pages")
    limit: int
    offset: int
    alerts: list[AlertOut] = Field(description="most recently updated first")


class PredictionOut(BaseModel):
    step: int
    risk: float = Field(description="0 (healthy) .. 1 (diverging now)")
    steps_to_divergence: float | None = Field(description="estimate; null when no trend points at divergence")
    signals: dict[str, JsonFloat] = Field(description="signal name -> its score at this step")
    culprits: list[dict] = Field(description="[{layer, site, signal, value}], worst first")


class PredictionList(BaseModel):
    run: str
    predictions: list[PredictionOut] = Field(description="stored predictions in step order (every Nth step, the "
                                                         "last of each batch, and risk changes)")


class AlertAcked(AlertOut):
    newly_acknowledged: bool = Field(description="false when the alert had been acknowledged already (its "
                                                 "acknowledged_at is kept)")
