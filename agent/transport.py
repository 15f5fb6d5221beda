"""Background delivery of statistics to the monitor: batch, encode, POST, spool on failure, replay.

The training thread only ever does `queue.put_nowait`; everything that can block (encoding, the
network, the disk) happens on the sender thread. Every batch is written to an on-disk spool before it is
posted and removed once acknowledged; while the monitor is unreachable batches wait there and are
replayed oldest first, also by a later process using the same spool directory.
Batch ids are fixed when a batch is encoded, so replays are idempotent on the server.
"""

import gzip
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack

from fp8mon.agent.spool import Spool, default_spool_dir
from fp8mon.agent.wire import WIRE_VERSION

log = logging.getLogger("fp8mon.agent")

# The server refused the batch as such: sending it again cannot succeed.
_REJECTED = {400, 404, 413, 415, 422}


@dataclass
class TransportStats:
    sent_batches: int = 0
    duplicate_batches: int = 0
    spilled_batches: int = 0
    rejected_batches: int = 0
    failed_posts: int = 0
    last_error: str | None = None


@dataclass
class _Pending:
    """Blocks waiting to be merged into one batch."""

    tensors: list[dict] = field(default_factory=list)
    scalars: list[dict] = field(default_factory=list)
    run_meta: dict | None = None
    records: int = 0
    since: float = 0.0

    def add(self, kind: str, payload: dict) -> None:
        if not self.records and self.run_meta is None:
            self.since = time.monotonic()
        if kind == "run_meta":
            self.run_meta = {**(self.run_meta or {}), **payload}
            return
        getattr(self, kind).append(payload)
        self.records += len(payload["layer"] if kind == "tensors" else payload["name"])

    def __bool__(self) -> bool:
        return bool(self.records) or self.run_meta is not None


def merge_blocks(blocks: list[dict], key_columns: tuple[str, ...], length_of: str) -> dict:
    """Concatenate columnar blocks; scalar step/rank are broadcast, absent statistics become null."""
    if len(blocks) == 1:
        return blocks[0]
    merged: dict = {name: [] for name in key_columns}
    stat_names = list(dict.fromkeys(name for b in blocks for name in b.get("stats", {})))
    stats: dict[str, list] = {name: [] for name in stat_names}
    hists: list | None = [] if any("log2_hist" in b for b in blocks) else None
    for block in blocks:
        n = len(block[length_of])
        for name in key_columns:
            value = block.get(name, 0)
            merged[name].extend(value if isinstance(value, list) else [value] * n)
        for name in stat_names:
            stats[name].extend(block.get("stats", {}).get(name, [None] * n))
        if hists is not None:
            hists.extend(block.get("log2_hist", [None] * n))
    if stat_names:
        merged["stats"] = stats
    if hists is not None:
        merged["log2_hist"] = hists
    return merged


class Transport:
    def __init__(self, url: str, run: str, *, token: str | None = None, spool_dir: str | Path | None = None,
                 max_spool_bytes: int = 1 << 30, max_batch_records: int = 20_000, flush_interval: float = 1.0,
                 max_queue: int = 1024, timeout: float = 10.0, backoff: tuple[float, float] = (0.25, 30.0)):
        self.url = url.rstrip("/") + "/api/v1/ingest"
        self.run = run
        self.max_batch_records = max_batch_records
        self.flush_interval = flush_interval
        self.backoff_min, self.backoff_max = backoff
        self.stats = TransportStats()
        self.spool = Spool(spool_dir or default_spool_dir(run), max_spool_bytes)
        self._spool_lock = threading.Lock()  # the training thread spills into the spool when the queue is full
        headers = {"content-type": "application/msgpack", "content-encoding": "gzip"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._retry_at = 0.0
        self._delay = self.backoff_min
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="fp8mon-transport", daemon=True)
        self._thread.start()

    # -- training-thread side: never blocks, never raises -------------------------------------------

    def send_tensors(self, block: dict) -> None:
        self._put(("tensors", block))

    def send_scalars(self, block: dict) -> None:
        self._put(("scalars", block))

    def set_run_meta(self, **meta) -> None:
        self._put(("run_meta", meta))

    def _put(self, item) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            # Spill straight to disk rather than block training or drop the statistics.
            pending = _Pending()
            pending.add(*item)
            try:
                with self._spool_lock:
                    self.spool.push(*self._encode(pending))
                self.stats.spilled_batches += 1
            except Exception as exc:  # a full disk must not stop training either
                self.stats.last_error = f"spill failed: {exc!r}"
                log.error("fp8mon: could not spill a batch to %s: %r", self.spool.directory, exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far; True when the queue and the spool are empty afterwards."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout) and len(self.spool) == 0

    def close(self, timeout: float = 30.0) -> bool:
        """Flush and stop; what could not be delivered stays in the spool for the next process."""
        if self._closed:
            return len(self.spool) == 0
        delivered = self.flush(timeout)
        self._closed = True
        self._queue.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._spill_queue()  # the sender is stuck in a request: put what it has not taken on disk
        self._client.close()
        return delivered

    def _spill_queue(self) -> None:
        pending = _Pending()
        while True:
            try:
                kind, payload = self._queue.get_nowait()
            except queue.Empty:
                break
            if kind in ("tensors", "scalars", "run_meta"):
                pending.add(kind, payload)
        if pending:
            with self._spool_lock:
                self.spool.push(*self._encode(pending))
            self.stats.spilled_batches += 1

    # -- sender thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        pending = _Pending()
        while True:
            wait = self.flush_interval
            if pending:
                wait = max(0.0, pending.since + self.flush_interval - time.monotonic())
            try:
                kind, payload = self._queue.get(timeout=wait)
            except queue.Empty:
                kind, payload = "tick", None
            try:
                if kind in ("tensors", "scalars", "run_meta"):
                    pending.add(kind, payload)
                    if pending.records >= self.max_batch_records:
                        pending = self._ship(pending)
                elif kind == "tick":
                    if pending:
                        pending = self._ship(pending)
                    self._drain(force=False)
                elif kind == "flush":
                    if pending:
                        pending = self._ship(pending)
                    self._drain(force=True)
                    payload.set()
                elif kind == "stop":
                    if pending:
                        self._ship(pending)
                    return
            except Exception as exc:  # the sender must survive anything and keep the data
                self.stats.last_error = repr(exc)
                log.exception("fp8mon transport error")
                if kind == "flush":
                    payload.set()

    def _encode(self, pending: _Pending) -> tuple[str, bytes]:
        batch_id = uuid.uuid4().hex
        body: dict = {"version": WIRE_VERSION, "batch_id": batch_id, "run": self.run}
        if pending.tensors:
            body["tensors"] = merge_blocks(pending.tensors, ("step", "layer", "site", "rank"), "layer")
        if pending.scalars:
            body["scalars"] = merge_blocks(pending.scalars, ("step", "name", "value", "rank"), "name")
        if pending.run_meta is not None:
            body["run_meta"] = pending.run_meta
        return batch_id, gzip.compress(msgpack.packb(body), compresslevel=1)

    def _ship(self, pending: _Pending) -> _Pending:
        batch_id, body = self._encode(pending)
        # Write-ahead: a batch is on disk before it is on the wire and leaves the disk only once
        # acknowledged, so a crash or kill at any point loses nothing and replays in order.
        with self._spool_lock:
            self.spool.push(batch_id, body)
        self._drain(force=False)
        return _Pending()

    def _drain(self, force: bool) -> None:
        """Replay spooled batches oldest first until one fails; `force` ignores the back-off once."""
        while (force or time.monotonic() >= self._retry_at) and not self._client.is_closed:
            with self._spool_lock:
                head = self.spool.peek()
            if head is None or not self._post(head[1], head[2], spooled_path=head[0]):
                return

    def _post(self, batch_id: str, body: bytes, spooled_path: Path) -> bool:
        """True when the batch is settled (stored, duplicate, or rejected for good)."""
        try:
            response = self._client.post(self.url, content=body)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        if response.status_code == 200:
            self.stats.sent_batches += 1
            self.stats.duplicate_batches += bool(response.json().get("duplicate"))
        elif response.status_code in _REJECTED:
            self.stats.rejected_batches += 1
            self.stats.last_error = f"{response.status_code}: {response.text[:500]}"
            log.error("fp8mon: the monitor rejected batch %s (%s); kept under %s/rejected",
                      batch_id, self.stats.last_error, self.spool.directory)
            with self._spool_lock:
                self.spool.reject(batch_id, body, self.stats.last_error, spooled_path)
            return True
        else:
            return self._failed(f"{response.status_code}: {response.text[:200]}")
        with self._spool_lock:
            self.spool.remove(spooled_path)
        self._delay = self.backoff_min
        self._retry_at = 0.0
        return True

    def _failed(self, error: str) -> bool:
        self.stats.failed_posts += 1
        if self.stats.last_error != error:
            log.warning("fp8mon: monitor unreachable (%s); spooling to %s", error, self.spool.directory)
        self.stats.last_error = error
        self._retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, self.backoff_max)
        return False


class NullTransport:
    """A transport that sends nothing: the agent computes and ships every step as usual and the blocks are dropped
    (the agent's cost measured without a server, or statistics taken from ``Agent`` in tests)."""

    def set_run_meta(self, **meta) -> None:
        pass

    def send_tensors(self, block) -> None:
        pass

    def send_scalars(self, block) -> None:
        pass

    def flush(self, timeout=None) -> bool:
        return True

    def close(self, timeout=None) -> bool:
        return True
