"""Background delivery of statistics to the monitor: batch, encode, POST, spool on failure, replay.

The training thread only ever does `queue.put_nowait`; everything that can block (encoding, the
network, the disk) happens on the sender thread. Every batch is written to an on-disk spool before it is
posted and removed once acknowledged; while the monitor is unreachable batches wait there and are
replayed oldest first, also by a later process using the same spool directory (or `fp8mon sync`).
Batch ids are fixed when a batch is encoded, so replays are idempotent on the server.

Failures (``delivery``): unreachable or 5xx is retried with back-off; a refused token (401/403) keeps the batches
in the spool and a batch refused as such is set aside under ``rejected/``, both reported once with what to fix
(``on_error``: the agent counts them in ``agent.errors``) and visible in ``status()``; ``close`` returns False
unless everything was delivered.
"""

import gzip
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack

from fp8mon.agent import delivery, exit_flush
from fp8mon.agent.delivery import (
    BatchRefused,
    DeliveryError,
    DeliveryStatus,
    ResumeRefused,
    SpoolUnwritable,
    TokenRefused,
)
from fp8mon.agent.spool import Entry, Spool, default_spool_dir
from fp8mon.agent.wire import CLIENT_HEADER, WIRE_VERSION

log = logging.getLogger("fp8mon.agent")

_DATA = ("tensors", "scalars", "run_meta")
_DRAIN_BUDGET = 0.2  # seconds of replay between two looks at the queue

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
    """``run_id`` and ``resume`` ride in every batch (docs/wire-format.md, "Run identity"); left out, the monitor
    files the batches under the run of that name (resume "allow")."""

    def __init__(self, url: str, run: str, *, run_id: str | None = None, resume: str = "allow",
                 token: str | None = None, spool_dir: str | Path | None = None,
                 max_spool_bytes: int = 1 << 30, max_batch_records: int = 20_000, flush_interval: float = 1.0,
                 max_queue: int = 1024, timeout: float = 10.0, backoff: tuple[float, float] = (0.25, 30.0)):
        self.url = delivery.ingest_url(url)
        self.run = run
        self.run_id, self.resume, self.token = run_id, resume, token
        self.stored_run: str | None = None  # the name the monitor answered; a taken name gets a suffix there
        self.max_batch_records = max_batch_records
        self.flush_interval = flush_interval
        self.backoff_min, self.backoff_max = backoff
        self.stats = TransportStats()
        # Failures the user must fix, once each reported here; without it they are logged once per kind.
        self.on_error: Callable[[DeliveryError], None] | None = None
        self.spool = Spool(spool_dir or default_spool_dir(run), max_spool_bytes)
        self._spool_lock = threading.Lock()  # the training thread spills into the spool when the queue is full
        headers = {"content-type": "application/msgpack", "content-encoding": "gzip", CLIENT_HEADER: "agent"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._retry_at = 0.0
        self._delay = self.backoff_min
        self._state = "ok"
        self._lost = 0
        self._logged: set[type] = set()
        self._told_unwritable = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="fp8mon-transport", daemon=True)
        self._thread.start()  # a spool unwritable from the start is reported with its first batch (on_error set)
        exit_flush.register(self)

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
            # Spill straight to the spool rather than block training or drop the statistics.
            pending = _Pending()
            pending.add(*item)
            self._push(pending)
            self.stats.spilled_batches += 1

    @property
    def closed(self) -> bool:
        return self._closed

    def status(self) -> DeliveryStatus:
        state = self._state
        if self._closed:
            state = "closed"
        elif state == "ok" and self.spool.unwritable:
            state = "degraded"
        return DeliveryStatus(state=state, delivered=self.stats.sent_batches, pending=self.spool.on_disk,
                              in_memory=self.spool.in_memory, set_aside=self.stats.rejected_batches,
                              lost=self._lost + self.spool.dropped_batches, last_error=self.stats.last_error,
                              run=self.stored_run)

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far; True when the queue and the spool are empty afterwards."""
        if self._closed:
            return len(self.spool) == 0
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout) and len(self.spool) == 0

    def close(self, timeout: float = 30.0) -> bool:
        """Flush and stop within ``timeout`` seconds; what could not be delivered stays in the spool for the next
        process or `fp8mon sync`. True only when every batch was delivered (none waits, none set aside or lost)."""
        if self._closed:
            return self._all_delivered()
        deadline = time.monotonic() + timeout
        delivered = self.flush(timeout)
        self._closed = True
        self._queue.put(("stop", None))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._spill_queue()  # the sender is stuck in a request: put what it has not taken in the spool
        self._client.close()
        with self._spool_lock:
            self.spool.persist()  # a spool that degraded to memory: onto the disk if it can take them now
        ok = delivered and self._all_delivered()
        if not ok:
            status = self.status()
            log.error("fp8mon: run %s not fully delivered: %d batches wait in %s (fp8mon sync replays them), "
                      "%d set aside under its rejected/, %d lost; last error: %s", self.run,
                      status.pending, self.spool.directory, status.set_aside, status.lost + status.in_memory,
                      status.last_error)
        return ok

    def _all_delivered(self) -> bool:
        status = self.status()
        return not (status.pending or status.in_memory or status.set_aside or status.lost)

    def _spill_queue(self) -> None:
        pending = _Pending()
        while True:
            try:
                kind, payload = self._queue.get_nowait()
            except queue.Empty:
                break
            if kind in _DATA:
                pending.add(kind, payload)
        if pending:
            self._push(pending)
            self.stats.spilled_batches += 1

    # -- sender thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        pending = _Pending()
        while not self._client.is_closed:
            now = time.monotonic()
            wait = self.flush_interval
            if pending:
                wait = max(0.0, pending.since + self.flush_interval - now)
            if len(self.spool) and now >= self._retry_at:
                wait = 0.0  # a replay in progress: look at the queue, then go on
            try:
                kind, payload = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                kind, payload = "tick", None
            try:
                if kind in _DATA:
                    pending.add(kind, payload)
                    if pending.records >= self.max_batch_records:
                        pending = self._ship(pending)
                elif kind == "tick":
                    if pending and time.monotonic() >= pending.since + self.flush_interval:
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
                if type(exc) not in self._logged:
                    self._logged.add(type(exc))
                    log.exception("fp8mon transport error (further ones of this kind are not logged)")
                if kind == "flush":
                    payload.set()
                time.sleep(self.flush_interval)  # whatever it was, never spin on it

    def _encode(self, pending: _Pending) -> tuple[str, bytes]:
        batch_id = uuid.uuid4().hex
        body: dict = {"version": WIRE_VERSION, "batch_id": batch_id, "run": self.run}
        if self.run_id is not None:
            body["run_id"] = self.run_id
        if self.resume != "allow":  # the default: a batch without it stays valid for an older monitor
            body["resume"] = self.resume
        if pending.tensors:
            body["tensors"] = merge_blocks(pending.tensors, ("step", "layer", "site", "rank"), "layer")
        if pending.scalars:
            body["scalars"] = merge_blocks(pending.scalars, ("step", "name", "value", "rank"), "name")
        if pending.run_meta is not None:
            body["run_meta"] = pending.run_meta
        return batch_id, gzip.compress(msgpack.packb(body), compresslevel=1)

    def _ship(self, pending: _Pending) -> _Pending:
        # Write-ahead: a batch is in the spool before it is on the wire and leaves it only once
        # acknowledged, so a crash or kill at any point loses nothing and replays in order.
        self._push(pending)
        self._drain(force=False)
        return _Pending()

    def _push(self, pending: _Pending) -> None:
        """Into the spool (memory when its directory cannot be written); never raises."""
        try:
            batch_id, body = self._encode(pending)
            with self._spool_lock:
                self.spool.push(batch_id, body)
        except Exception as exc:
            self._lost += 1
            self._report(DeliveryError(f"a batch could not be encoded and was lost: {exc!r}"))
        if self.spool.unwritable and not self._told_unwritable:
            self._spool_degraded()

    def _spool_degraded(self) -> None:
        self._told_unwritable = True
        self._report(SpoolUnwritable(
            f"the spool directory cannot be written ({self.spool.unwritable}): batches are kept in memory and "
            f"still delivered, but what is undelivered at exit is lost; free the disk or set spool_dir="))

    def _drain(self, force: bool) -> None:
        """Replay spooled batches oldest first until one fails; `force` ignores the back-off and the time budget
        (a flush), otherwise it returns after _DRAIN_BUDGET so the loop keeps taking the training's blocks."""
        until = time.monotonic() + _DRAIN_BUDGET
        while (force or time.monotonic() >= self._retry_at) and not self._client.is_closed:
            with self._spool_lock:
                head = self.spool.peek()
            if head is None or not self._post(*head) or (not force and time.monotonic() > until):
                return

    def _post(self, entry: Entry, body: bytes) -> bool:
        """True when the batch is settled (stored, duplicate, or set aside) and the next one may go."""
        outcome = delivery.post(self._client, self.url, body)
        if outcome.kind == delivery.STORED:
            self.stats.sent_batches += 1
            self.stats.duplicate_batches += outcome.duplicate
            with self._spool_lock:
                self.spool.remove(entry)
            self._delay = self.backoff_min
            self._retry_at = 0.0
            self._state = "ok"
            self._stored_as(outcome.run)
            return True
        if outcome.kind == delivery.REFUSED:  # sending it again cannot pass: aside, and the next one goes
            self.stats.rejected_batches += 1
            with self._spool_lock:
                self.spool.reject(entry, body, outcome.message)
            refusal = ResumeRefused if outcome.code == 409 else BatchRefused
            self._report(refusal(f"{outcome.message} (batch kept under {self.spool.directory / 'rejected'})"))
            return True
        self._back_off(outcome.retry_after)
        if outcome.kind == delivery.AUTH:
            self._state = "refused"
            self._report(TokenRefused(f"{outcome.message} (the batches wait in {self.spool.directory})"))
            return False
        self.stats.failed_posts += 1
        self._state = "retrying"
        if self.stats.last_error != outcome.message:
            log.warning("fp8mon: monitor unreachable (%s); spooling to %s", outcome.message, self.spool.directory)
        self.stats.last_error = outcome.message
        return False

    def _stored_as(self, name: str | None) -> None:
        if name is None or name == self.stored_run:
            return
        self.stored_run = name
        if name != self.run:
            log.warning("fp8mon: the monitor has a run named %r already; this run is %r (run_id %s). To continue "
                        "the earlier run instead, pass resume='allow'", self.run, name, self.run_id)

    def _back_off(self, retry_after: float = 0.0) -> None:
        """Wait the back-off delay, or longer when the server asked so (Retry-After, up to backoff_max)."""
        self._retry_at = time.monotonic() + max(self._delay, min(retry_after, self.backoff_max))
        self._delay = min(self._delay * 2, self.backoff_max)

    def _report(self, exc: DeliveryError) -> None:
        self.stats.last_error = str(exc)
        if self.on_error is not None:
            self.on_error(exc)
        elif type(exc) not in self._logged:
            self._logged.add(type(exc))
            log.error("fp8mon: %s (further ones of this kind are only counted in status())", exc)


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
