"""The ingest contract (docs/wire-format.md) as pydantic models: what an agent POSTs to /api/v1/ingest and
what it gets back. Columnar blocks, so a batch of thousands of records validates and stores without a Python
object per value. The REST query responses are in monitor.responses.
"""

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from fp8mon.agent.wire import (
    LOG2_HIST_BINS,
    MAX_LAYER_NAME,
    MAX_RUN_ID,
    MAX_RUN_NAME,
    MAX_SCALAR_NAME,
    MAX_TAG,
    RESUME_MODES,
    RUN_ID_PATTERN,
    RUN_NAME_PATTERN,
    SCALAR_NAME_PATTERN,
    SITES,
    TAG_KEY_PATTERN,
    TAG_VALUE_PATTERN,
    TENSOR_STATS,
    WIRE_VERSION,
    bad_path_segments,
)

# Text the databases store: no control characters (PostgreSQL's text cannot hold NUL; the rest only hides
# names from people); checked per element in pydantic-core's Rust regex engine.
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
MAX_CONFIG_DEPTH = 32


def path_safe(name: str) -> str:
    """A name that may travel in a URL path (``bad_path_segments``)."""
    if bad_path_segments(name):
        raise ValueError(f"{name!r} has an empty, '.' or '..' path segment; use a name without them")
    return name


RunName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_RUN_NAME, pattern=RUN_NAME_PATTERN),
                    AfterValidator(path_safe)]
RunId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_RUN_ID, pattern=RUN_ID_PATTERN)]
Resume = Literal[RESUME_MODES]  # type: ignore[valid-type]
LayerName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LAYER_NAME, pattern=PRINTABLE)]
ScalarName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SCALAR_NAME, pattern=SCALAR_NAME_PATTERN)]
TagKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TAG, pattern=TAG_KEY_PATTERN)]
TagValue = Annotated[str, StringConstraints(pattern=TAG_VALUE_PATTERN)]
BatchId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=PRINTABLE)]
HistCount = Annotated[int, Field(ge=0, le=2**63 - 1)]  # stored as int64
Step = Annotated[int, Field(ge=0, le=2**62)]
Rank = Annotated[int, Field(ge=-1, le=32767)]  # -1: statistics reduced over all ranks
Value = float | None  # None: not reported; NaN and +-Inf are values and are stored as such
RunStatus = Literal["running", "finished", "failed", "diverged"]
FINAL_STATUSES = ("finished", "failed", "diverged")  # a run in one of these has ended

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
        if n == 0:
            raise ValueError("block has no records; leave it out instead")
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
    log2_hist: list[Annotated[list[HistCount],
                              Field(min_length=LOG2_HIST_BINS, max_length=LOG2_HIST_BINS)] | None] | None = None

    @model_validator(mode="after")
    def _same_lengths(self):
        columns = {"step": self.step, "layer": self.layer, "site": self.site, "rank": self.rank}
        columns.update({f"stats.{k}": v for k, v in self.stats.items()})
        if self.log2_hist is not None:
            columns["log2_hist"] = self.log2_hist
        self._n = self._check_lengths(columns)
        _check_paths("layer", self.layer)
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
        _check_paths("name", self.name)
        return self

    def __len__(self) -> int:
        return self._n


def _check_paths(column: str, names: list[str]) -> None:
    """path_safe over the distinct names of a column (a batch repeats a few hundred names many times)."""
    for name in set(names):
        try:
            path_safe(name)
        except ValueError as exc:
            raise ValueError(f"{column}.{names.index(name)}: {exc}") from None


def json_config(value: Any, where: str = "config", depth: int = 0) -> Any:
    """A run's config as JSON both databases store alike: non-finite floats become the strings "NaN",
    "Infinity", "-Infinity" (as the API writes them); anything that is not JSON (msgpack bytes) is refused,
    naming where."""
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_CONFIG_DEPTH} levels")
    if isinstance(value, float):
        return finite_or_none(value)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a string")
            out[key] = json_config(item, f"{where}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [json_config(item, f"{where}.{i}", depth + 1) for i, item in enumerate(value)]
    raise ValueError(f"{where}: a {type(value).__name__} is not a JSON value")


JsonConfig = Annotated[dict, AfterValidator(json_config)]


class RunMeta(_Strict):
    config: JsonConfig | None = None
    tags: dict[TagKey, TagValue] | None = None
    status: RunStatus | None = None


class IngestBatch(_Strict):
    version: Literal[WIRE_VERSION] = Field(description="wire format version; this server speaks 1")  # type: ignore[valid-type]
    batch_id: BatchId = Field(
        description="client-chosen id; a batch sent again with the same id is stored once")
    run: RunName
    run_id: RunId | None = Field(
        default=None, description="the run's unique id; a batch with an id goes to the run of that id")
    resume: Resume = Field(
        default="allow", description="allow: the run of that id (or, without run_id, of that name), created if "
                                     "missing; must: refused (409) if missing; never: a new run, needs run_id")
    run_meta: RunMeta | None = None
    tensors: TensorBlock | None = None
    scalars: ScalarBlock | None = None
    sent_at: float | None = None

    @model_validator(mode="after")
    def _not_empty(self):
        if self.tensors is None and self.scalars is None and self.run_meta is None:
            raise ValueError("batch carries nothing: give tensors, scalars or run_meta")
        if self.resume == "never" and self.run_id is None:
            raise ValueError("resume 'never' needs run_id: the id that every batch of the new run carries")
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
    run: str = Field(description="the name the run is stored under: as sent, or with a suffix (-2, -3, ...) "
                                 "when another run had the name")
    run_id: int
    run_uid: str = Field(description="the run's unique id: the batch's run_id, or one the server chose")
    duplicate: bool = Field(description="true when this batch id was already stored; nothing was written")
    tensor_records: int
    scalar_records: int
    values: int


class ResumeQuery(_Strict):
    """POST /api/v1/ingest/resume: which run a batch with this name (and id) would continue."""

    run: RunName
    run_id: RunId | None = None


class ResumePoint(BaseModel):
    exists: bool = Field(description="false: no such run; a batch with resume 'allow' would create it")
    run: str | None = None
    run_uid: str | None = None
    last_step: int | None = Field(default=None, description="the run's last stored step; a resumed run "
                                                            "continues after it")


def finite_or_none(x: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: the API writes them as the strings "NaN", "Infinity", "-Infinity"."""
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
