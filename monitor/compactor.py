"""The server's background compaction: a thread that brings the rollups (storage.rollup) up to date."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("fp8mon.rollup")

IDLE_FACTOR = 2.0  # the compactor rests at least this many times as long as its last pass took


class Compactor:
    """A compaction pass of `store` every `interval` seconds (0: never) until stopped; a run another compactor
    is working on is skipped until the next pass."""

    def __init__(self, store, interval: float):
        self.store = store
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0

    def start(self) -> Compactor:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fp8mon-compactor", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        pause = self.interval
        while not self._stop.wait(pause):
            t0 = time.monotonic()
            try:
                self.store.compact(wait=False, stop=self._stop)
                self.passes += 1
            except Exception:  # a database outage must not kill the thread; the next pass retries
                log.exception("rollup compaction failed; retrying in %.1f s", self.interval)
            # At most about 1/(1 + IDLE_FACTOR) of a core goes to compaction when ingest is heavy: the raw
            # tail that queries read grows a little instead.
            pause = max(self.interval, IDLE_FACTOR * (time.monotonic() - t0))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
