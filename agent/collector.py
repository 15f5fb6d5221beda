"""The host side of a reporting step: wait for the step's device-to-host copy, turn rows into the
columnar wire blocks and hand them to the transport, on a thread of its own.

The training thread only enqueues a ``Job`` (never blocks). This thread polls the job's CUDA event
(``query`` + short sleeps: no synchronisation call that torch's sync debug mode would flag), decodes the
pinned host buffer into the SPEC statistics of all rows at once (``tensors_block``: the formulas of the
oracle's ``Moments.to_stats``, vectorised) and returns the buffer to the pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from .stats import torch_path as ds
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


def tensors_block(step: int, rank: int, keys, rows: np.ndarray) -> dict | None:
    """The wire tensors block of the rows (``[len(keys), WIDTH]`` fp64) that observed something (parts > 0).

    The SPEC statistics of all rows at once, with the formulas of ``Moments.to_stats`` (the oracle; equal up
    to the last bit of ``mean**4``). Vectorised because this thread shares the GIL with the training loop: a
    per-row Python conversion holds it far longer."""
    rows = np.asarray(rows, dtype=np.float64).reshape(len(keys), ds.WIDTH)
    seen = np.flatnonzero(rows[:, ds.PARTS] > 0)
    if seen.size == 0:
        return None
    r = rows[seen]
    numel, n, mu, m2c, m3c, m4c, amax = (r[:, i] for i in (ds.NUMEL, ds.N, ds.MEAN, ds.M2, ds.M3, ds.M4, ds.AMAX))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        has = n > 0
        mu = np.where(has, mu, np.nan)
        var = np.where(has, m2c / n, np.nan)
        ms = var + mu * mu  # mean(x^2)
        m4 = m4c / n + 4.0 * mu * m3c / n + 6.0 * mu * mu * var + mu ** 4  # mean(x^4), as Moments.to_stats
        rms, std = np.sqrt(ms), np.sqrt(var)
        stats = {
            "numel": numel.astype(np.int64).tolist(),
            "amax": amax.tolist(),
            "rms": rms.tolist(),
            "mean": mu.tolist(),
            "std": std.tolist(),
            "kurtosis": np.where(ms > 0, m4 / (ms * ms), np.nan).tolist(),
            "kurtosis_central": np.where(m2c > 0, n * m4c / (m2c * m2c), np.nan).tolist(),
            "crest": np.where(rms > 0, amax / rms, np.nan).tolist(),
            "underflow_frac": _optional(_frac(r[:, ds.UNDERFLOW], r[:, ds.NONZERO])),
            "overflow_frac": _optional(_frac(r[:, ds.OVERFLOW], numel)),
            "outlier_frac": _frac(r[:, ds.OUTLIERS], numel).tolist(),
            "zero_frac": _frac(r[:, ds.ZEROS], numel).tolist(),
            "nonfinite": r[:, ds.NONFINITE].astype(np.int64).tolist(),
            "scale": _optional(r[:, ds.SCALE]),
            "amax_history_max": _optional(r[:, ds.AMAX_HISTORY_MAX]),
        }
    assert tuple(stats) == TENSOR_STATS
    block = {"step": step, "layer": [keys[i][0] for i in seen], "site": [keys[i][1] for i in seen], "rank": rank,
             "stats": stats}
    hist = r[:, ds.HIST:]
    with_hist = ~np.isnan(hist[:, 0])
    if with_hist.any():
        counts = np.where(with_hist[:, None], hist, 0).astype(np.int64).tolist()
        block["log2_hist"] = [c if w else None for c, w in zip(counts, with_hist.tolist())]
    return block


def _frac(count: np.ndarray, total: np.ndarray) -> np.ndarray:
    """count / total, 0 where total is 0 (NaN counts stay NaN)."""
    return np.where(total != 0, count / np.where(total != 0, total, 1.0), np.where(np.isnan(count), np.nan, 0.0))


def _optional(values: np.ndarray) -> list:
    """The values as a list, None where NaN (an absent optional statistic)."""
    out = values.tolist()
    for i in np.flatnonzero(np.isnan(values)).tolist():
        out[i] = None
    return out


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
        values = job.host.numpy().copy() if job.host is not None else np.zeros(0)
        if job.pooled:
            self.pool.put(job.host)
        nrows = len(job.keys)
        block = tensors_block(job.step, job.rank, job.keys, values[:nrows * ds.WIDTH]) if nrows else None
        if block is not None:
            self.transport.send_tensors(block)
        scalars = dict(job.scalars)
        scalars.update(zip(job.tensor_scalars, values[nrows * ds.WIDTH:].tolist()))
        if scalars:
            self.transport.send_scalars({"step": job.step, "name": list(scalars), "value": list(scalars.values()),
                                         "rank": job.scalar_rank})
