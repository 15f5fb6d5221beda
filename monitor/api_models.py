"""Bodies of the REST API beside ingest (pydantic): the run patch request and the query responses, which give
the OpenAPI schema. The ingest contract is in monitor.wire."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fp8mon.monitor.wire import JsonConfig, RunStatus, TagKey, TagValue

RunState = Literal["running", "stalled", "finished", "failed", "diverged"]  # storage.run_status.RUN_STATES


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    uid: str = Field(description="the run's unique id (the agent's run_id); the name is unique too")
    name: str
    status: RunState = Field(description="as the user should read it: the reported status, except that a running "
                                         "run whose loss met the divergence rule is diverged and one silent for "
                                         "several of its usual reporting intervals is stalled")
    config: dict
    tags: dict
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    last_seen_at: datetime | None
    first_step: int | None
    last_step: int | None
    reported_status: RunStatus = Field(description="the status the client reported (or a user set)")
    report_interval_s: float | None = Field(description="mean seconds between the run's batches; null: fewer "
                                                        "than two")


class RunPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: RunStatus | None = None
    tags: dict[TagKey, TagValue] | None = None
    config: JsonConfig | None = None


# -- query responses (GET /api/v1/runs...) ----------------------------------------------------------

JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"] | None  # null: not reported / empty bucket


class RunListed(RunOut):
    firing: int = Field(description="the run's firing alerts not acknowledged, all of them (not a page)")
    firing_by_severity: dict[str, int] = Field(description="severity -> firing alerts (severities with some)")
    worst_severity: Literal["info", "warning", "critical"] | None = Field(
        description="the worst severity among the firing alerts; null: nothing firing")
    risk: float | None = Field(description="risk of the latest prediction; null: none yet")


class RunList(BaseModel):
    total: int = Field(description="runs matching the filters, over all pages")
    limit: int
    offset: int
    runs: list[RunListed]


class RunDetail(RunOut):
    tensor_series: int = Field(description="layer x site series in the catalogue")
    scalar_series: int


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
    rank: int | None = Field(description="null: each point is the worst (largest) over `ranks`")
    stat: str | None
    layer: str | None
    site: str | None
    scalar: str | None
    start: int | None
    end: int | None
    bucket_width: int = Field(description="steps per point; 1: raw points")
    downsampled: bool
    points: SeriesPoints
    ranks: list[int] = Field([], description="the ranks the values come from")


class HeatmapOut(BaseModel):
    run: str
    stat: str
    site: str
    rank: int | None = Field(description="null: each cell is the worst (largest) over `ranks`")
    agg: Literal["max", "min", "mean", "last"]
    start: int | None
    end: int | None
    bucket_width: int = Field(description="steps per column; 1: one column per step")
    downsampled: bool
    edges: list[int] = Field(description="column i covers steps [edges[i], edges[i+1])")
    layers: list[str] = Field(description="matrix rows, in model order")
    values: list[list[JsonFloat]] = Field(description="values[layer][column]; null: nothing reported there")
    ranks: list[int] = Field(description="the ranks the cells come from")
    run_ranks: list[int] = Field(description="every rank with statistics at this site (-1: merged over ranks)")
    top: int | None = Field(None, description="with ?top=k: only the k layers with the largest cells, worst first; "
                                              "null: every layer, in model order")
    layer_count: int = Field(0, description="the run's layers at this site (all of them, with top or not)")


class FormatOut(BaseModel):
    name: Literal["e4m3", "e5m2"]
    max: float
    min_normal: float
    min_subnormal: float
    overflow: float = Field(description="|s*x| above this saturates")
    underflow: float = Field(description="|s*x| at or below this quantizes to zero")


class HistogramLimits(BaseModel):
    format: FormatOut
    overflow_log2: list[float] = Field(description="per column: log2 |x| above which values overflow at the "
                                                   "column's largest scale")
    underflow_log2: list[float] = Field(description="per column: log2 |x| at or below which values become zero at "
                                                    "the column's smallest scale")
    min_normal_log2: list[float] = Field(description="per column: log2 |x| below which values are subnormal")


class HistogramOut(BaseModel):
    run: str
    layer: str
    site: str
    rank: int | None = Field(description="null: summed over the ranks (sum_over_ranks)")
    start: int | None
    end: int | None
    binade_lo: int = Field(description="bin j counts 2^(binade_lo + j) <= |x| < 2^(binade_lo + j + 1); the first "
                                       "bin also takes smaller nonzero values, the last larger ones")
    bins: int
    per_column: int = Field(description="histogram steps summed per column")
    step: list[int] = Field(description="first step of each column")
    step_last: list[int]
    counts: list[list[int]] = Field(description="counts[column][bin]")
    scale_min: list[float | None] = Field(description="smallest scale in use over the column (null: none reported)")
    scale_max: list[float | None]
    limits: HistogramLimits | None = Field(description="null when no FP8 format applies (the output site, or "
                                                       "format=none)")


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


class Escalation(BaseModel):
    step: int = Field(description="step at which the severity rose")
    severity: Severity = Field(description="the severity from that step on")
    previous: Severity | None = Field(None, alias="from", description="the severity before (null: not recorded)")


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
    escalations: list[Escalation] = Field(default_factory=list,
                                          description="every rise of severity after the alert fired, in step "
                                                      "order (fired_step and severity tell where it started)")
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


class RunAlertsAcked(BaseModel):
    run: str
    acknowledged: list[int] = Field(description="ids of the alerts this request acknowledged (not those "
                                                "acknowledged before)")


# -- comparison (GET /api/v1/compare/...) --------------------------------------------------------------------


class HeatmapDiffOut(BaseModel):
    runs: list[str] = Field(description="[base, other]")
    stat: str
    site: str
    agg: Literal["max", "min", "mean", "last"]
    mode: Literal["difference", "log10_ratio"]
    layers: list[str] = Field(description="the layers both runs have, in the base run's order")
    edges: list[int] = Field(description="column i covers steps [edges[i], edges[i+1]), over the steps both runs have")
    bucket_width: int
    values: list[list[JsonFloat]] = Field(description="other - base (or log10(other / base)); null: either run "
                                                      "has nothing there; \"NaN\": either value is non-finite")
    only_in: dict[str, list[str]] = Field(description="run -> its layers the other run lacks")


class ScalarGap(BaseModel):
    scalar: str
    step: list[int] = Field(description="steps both runs have (bucket starts when downsampled)")
    reference: list[JsonFloat]
    other: list[JsonFloat]
    gap: list[JsonFloat] = Field(description="other - reference; null where either is missing or non-finite")
    bucket_width: int


class ParityPair(BaseModel):
    reference: str = Field(description="the run with the reference value")
    other: str
    value: str = Field(description="the other run's value of the key")
    gap: ScalarGap


class ParityOut(BaseModel):
    key: str
    reference: str | None = Field(description="the key's value the pairs are measured against")
    keys: list[str] = Field(description="config keys whose values differ among the runs considered")
    pairs: list[ParityPair]
    more_pairs: int = Field(description="pairs left out (at most 32 are returned)")
    unpaired: list[str] = Field(description="runs with no partner: no run equal but for the key")
