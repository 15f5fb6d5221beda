"""fp8mon.monitor.export: a stored run, exported as wire batches and ingested into an empty store, reads back
the same (statistics with NaN, nulls, histograms, several ranks, scalars, config, tags and status)."""

import math

from fp8mon.agent.wire import LOG2_HIST_BINS, TENSOR_STATS
from fp8mon.monitor.export import export_run
from fp8mon.monitor.storage.database import fetch
from fp8mon.monitor.wire import IngestBatch

NAN = float("nan")


def _batches():
    hist = [0] * LOG2_HIST_BINS
    hist[40] = 12
    records = [("blocks.0.attn.qkv", "input", 0), ("blocks.0.attn.qkv", "input", 1),
               ("blocks.0.mlp.fc2", "grad_output", 0)]
    out = []
    for step in range(0, 6, 2):
        stats = {name: [float(step + i) for i in range(len(records))] for name in TENSOR_STATS}
        stats["numel"] = [4096] * len(records)
        stats["nonfinite"] = [0, 0, 3 if step == 4 else 0]
        stats["kurtosis"] = [3.0, NAN if step == 2 else 3.5, float("inf")]
        stats["amax_history_max"] = [None] * len(records)
        out.append({"version": 1, "batch_id": f"b{step}", "run": "src",
                    "tensors": {"step": step, "layer": [r[0] for r in records], "site": [r[1] for r in records],
                                "rank": [r[2] for r in records], "stats": stats,
                                "log2_hist": [hist, None, hist]},
                    "scalars": {"step": [step, step, step + 1], "name": ["loss", "grad_norm", "loss"],
                                "value": [3.0 - step / 10, NAN if step == 4 else 1.0, 2.9 - step / 10]}})
    out[0]["run_meta"] = {"config": {"lr": 0.1, "model": {"n_layer": 2}}, "tags": {"arch": "fog"}}
    out[-1]["run_meta"] = {"status": "diverged"}
    return out


def _snapshot(store, run):
    with store.db.reading() as conn:
        meta = fetch(conn, "SELECT status, config, tags FROM runs WHERE name = :run", {"run": run})
        cols = ", ".join(f"t.{c}" for c in (*TENSOR_STATS, "log2_hist"))
        tensors = fetch(conn, f"SELECT s.layer, s.site, s.ordinal, t.rank, t.step, {cols} FROM tensor_stats t JOIN "
                              "tensor_series s ON s.id = t.series_id JOIN runs r ON r.id = s.run_id "
                              "WHERE r.name = :run ORDER BY t.step, t.rank, s.ordinal", {"run": run})
        scalars = fetch(conn, "SELECT s.name, t.rank, t.step, t.value FROM scalars t JOIN scalar_series s ON "
                              "s.id = t.series_id JOIN runs r ON r.id = s.run_id WHERE r.name = :run "
                              "ORDER BY t.step, s.name", {"run": run})

    def norm(v):
        if isinstance(v, (bytes, memoryview)):
            return bytes(v)
        if isinstance(v, str) and v == "NaN":  # SQLite keeps NaN as text
            return "nan"
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        return v

    status, config, tags = meta[0]
    return status, config, tags, [tuple(map(norm, r)) for r in tensors], [tuple(map(norm, r)) for r in scalars]


def test_an_exported_run_round_trips_through_ingest(store):
    for batch in _batches():
        store.ingest(IngestBatch.model_validate(batch))
    exported = export_run(store, "src", steps_per_batch=2)
    assert [b["batch_id"] for b in exported] == ["export-0-1", "export-2-3", "export-4-5"]
    for batch in exported:
        batch["run"] = "copy"
        store.ingest(IngestBatch.model_validate(batch))
    src, copy = _snapshot(store, "src"), _snapshot(store, "copy")
    assert src[0] == copy[0] == "diverged"
    assert src[1:] == copy[1:]
    assert len(src[3]) == 9 and len(src[4]) == 9


def test_export_can_leave_statistics_and_histograms_out(store):
    for batch in _batches():
        store.ingest(IngestBatch.model_validate(batch))
    exported = export_run(store, "src", steps_per_batch=100, stats=("amax", "kurtosis"), hist=False)
    assert len(exported) == 1
    block = exported[0]["tensors"]
    assert set(block["stats"]) == {"amax", "kurtosis"} and "log2_hist" not in block
    assert block["step"] == [0, 0, 0, 2, 2, 2, 4, 4, 4] and block["rank"][:3] == [0, 0, 1]
    kurt = block["stats"]["kurtosis"]
    assert math.isinf(kurt[1]) and math.isnan(kurt[5])  # step 2: rank 0 qkv, rank 0 fc2, rank 1 qkv


def test_fp8mon_export_writes_the_batches(store, database_url, tmp_path, capsys):
    import gzip
    import json

    from fp8mon.cli import main

    for batch in _batches():
        store.ingest(IngestBatch.model_validate(batch))
    out = tmp_path / "src.json.gz"
    assert main(["export", "src", "--database-url", database_url, "--out", str(out), "--no-hist"]) == 0
    batches = json.loads(gzip.decompress(out.read_bytes()))
    assert [b["batch_id"] for b in batches] == ["export-0-5"]
    assert "log2_hist" not in batches[0]["tensors"] and batches[0]["run_meta"]["status"] == "diverged"
    assert main(["export", "missing", "--database-url", database_url, "--out", str(out)]) == 1
    assert "not found" in capsys.readouterr().err
