"""docs/wire-format.md and the server cannot drift: the doc's example is posted to the ingest API, and every
field and name of the wire contract in the code must appear in the doc."""

import gzip
import json
import math
import re
from pathlib import Path

import httpx
import msgpack
import pytest
from sqlalchemy import text

from fp8mon.agent.wire import (
    LOG2_HIST_BINS,
    LOG2_HIST_HI,
    LOG2_HIST_LO,
    SITES,
    TENSOR_STATS,
    WELL_KNOWN_SCALARS,
    WIRE_VERSION,
)
from fp8mon.monitor.codec import JSON_TYPES, MSGPACK_TYPES
from fp8mon.monitor.settings import Settings
from fp8mon.monitor.storage import SqlAlchemyStore as Store
from fp8mon.monitor.wire import (
    MAX_RECORDS_PER_BLOCK,
    IngestBatch,
    IngestResult,
    RunMeta,
    ScalarBlock,
    TensorBlock,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"
TEXT = DOC.read_text(encoding="utf-8")


def example(tag: str) -> str:
    match = re.search(rf"<!-- wire-example: {tag} -->\s*```json\n(.*?)\n```", TEXT, re.S)
    assert match, f"no ```json block after <!-- wire-example: {tag} --> in {DOC}"
    return match.group(1)


def _floats(value):
    """JSON's NaN/Infinity strings as the floats msgpack carries."""
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return value


def _post(client, data: bytes, content_type: str, **headers) -> httpx.Response:
    return client.post("/api/v1/ingest", content=data, headers={"content-type": content_type, **headers})


def test_the_documented_example_is_accepted_as_documented(client, database_url):
    raw = example("batch")
    expected = json.loads(example("response"))

    first = _post(client, raw.encode(), "application/json")
    assert first.status_code == 200, first.text
    got = first.json()
    assert set(got) == set(expected) == set(IngestResult.model_fields)
    assert {k: v for k, v in got.items() if k != "run_id"} == {k: v for k, v in expected.items() if k != "run_id"}

    again = _post(client, raw.encode(), "application/json").json()
    assert again["duplicate"] is True
    assert (again["tensor_records"], again["scalar_records"], again["values"]) == (0, 0, 0)

    # The same batch as the agent sends it: msgpack with real floats, gzip, under a new batch id.
    batch = _floats(json.loads(raw))
    batch["batch_id"] += "-msgpack"
    r = _post(client, gzip.compress(msgpack.packb(batch)), "application/msgpack", **{"content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert r.json()["duplicate"] is False and r.json()["values"] == expected["values"]

    # NaN in both JSON spellings, null and Infinity are stored as the doc says.
    store = Store(database_url)
    try:
        with store.engine.connect() as conn:
            rms, kurt, kurt_c, scale = conn.execute(text(
                "select t.rms, t.kurtosis, t.kurtosis_central, t.scale from tensor_stats t "
                "join tensor_series s on s.id = t.series_id "
                "where s.layer = 'blocks.0.attn.qkv' and s.site = 'grad_output'")).one()
            grad_norm = conn.execute(text(
                "select v.value from scalars v join scalar_series s on s.id = v.series_id "
                "where s.name = 'grad_norm'")).scalar_one()
            reduced = conn.execute(text("select count(*) from tensor_stats where rank = -1")).scalar_one()
    finally:
        store.close()
    assert math.isnan(float(rms)) and math.isnan(float(kurt)) and kurt_c is None and float(scale) > 1e9
    assert float(grad_norm) == math.inf
    assert reduced == 1


def test_the_example_uses_every_statistic_and_a_full_histogram():
    batch = json.loads(example("batch"))
    IngestBatch.model_validate(batch)
    assert list(batch["tensors"]["stats"]) == list(TENSOR_STATS)
    assert [len(h) for h in batch["tensors"]["log2_hist"] if h is not None] == [LOG2_HIST_BINS]


@pytest.mark.parametrize("model", [IngestBatch, RunMeta, TensorBlock, ScalarBlock, IngestResult])
def test_every_field_is_documented(model):
    missing = [name for name in model.model_fields if f"`{name}`" not in TEXT]
    assert not missing, f"{model.__name__} fields not in {DOC.name}: {missing}"


def test_every_name_and_limit_is_documented():
    for name in (*SITES, *TENSOR_STATS, *WELL_KNOWN_SCALARS, *MSGPACK_TYPES, *JSON_TYPES):
        assert f"`{name}`" in TEXT, name
    for status in ("running", "finished", "failed", "diverged"):
        assert f'`"{status}"`' in TEXT, status
    assert f"version {WIRE_VERSION}" in TEXT and f'"version": {WIRE_VERSION}' in TEXT
    assert f"{LOG2_HIST_HI} − ({LOG2_HIST_LO})".replace("-", "−") in TEXT and f"**{LOG2_HIST_BINS}**" in TEXT
    assert f"{MAX_RECORDS_PER_BLOCK:,}" in TEXT
    assert str(Settings.model_fields["max_request_bytes"].default) in TEXT


def test_statistics_table_is_in_storage_order():
    table = TEXT.split("Statistics (`TENSOR_STATS`", 1)[1].split("\n\n", 2)[1]
    names = re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.M)
    assert names == list(TENSOR_STATS)
