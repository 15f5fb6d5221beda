"""The agent's transport against a real server: exactly-once delivery through outages and restarts."""

import socket
import time

import pytest

pytest.importorskip("sqlalchemy", reason="the monitor extra: these tests read what a real server stored")

from sqlalchemy import text  # noqa: E402

from fp8mon.agent.transport import Transport, merge_blocks  # noqa: E402
from fp8mon.monitor.storage import SqlAlchemyStore as Store  # noqa: E402

LAYERS = [f"blocks.{i}.mlp.fc1" for i in range(4)]


def tensor_block(step: int) -> dict:
    return {"step": step, "layer": LAYERS, "site": ["input"] * len(LAYERS), "rank": 0,
            "stats": {"amax": [float(step * 10 + i) for i in range(len(LAYERS))]}}


def stored(database_url, run: str | None = None) -> tuple[list, list]:
    """(step, amax) of every stored tensor row and (step, value) of every scalar: of one run, or of all."""
    store = Store(database_url)
    of_run = "" if run is None else "where r.name = :run "
    try:
        with store.engine.connect() as conn:
            tensors = conn.execute(text("select t.step, t.amax from tensor_stats t join tensor_series ts on "
                                        f"ts.id = t.series_id join runs r on r.id = ts.run_id {of_run}"
                                        "order by t.step, t.amax"), {"run": run}).all()
            scalars = conn.execute(text("select s.step, s.value from scalars s join scalar_series ss on "
                                        f"ss.id = s.series_id join runs r on r.id = ss.run_id {of_run}"
                                        "order by s.step"), {"run": run}).all()
        return [(s, float(a)) for s, a in tensors], [(s, float(v)) for s, v in scalars]
    finally:
        store.close()


def expected(steps):
    return ([(s, float(s * 10 + i)) for s in steps for i in range(len(LAYERS))],
            [(s, float(s)) for s in steps])


def feed(transport, steps):
    for step in steps:
        transport.send_tensors(tensor_block(step))
        transport.send_scalars({"step": step, "name": ["loss"], "value": [float(step)]})


def test_merge_blocks_broadcasts_and_fills_missing_statistics():
    a = {"step": 1, "layer": ["x", "y"], "site": ["input", "input"], "stats": {"amax": [1.0, 2.0]}}
    b = {"step": [2], "layer": ["x"], "site": ["weight"], "rank": 3, "stats": {"rms": [0.5]}}
    merged = merge_blocks([a, b], ("step", "layer", "site", "rank"), "layer")
    assert merged["step"] == [1, 1, 2] and merged["rank"] == [0, 0, 3]
    assert merged["stats"] == {"amax": [1.0, 2.0, None], "rms": [None, None, 0.5]}


def test_everything_arrives_exactly_once(module_live_server, tmp_path):
    server = module_live_server  # shared: each test of it sends a run of its own name
    transport = Transport(server.url, "once", spool_dir=tmp_path / "spool", flush_interval=0.05)
    feed(transport, range(50))
    assert transport.close(timeout=30)
    assert stored(server.database_url, run="once") == expected(range(50))
    assert len(transport.spool) == 0 and transport.stats.failed_posts == 0


def test_server_down_for_a_while_loses_and_duplicates_nothing(server_factory, tmp_path):
    server = server_factory().start()
    transport = Transport(server.url, "run-t", spool_dir=tmp_path / "spool", flush_interval=0.05,
                          backoff=(0.05, 0.5))
    feed(transport, range(0, 20))
    assert transport.flush(30)
    server.kill()  # kill -9: what was acknowledged must already be durable
    for step in range(20, 60):
        feed(transport, [step])
        time.sleep(0.01)
    assert not transport.flush(1)  # nothing can be delivered now (it would in far less: flush_interval 0.05)
    assert len(transport.spool) > 0
    server.start()
    deadline = time.monotonic() + 30
    while len(transport.spool) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert transport.close(timeout=30)
    assert stored(server.database_url) == expected(range(60))


def test_a_hung_server_never_blocks_the_training_thread(tmp_path):
    """A server that accepts connections and never answers: the sender waits, training does not."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        transport = Transport(url, "run-t", spool_dir=tmp_path / "spool", flush_interval=0.01, timeout=2.0)
        times = []
        for step in range(200):
            t0 = time.perf_counter()
            feed(transport, [step])
            times.append(time.perf_counter() - t0)
            time.sleep(0.002)
        assert sorted(times)[len(times) // 2] < 0.001  # median: a queue put, not a network call
        assert max(times) < 0.5  # a busy machine may deschedule a step, but never for the 2 s request timeout
        assert transport.stats.failed_posts <= 1  # the sender was stuck in its one request meanwhile
        assert not transport.close(timeout=1)
    # everything handed over is on disk: a later process with the server back would replay it
    leftover = Transport("http://127.0.0.1:1", "run-t", spool_dir=tmp_path / "spool", flush_interval=60)
    assert len(leftover.spool) >= 1
    leftover.close(timeout=1)


def test_a_new_process_replays_what_the_previous_one_spooled(server_factory, tmp_path):
    server = server_factory()
    first = Transport(server.url, "run-t", spool_dir=tmp_path / "spool", flush_interval=0.05, timeout=1.0)
    feed(first, range(10))
    assert not first.close(timeout=2)  # server never came up: all on disk
    server.start()
    second = Transport(server.url, "run-t", spool_dir=tmp_path / "spool", flush_interval=0.05)
    feed(second, range(10, 15))
    assert second.close(timeout=30)
    assert stored(server.database_url) == expected(range(15))


def test_rejected_batch_is_kept_aside_and_not_retried(module_live_server, tmp_path):
    server = module_live_server
    transport = Transport(server.url, "rejected", spool_dir=tmp_path / "spool", flush_interval=0.05)
    transport.send_tensors({"step": 1, "layer": ["x"], "site": ["not-a-site"], "stats": {"amax": [1.0]}})
    assert transport.flush(timeout=30)  # a batch of its own
    feed(transport, [2])
    assert not transport.close(timeout=30)  # the truth: one batch was not delivered
    assert transport.stats.rejected_batches == 1 and transport.status().set_aside == 1
    assert stored(server.database_url, run="rejected") == expected([2])  # the batch behind it was not held back
    assert len(list((tmp_path / "spool" / "rejected").glob("*.fp8b"))) == 1


def test_full_queue_spills_to_disk_instead_of_blocking(server_factory, tmp_path):
    server = server_factory()  # not started: the sender is stuck failing
    transport = Transport(server.url, "run-t", spool_dir=tmp_path / "spool", max_queue=1, flush_interval=5.0,
                          backoff=(5.0, 5.0))
    feed(transport, range(20))  # 40 puts in a burst: faster than the sender drains a queue of one
    assert transport.stats.spilled_batches > 0
    server.start()
    assert transport.close(timeout=30)
    assert stored(server.database_url) == expected(range(20))
