"""The rollup pyramid (storage.rollup) on SQLite and PostgreSQL: every bucket of every level against a
brute-force reference, NaN/Inf semantics, late batches, idempotence, concurrent compactors, chunking."""

import math
import threading
import time

import numpy as np
import pytest
from sqlalchemy import text

from fp8mon.monitor.compactor import Compactor
from fp8mon.monitor.models import ROLLUP_WIDTHS
from fp8mon.monitor.storage import SqlAlchemyStore as Store
from fp8mon.monitor.storage import rollup

LAYERS = ["blocks.1.mlp", "blocks.0.attn"]


def stored_rollups(store, table="tensor_rollups", stat="amax", run="r"):
    """{(series key, rank, width, bucket): aggregates} of one run; series key "layer/site" or the scalar name."""
    if table == "tensor_rollups":
        names = "SELECT s.id, s.layer || '/' || s.site FROM tensor_series s"
    else:
        names = "SELECT s.id, s.name FROM scalar_series s"
    with store.engine.connect() as conn:
        key_of = dict(conn.execute(text(f"{names} JOIN runs r ON r.id = s.run_id WHERE r.name = :n"), {"n": run}).all())
        rows = conn.execute(text(f"SELECT series_id, rank, width, bucket, step_first, step_last, count, {stat}_min, "
                                 f"{stat}_max, {stat}_sum, {stat}_n, {stat}_last FROM {table}")).all()
    out = {}
    for sid, rank, width, bucket, sf, sl, count, mn, mx, sm, n, last in rows:
        if sid not in key_of:
            continue
        f = [None if v is None else float(v) for v in (mn, mx, sm, last)]
        out[(key_of[sid], rank, width, bucket)] = {"step_first": sf, "step_last": sl, "count": count, "min": f[0],
                                                   "max": f[1], "sum": f[2], "n": n, "last": f[3]}
    return out


def run_state(store, run="r"):
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT rollup_until, rollup_dirty_from, last_step FROM runs WHERE name = :n"),
                            {"n": run}).one()


def expected_rollups(kit, raw: dict, until: int):
    """raw: {(key, rank): {step: value}} -> the buckets every level must hold below `until`."""
    out = {}
    for (key, rank), by_step in raw.items():
        for width in ROLLUP_WIDTHS:
            cover = until // width * width
            buckets: dict[int, list] = {}
            for step, value in by_step.items():
                if step < cover:
                    buckets.setdefault(step // width, []).append((step, value))
            for bucket, pairs in buckets.items():
                ref = kit.bucket(pairs)
                out[(key, rank, width, bucket)] = {k: ref[k] for k in ("step_first", "step_last", "count", "min", "max",
                                                                      "sum", "n", "last")}
    return out


def assert_rollups_equal(kit, got, want):
    assert set(got) == set(want), (sorted(set(got) ^ set(want))[:10])
    for key, ref in want.items():
        row = got[key]
        for name, value in ref.items():
            assert kit.same(row[name], value), (key, name, row[name], value)


def mixed_values(kit, rng, n_steps, n_layers):
    """Dyadic values with NaN, +-Inf and unreported (None) entries sprinkled in."""
    vals = kit.dyadic(rng, (n_steps, n_layers)).astype(object)
    for i, j in zip(rng.integers(0, n_steps, 12), rng.integers(0, n_layers, 12)):
        vals[i, j] = math.nan
    for i, j in zip(rng.integers(0, n_steps, 12), rng.integers(0, n_layers, 12)):
        vals[i, j] = math.inf
    for i, j in zip(rng.integers(0, n_steps, 12), rng.integers(0, n_layers, 12)):
        vals[i, j] = -math.inf
    for i, j in zip(rng.integers(0, n_steps, 40), rng.integers(0, n_layers, 40)):
        vals[i, j] = None
    # a bucket holding +Inf and -Inf together: its sum (and mean) is NaN, min/max are the infinities
    vals[40, 0], vals[41, 0] = math.inf, -math.inf
    return vals


def raw_of(layers, steps, vals, site="input", rank=0):
    return {(f"{layer}/{site}", rank): {s: vals[i][j] for i, s in enumerate(steps)} for j, layer in enumerate(layers)}


def test_every_level_matches_brute_force(store, kit):
    rng = np.random.default_rng(1)
    n = rollup.HORIZON_LAG + 16384 + 700  # enough for one complete bucket of the widest level
    steps = range(n)
    vals = mixed_values(kit, rng, n, len(LAYERS))
    kit.ingest(store, "r", steps=steps, layers=LAYERS, values={"amax": vals}, batch_steps=4000)
    # a second rank on one layer, sparser (every 3rd step)
    steps1 = list(range(0, 5000, 3))
    vals1 = kit.dyadic(rng, (len(steps1), 1))
    kit.ingest(store, "r", steps=steps1, layers=LAYERS[:1], values={"amax": vals1}, rank=1)
    report = store.compact()
    until, dirty, last = run_state(store)
    assert until == (last - rollup.HORIZON_LAG) // 16 * 16 and dirty is None
    assert report.runs == 1 and report.buckets > 0
    raw = raw_of(LAYERS, steps, vals)
    raw.update(raw_of(LAYERS[:1], steps1, vals1, rank=1))
    got = stored_rollups(store)
    assert {k[2] for k in got} == set(ROLLUP_WIDTHS)
    assert_rollups_equal(kit, got, expected_rollups(kit, raw, until))
    # the +Inf/-Inf bucket: documented as a NaN sum
    inf_bucket = got[(f"{LAYERS[0]}/input", 0, 16, 2)]
    assert inf_bucket["max"] == math.inf and inf_bucket["min"] == -math.inf and math.isnan(inf_bucket["sum"])


def test_scalars_are_rolled_up_too(store, kit):
    rng = np.random.default_rng(2)
    steps = range(3000)
    loss = list(kit.dyadic(rng, 3000))
    loss[1234] = math.nan
    kit.ingest(store, "r", steps=steps, layers=[], values=None, scalars={"loss": loss})
    store.compact()
    until = run_state(store).rollup_until
    got = stored_rollups(store, "scalar_rollups", "value")
    want = expected_rollups(kit, {("loss", 0): dict(zip(steps, loss))}, until)
    assert_rollups_equal(kit, got, want)
    assert math.isnan(got[("loss", 0, 16, 1234 // 16)]["max"])
    assert math.isnan(got[("loss", 0, 1024, 1)]["min"])


def test_a_spike_and_a_nan_survive_every_level(store, kit):
    n = 20000 + rollup.HORIZON_LAG
    vals = np.ones((n, 1))
    vals[12345, 0] = 1e6
    vals[777, 0] = math.nan
    kit.ingest(store, "r", steps=range(n), layers=["l"], values={"amax": vals}, batch_steps=10000)
    store.compact()
    got = stored_rollups(store)
    for width in ROLLUP_WIDTHS:
        spike = got[("l/input", 0, width, 12345 // width)]
        if 12345 // width != 777 // width:
            assert spike["max"] == 1e6 and spike["min"] == 1.0, width
        nan = got[("l/input", 0, width, 777 // width)]
        assert math.isnan(nan["max"]) and math.isnan(nan["min"]) and math.isnan(nan["sum"]) and nan["n"] == width
        others = [r for (k, rank, w, b), r in got.items() if w == width and b not in (12345 // width, 777 // width)]
        assert all(r["max"] == 1.0 for r in others)


def test_late_batch_below_the_horizon_is_recomputed(store, kit):
    rng = np.random.default_rng(3)
    n = 3000
    vals = kit.dyadic(rng, (n, 2))
    kit.ingest(store, "r", steps=range(n), layers=LAYERS, values={"amax": vals})
    store.compact()
    until = run_state(store).rollup_until
    assert until > 1000
    # a resumed run re-logs steps 500..520 with other values, and a rank-0 layer appears late below the horizon
    late = kit.dyadic(rng, (21, 2)) + 1000
    kit.ingest(store, "r", steps=range(500, 521), layers=LAYERS, values={"amax": late}, batch_prefix="late")
    new_layer = kit.dyadic(rng, (10, 1))
    kit.ingest(store, "r", steps=range(100, 110), layers=["late.layer"], values={"amax": new_layer})
    state = run_state(store)
    assert state.rollup_dirty_from == 100 and state.rollup_until == until
    store.compact()
    state = run_state(store)
    assert state.rollup_dirty_from is None and state.rollup_until == until
    vals[500:521] = late
    raw = raw_of(LAYERS, range(n), vals)
    raw.update(raw_of(["late.layer"], range(100, 110), new_layer))
    assert_rollups_equal(kit, stored_rollups(store), expected_rollups(kit, raw, until))


def test_compaction_is_idempotent_and_chunked(store, kit):
    rng = np.random.default_rng(4)
    vals = kit.dyadic(rng, (2500, 2))
    kit.ingest(store, "r", steps=range(2500), layers=LAYERS, values={"amax": vals})
    # tiny chunks: many transactions, each advancing rollup_until
    report = store.compact(max_rows=100)
    assert report.chunks > 20
    first = stored_rollups(store)
    until = run_state(store).rollup_until
    assert_rollups_equal(kit, first, expected_rollups(kit, raw_of(LAYERS, range(2500), vals), until))
    again = store.compact()
    assert again.runs == 0 and stored_rollups(store) == first
    # forcing a full recompute from step 0 gives the same rows
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET rollup_dirty_from = 0"))
    assert store.compact().chunks == 1
    assert stored_rollups(store) == first


def test_two_compactors_at_once(database_url, kit):
    stores = [Store(database_url) for _ in range(3)]
    try:
        rng = np.random.default_rng(5)
        vals = kit.dyadic(rng, (4000, 2))
        kit.ingest(stores[0], "r", steps=range(4000), layers=LAYERS, values={"amax": vals})
        kit.ingest(stores[0], "other", steps=range(2000), layers=LAYERS, values={"amax": vals[:2000]})
        errors = []

        def work(s, wait):
            try:
                for _ in range(3):
                    s.compact(max_rows=500, wait=wait)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s, wait)) for s, wait in zip(stores[1:], (True, False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        stores[0].compact()  # whatever a busy skip left over
        for run, n in (("r", 4000), ("other", 2000)):
            until = run_state(stores[0], run).rollup_until
            assert until == (n - 1 - rollup.HORIZON_LAG) // 16 * 16
            want = expected_rollups(kit, raw_of(LAYERS, range(n), vals[:n]), until)
            assert_rollups_equal(kit, stored_rollups(stores[0], run=run), want)
        with stores[0].engine.connect() as conn:
            total = conn.execute(text("SELECT count(*) FROM tensor_rollups")).scalar_one()
        assert total == len(stored_rollups(stores[0], run="r")) + len(stored_rollups(stores[0], run="other"))
    finally:
        for s in stores:
            s.close()


def test_background_compactor_thread(store, kit):
    kit.ingest(store, "r", steps=range(500), layers=LAYERS, values={"amax": np.ones((500, 2))})
    compactor = Compactor(store, interval=0.05).start()
    try:
        deadline = time.monotonic() + 20
        while run_state(store).rollup_until == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        compactor.stop()
    assert run_state(store).rollup_until == (499 - rollup.HORIZON_LAG) // 16 * 16


@pytest.mark.parametrize("horizon,dirty,expected", [(0, None, 0), (160, None, 160), (160, 40, 32), (160, 500, 160)])
def test_effective_horizon(horizon, dirty, expected):
    assert rollup.effective_horizon(horizon, dirty) == expected


def test_a_jump_in_steps_costs_no_empty_chunks(store, kit):
    rng = np.random.default_rng(6)
    steps = [*range(0, 300), *range(10**8, 10**8 + 300)]
    vals = kit.dyadic(rng, (len(steps), 2))
    kit.ingest(store, "r", steps=steps, layers=LAYERS, values={"amax": vals})
    report = store.compact(max_rows=1000)  # 500 steps of 2 series per chunk
    assert report.chunks <= 3
    until = run_state(store).rollup_until
    assert until == (10**8 + 299 - rollup.HORIZON_LAG) // 16 * 16
    got = stored_rollups(store)
    assert ("blocks.0.attn/input", 0, 16384, 0) in got
    assert_rollups_equal(kit, got, expected_rollups(kit, raw_of(LAYERS, steps, vals), until))
