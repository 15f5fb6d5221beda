"""The host side of a reporting step: wait for the step's device-to-host copy, turn rows into the
columnar wire blocks and hand them to the transport, on a thread of its own.

The training thread only enqueues a ``Job`` (never blocks). This thread polls the job's CUDA event
(``query`` + short sleeps: no synchronisation call that torch's sync debug mode would flag), decodes the
pinned host buffer with the oracle's ``Moments.to_stats`` and returns the buffer to the pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import device_stats as ds
from .wire import TENSOR_STATS

log = logging.getLogger("fp8mon.agent")


@dataclass
class Job:
    step: int
    rank: int  # of the tensor records (-1: reduced over all ranks)
    scalar_rank: int = 0
    host: torch.Tensor | None = None  # flat fp64: rows (len(keys) * WIDTH), then the tensor scalars' values
    keys: list[tuple[str, str]] = field(default_factory=list)  # (layer, site) of each row
    tensor_scalars: list[str] = field(default_factory=list)  # names of the values after the rows
    scalars: dict[str, float | None] = field(default_factory=dict)  # already on the host
    event: object | None = None  # torch.cuda.Event recorded after the copy into `host`
    pooled: bool = False


def tensors_block(step: int, rank: int, keys, rows: list[list[float]]) -> dict | None:
    """The wire tensors block of the rows that observed something (parts > 0)."""
    layers, sites, hists = [], [], []
    stats: dict[str, list] = {name: [] for name in TENSOR_STATS}
    for (layer, site), row in zip(keys, rows):
        if row[ds.PARTS] <= 0:
            continue
        values = ds.to_moments(row).to_stats()
        layers.append(layer)
        sites.append(site)
        for name in TENSOR_STATS:
            stats[name].append(values[name])
        hists.append(values.get("log2_hist"))
    if not layers:
        return None
    block = {"step": step, "layer": layers, "site": sites, "rank": rank, "stats": stats}
    if any(h is not None for h in hists):
        block["log2_hist"] = hists
    return block


class PinnedPool:
    """Reusable page-locked host buffers by size, so a reporting step allocates nothing."""

    def __init__(self):
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()

    def get(self, numel: int) -> torch.Tensor:
        with self._lock:
            if self._free[numel]:
                return self._free[numel].pop()
        return torch.empty(numel, dtype=torch.float64, pin_memory=True)

    def put(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free[t.numel()].append(t)


class Collector:
    def __init__(self, transport):
        self.transport = transport
        self.pool = PinnedPool()
        self.errors = 0
        self.last_error: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="fp8mon-collector", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put_nowait(job)

    def flush(self, timeout: float | None = None) -> bool:
        """True when every job submitted so far has been handed to the transport."""
        done = threading.Event()
        self._queue.put_nowait(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        ok = self.flush(timeout)
        self._queue.put_nowait(None)
        self._thread.join(timeout)
        return ok

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                self._process(job)
            except Exception as exc:  # keep going: one bad step must not stop the others
                self.errors += 1
                self.last_error = repr(exc)
                log.exception("fp8mon: could not build the records of step %s", job.step)

    def _process(self, job: Job) -> None:
        if job.event is not None:
            delay = 1e-4
            while not job.event.query():
                time.sleep(delay)
                delay = min(2 * delay, 5e-3)
        values = job.host.tolist() if job.host is not None else []
        if job.pooled:
            self.pool.put(job.host)
        nrows = len(job.keys)
        rows = [values[i * ds.WIDTH:(i + 1) * ds.WIDTH] for i in range(nrows)]
        block = tensors_block(job.step, job.rank, job.keys, rows)
        if block is not None:
            self.transport.send_tensors(block)
        scalars = dict(job.scalars)
        scalars.update(zip(job.tensor_scalars, values[nrows * ds.WIDTH:]))
        if scalars:
            self.transport.send_scalars({"step": job.step, "name": list(scalars), "value": list(scalars.values()),
                                         "rank": job.scalar_rank})
