"""Bounds on what ingest requests take at once: the bytes they hold (received, inflated, being stored) over all
requests, and one big batch decoded and stored at a time.

Bytes: one request is always let through, whatever its size (each is bounded by `max_request_bytes` already), so
a batch can never be refused for good by the budget alone. Big batches: decoding and storing one is CPU work that
holds the GIL for long stretches; several at once make every other thread, the event loop included, queue for it
(a /healthz then waits for each in turn), so they take turns and small batches pass beside them.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

BIG_BATCH_BYTES = 4 << 20  # a body this large (as received) takes the big-batch lane


class IngestLimits:
    def __init__(self, max_bytes: int):
        self.limit = max_bytes
        self.used = 0
        self._lock = threading.Lock()
        self._big_lane = threading.Lock()

    def lease(self) -> Lease:
        return Lease(self)

    def lane(self, received: int) -> AbstractContextManager:
        """Held while a batch of `received` bytes is decoded and stored: one big batch at a time."""
        return self._big_lane if received >= BIG_BATCH_BYTES else nullcontext()


class Lease:
    """One request's share of the byte budget; `release()` when the request is done."""

    def __init__(self, limits: IngestLimits):
        self.limits = limits
        self.held = 0

    def hold(self, total: int) -> bool:
        """Hold `total` bytes from now on. False (holding what it held) when that passes the budget while other
        requests hold bytes too."""
        limits = self.limits
        with limits._lock:
            extra = total - self.held
            if extra > 0 and limits.used + extra > limits.limit and limits.used > self.held:
                return False
            limits.used += extra
            self.held = total
            return True

    def release(self) -> None:
        with self.limits._lock:
            self.limits.used -= self.held
            self.held = 0
