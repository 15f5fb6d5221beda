"""Ingest under concurrency and the bulk write paths (SQLite executemany + group commit, PostgreSQL COPY):
every batch stored exactly once, no 5xx, last write wins, values round-trip exactly, kill -9 loses nothing
acknowledged."""

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from fp8mon.agent.wire import CLIENT_HEADER, LOG2_HIST_BINS
from fp8mon.monitor.storage import SqlAlchemyStore as Store
from fp8mon.monitor.storage import StorageUnavailable
from fp8mon.monitor.storage.ingest import _Job
from fp8mon.monitor.wire import IngestBatch

SITES = ("input", "weight", "output", "grad_output", "grad_weight")
LAYERS = tuple(f"blocks.{i}.mlp.fc1" for i in range(8))


def tensor_batch(batch_id, run, rank, steps, layers=LAYERS, stats=("amax", "rms", "kurtosis")):
    n = len(steps) * len(layers) * len(SITES)
    return {
        "version": 1, "batch_id": batch_id, "run": run,
        "tensors": {
            "step": [s for s in steps for _ in layers for _ in SITES],
            "layer": [layer for _ in steps for layer in layers for _ in SITES],
            "site": list(SITES) * (len(steps) * len(layers)),
            "rank": rank,
            "stats": {name: [float(rank * 1000 + i + k) for i in range(n)] for k, name in enumerate(stats)},
        },
        "scalars": {"step": list(steps), "name": ["loss"] * len(steps), "value": [float(rank)] * len(steps),
                    "rank": rank},
    }


def post(client, url, body):
    return client.post(f"{url}/api/v1/ingest", content=msgpack.packb(body),
                       headers={"content-type": "application/msgpack", CLIENT_HEADER: "tests"})


def query(url, sql, **params):
    s = Store(url)
    try:
        with s.engine.connect() as conn:
            return conn.execute(text(sql), params).all()
    finally:
        s.close()


def test_concurrent_clients_on_one_run_store_every_batch_exactly_once(live_server):
    """Eight clients (ranks) start a new run at once and send retries too: no 5xx, each batch stored once,
    one catalogue entry per layer x site."""
    clients, batches, steps = 8, 6, 4
    barrier = threading.Barrier(clients)

    def client(rank):
        replies = []
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            for b in range(batches):
                body = tensor_batch(f"r{rank}-b{b}", "shared", rank, range(b * steps, (b + 1) * steps))
                replies.append(post(http, live_server.url, body))
                if b % 2 == 0:  # a retry, as after a lost response
                    replies.append(post(http, live_server.url, body))
        return replies

    with ThreadPoolExecutor(clients) as pool:
        replies = [r for rs in pool.map(client, range(clients)) for r in rs]
    assert {r.status_code for r in replies} == {200}, [r.text for r in replies if r.status_code != 200][:3]
    assert sum(r.json()["duplicate"] for r in replies) == clients * math.ceil(batches / 2)
    acked = sum(r.json()["values"] for r in replies)
    per_record = 3
    records = clients * batches * steps * len(LAYERS) * len(SITES)
    assert acked == records * per_record + clients * batches * steps
    url = live_server.database_url
    assert query(url, "select count(*) from tensor_stats")[0][0] == records
    assert query(url, "select count(*) from scalars")[0][0] == clients * batches * steps
    assert query(url, "select count(*) from ingest_batches")[0][0] == clients * batches
    series = len(LAYERS) * len(SITES)
    assert query(url, "select count(*), count(distinct ordinal) from tensor_series")[0] == (series, series)
    assert query(url, "select count(*) from runs")[0][0] == 1
    assert query(url, "select first_step, last_step from runs")[0] == (0, batches * steps - 1)


def test_concurrent_first_batches_with_different_layers_get_unique_ordinals(live_server):
    """Ranks that watch different layers register their catalogue entries at once."""
    barrier = threading.Barrier(4)

    def client(rank):
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            layers = [f"rank{rank}.layer{i}" for i in range(6)]
            return post(http, live_server.url, tensor_batch(f"r{rank}", "split", rank, [0, 1], layers=layers))

    with ThreadPoolExecutor(4) as pool:
        assert [r.status_code for r in pool.map(client, range(4))] == [200] * 4
    assert query(live_server.database_url, "select count(*), count(distinct ordinal) from tensor_series")[0] == \
        (4 * 6 * len(SITES),) * 2


def test_simultaneous_retries_of_one_batch_store_it_once(live_server):
    body = tensor_batch("same", "run-r", 0, range(5))
    barrier = threading.Barrier(6)

    def send(_):
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            return post(http, live_server.url, body)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(send, range(6)))
    assert [r.status_code for r in replies] == [200] * 6
    assert sorted(r.json()["duplicate"] for r in replies) == [False] + [True] * 5
    assert query(live_server.database_url, "select count(*) from tensor_stats")[0][0] == 5 * len(LAYERS) * len(SITES)


def test_last_write_wins_replaces_the_whole_row(store, database_url):
    """A key written again takes the new record: statistics the new batch does not carry become NULL."""
    store.ingest(IngestBatch.model_validate(tensor_batch("b1", "run-w", 0, [7], layers=LAYERS[:1],
                                                         stats=("amax", "kurtosis"))))
    second = tensor_batch("b2", "run-w", 0, [7], layers=LAYERS[:1], stats=("amax",))
    second["tensors"]["stats"]["amax"] = [100.0 + i for i in range(len(SITES))]
    store.ingest(IngestBatch.model_validate(second))
    rows = query(database_url, "select s.site, t.amax, t.kurtosis from tensor_stats t "
                               "join tensor_series s on s.id = t.series_id order by s.ordinal")
    assert [(site, float(a), k) for site, a, k in rows] == [(site, 100.0 + i, None) for i, site in enumerate(SITES)]


def test_a_key_repeated_inside_a_batch_keeps_its_last_record(store, database_url):
    body = {"version": 1, "batch_id": "dup", "run": "run-d",
            "tensors": {"step": [5, 3, 5, 3, 4], "layer": ["l0"] * 5, "site": ["input"] * 5,
                        "stats": {"amax": [1.0, 2.0, 3.0, 4.0, 5.0]}},
            "scalars": {"step": [1, 1], "name": ["loss", "loss"], "value": [1.0, 2.0]}}
    result = store.ingest(IngestBatch.model_validate(body))
    assert result.tensor_records == 5 and not result.duplicate
    url = database_url
    assert [(s, float(a)) for s, a in query(url, "select step, amax from tensor_stats order by step")] == \
        [(3, 4.0), (4, 5.0), (5, 3.0)]
    assert [float(v) for (v,) in query(url, "select value from scalars")] == [2.0]


def test_gaps_nan_inf_and_histograms_round_trip_exactly(store, database_url):
    """Column mixes of numbers, None (NULL), NaN and +-Inf, and log2 histograms with gaps, through the bulk path."""
    values = [1.0, None, math.nan, math.inf, -math.inf, 5e-324, 1.7976931348623157e308, -0.0, 0.1, None]
    n = len(values)
    hist = [list(range(i, i + LOG2_HIST_BINS)) if i % 3 else None for i in range(n)]
    body = {"version": 1, "batch_id": "mix", "run": "run-m",
            "tensors": {"step": list(range(n)), "layer": ["l0"] * n, "site": ["weight"] * n, "rank": -1,
                        "stats": {"amax": values, "scale": values[::-1], "numel": [float(2**53)] * n},
                        "log2_hist": hist},
            "scalars": {"step": list(range(n)), "name": ["grad_norm"] * n, "value": values}}
    store.ingest(IngestBatch.model_validate(body))
    url = database_url
    rows = query(url, "select step, rank, amax, scale, numel, log2_hist, kurtosis from tensor_stats order by step")

    def same(a, b):
        if a is None or b is None:
            return a is None and b is None
        a = float(a)
        return (math.isnan(a) and math.isnan(b)) or a == b  # SQLite keeps -0.0 as 0.0

    assert [r.step for r in rows] == list(range(n)) and {r.rank for r in rows} == {-1}
    assert all(same(r.amax, v) for r, v in zip(rows, values))
    assert all(same(r.scale, v) for r, v in zip(rows, values[::-1]))
    assert all(float(r.numel) == 2**53 and r.kurtosis is None for r in rows)
    for r, h in zip(rows, hist):
        assert (r.log2_hist is None) if h is None else (list(memoryview(bytes(r.log2_hist)).cast("q")) == h)
    scalars = [v for (v,) in query(url, "select value from scalars order by step")]
    assert all(same(a, b) for a, b in zip(scalars, values))


def fail_batch(store, monkeypatch, batch_id):
    """Make the store's write of the batch `batch_id` raise, inside whatever transaction it is part of."""
    original = store._writer._write_batch

    def write_batch(conn, batch, *args):
        if batch.batch_id == batch_id:
            raise RuntimeError("boom")
        return original(conn, batch, *args)

    monkeypatch.setattr(store._writer, "_write_batch", write_batch)


def test_a_failing_batch_fails_alone_when_batches_share_a_commit(store, database_url, monkeypatch):
    """On SQLite, batches that wait for the writer are committed together; one that fails must not take
    the others down (they are written again one by one)."""
    fail_batch(store, monkeypatch, "bad")
    ids = ["a", "bad", "c", "d"]
    outcomes: dict[str, object] = {}

    def ingest(batch_id):
        try:
            outcomes[batch_id] = store.ingest(IngestBatch.model_validate(
                tensor_batch(batch_id, "run-g", ids.index(batch_id), [1, 2], layers=LAYERS[:2])))
        except RuntimeError as exc:
            outcomes[batch_id] = exc

    threads = [threading.Thread(target=ingest, args=(i,)) for i in ids]
    with store.db.write_lock:  # hold the writer so that all four queue up for one group
        for t in threads:
            t.start()
        if store.dialect == "sqlite":
            for _ in range(500):
                if len(store._writer._queue) == len(ids):
                    break
                time.sleep(0.01)
            assert len(store._writer._queue) == len(ids)
    for t in threads:
        t.join(30)
    assert isinstance(outcomes["bad"], RuntimeError)
    assert all(not outcomes[i].duplicate for i in ids if i != "bad")
    url = database_url
    assert sorted(b for (b,) in query(url, "select batch_id from ingest_batches")) == ["a", "c", "d"]
    assert query(url, "select count(*) from tensor_stats")[0][0] == 3 * 2 * 2 * len(SITES)


def test_a_thread_whose_group_failed_without_its_batch_writes_its_batch_before_it_returns(store, database_url,
                                                                                          monkeypatch):
    """SQLite: the thread that gets the writer writes the oldest queued batches, which may not include its own.
    When that group fails before it reaches the thread's batch, the thread must go on writing, not return with
    its batch still queued (ingest returned None, with nothing committed)."""
    if store.dialect != "sqlite":
        pytest.skip("the group commit is SQLite's")
    fail_batch(store, monkeypatch, "bad")
    # another thread's batch, queued first, whose thread has not got the writer yet
    waiting = _Job(IngestBatch.model_validate(tensor_batch("bad", "run-q", 0, [1], layers=LAYERS[:1])))
    store._writer._queue.append(waiting)
    result = store.ingest(IngestBatch.model_validate(tensor_batch("mine", "run-q", 1, [1], layers=LAYERS[:1])))
    assert result is not None and result.batch_id == "mine" and not result.duplicate
    assert waiting.done and isinstance(waiting.error, RuntimeError)
    assert [b for (b,) in query(database_url, "select batch_id from ingest_batches")] == ["mine"]


def test_a_storage_error_reaches_the_caller_and_the_batch_can_be_retried(store, database_url, monkeypatch):
    """A database that fails before anything is written (the server answers 503): the batch is not stored,
    the error is raised (never a silent None), and a retry goes through."""
    body = IngestBatch.model_validate(tensor_batch("e1", "run-e", 0, [1], layers=LAYERS[:1]))

    def unavailable(*args, **kwargs):
        raise OperationalError("BEGIN", None, Exception("disk I/O error"))

    monkeypatch.setattr(store.engine, "begin", unavailable)
    with pytest.raises(StorageUnavailable, match="OperationalError"):
        store.ingest(body)
    monkeypatch.undo()
    assert not store.ingest(body).duplicate
    assert store.ingest(body).duplicate
    assert query(database_url, "select count(*) from tensor_stats")[0][0] == len(SITES)


def test_kill_9_under_concurrent_load_loses_no_acknowledged_batch(server_factory):
    """Clients post while the server is killed: every acknowledged batch is there after a restart, and
    every stored batch is complete (all or nothing)."""
    server = server_factory().start()
    steps, clients = 3, 4
    acked: list[tuple[int, int]] = []
    stop = threading.Event()

    def client(rank):
        with httpx.Client(timeout=30) as http:
            b = 0
            while not stop.is_set():
                body = tensor_batch(f"k{rank}-{b}", "run-k", rank, range(b * steps, (b + 1) * steps))
                try:
                    r = post(http, server.url, body)
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    acked.append((rank, b))
                b += 1

    threads = [threading.Thread(target=client, args=(rank,)) for rank in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.kill()
    stop.set()
    for t in threads:
        t.join(30)
    server.start()  # recovers the WAL (SQLite) / nothing to do (PostgreSQL)
    server.stop()
    url = server.database_url
    stored = {b for (b,) in query(url, "select batch_id from ingest_batches")}
    assert {f"k{rank}-{b}" for rank, b in acked} <= stored
    per_batch = steps * len(LAYERS) * len(SITES)
    counts = query(url, "select rank, step / :k as b, count(*) from tensor_stats group by rank, step / :k", k=steps)
    assert {(f"k{rank}-{b}", n) for rank, b, n in counts} == {(batch_id, per_batch) for batch_id in stored}
