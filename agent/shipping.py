"""Shipping a step to the monitor: one device-to-host copy of the step's rows and tensor scalars, handed as a job to
the collector thread, which builds the wire blocks and gives them to the transport."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import exit_flush, wire
from .collector import Collector, Job
from .delivery import DeliveryStatus

_RUN_NAME = re.compile(wire.RUN_NAME_PATTERN)
_SCALAR_NAME = re.compile(wire.SCALAR_NAME_PATTERN)
_TAG_KEY, _TAG_VALUE = re.compile(wire.TAG_KEY_PATTERN), re.compile(wire.TAG_VALUE_PATTERN)


def check_run_meta(config, tags) -> None:
    """A ValueError for run metadata the monitor would refuse (a refused batch would take its statistics along)."""
    if config is not None:
        try:
            json.dumps(config, allow_nan=True)  # non-finite numbers are stored (as "Infinity", "NaN")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config must be JSON (numbers, strings, lists, dicts): {exc}") from None
    for key, value in (tags or {}).items():
        if not isinstance(key, str) or not 0 < len(key) <= wire.MAX_TAG or not _TAG_KEY.match(key):
            raise ValueError(f"invalid tag key {key!r}: 1 to {wire.MAX_TAG} characters, no control character or '='")
        if not isinstance(value, str) or not _TAG_VALUE.match(value):
            raise ValueError(f"invalid tag value {value!r} for {key!r}: a string without NUL characters")


def make_transport(url, run, token, spool_dir, options, rank: int, world: int, run_id: str | None = None,
                   resume: str = "allow"):
    """The HTTP transport of a run: ``url``, ``run`` and ``token`` default to $FP8MON_URL, $FP8MON_RUN and
    $FP8MON_TOKEN (user settings, as W&B's API key); one spool directory per rank."""
    from .spool import default_spool_dir
    from .transport import Transport  # httpx/msgpack: only when the agent really sends

    url = url or os.environ.get("FP8MON_URL")
    run = run or os.environ.get("FP8MON_RUN")
    token = token or os.environ.get("FP8MON_TOKEN")
    if not url or not run:
        raise ValueError("Agent needs url= and run= (or $FP8MON_URL and $FP8MON_RUN)")
    if len(run) > wire.MAX_RUN_NAME or not _RUN_NAME.match(run):
        raise ValueError(f"invalid run name {run!r}: letters, digits and ._:@+/=- , at most {wire.MAX_RUN_NAME}")
    if wire.bad_path_segments(run):
        raise ValueError(f"invalid run name {run!r}: no empty, '.' or '..' part between slashes")
    if world > 1:  # one spool per rank: ranks on one host must not share a directory
        spool_dir = Path(spool_dir or default_spool_dir(run)) / f"rank{rank}"
    return Transport(url, run, run_id=run_id, resume=resume, token=token, spool_dir=spool_dir, **options)


class Shipper:
    """The transport and the collector thread of an agent (None of both on a rank that sends nothing)."""

    def __init__(self, transport, owns_transport: bool, rank: int, reduce: bool, error: Callable):
        self.transport = transport
        self.owns_transport = owns_transport
        self.collector = Collector(transport) if transport is not None else None
        self.rank, self.reduce, self._error = rank, reduce, error
        self.closed = False
        if owns_transport and hasattr(transport, "on_error"):  # delivery failures count in agent.errors
            transport.on_error = lambda exc: error("delivery", exc)
        if self.collector is not None:
            exit_flush.register(self)  # an agent never closed still delivers at exit and on SIGTERM

    def status(self) -> DeliveryStatus:
        status = getattr(self.transport, "status", None)
        if status is not None:
            return status()
        return DeliveryStatus(state="closed" if self.closed else "ok")

    def set_run_meta(self, **meta) -> None:
        if self.transport is not None and meta:
            self.transport.set_run_meta(**meta)

    def ship(self, step: int, rows: torch.Tensor | None, values: dict, keys: list) -> None:
        """One device-to-host copy (rows + tensor scalars) and a job for the collector thread; ``keys``: the
        (layer, site) of each row."""
        if self.collector is None:
            return
        host_scalars, device_scalars = {}, {}
        for name, value in values.items():
            if len(name) > wire.MAX_SCALAR_NAME or not _SCALAR_NAME.match(name):
                self._error("log", ValueError(f"invalid scalar name {name!r}: dropped"))
            elif isinstance(value, torch.Tensor):  # read by the collector thread, never here
                device_scalars[name] = value.detach().reshape(()).to(torch.float64)
            else:
                try:
                    host_scalars[name] = float(value)
                except (TypeError, ValueError) as exc:
                    self._error("log", ValueError(f"scalar {name!r} is not a number ({exc}): dropped"))
        parts = [] if rows is None else [rows.reshape(-1)]
        if device_scalars:
            devices = [t.device for t in (rows, *device_scalars.values()) if t is not None]
            dev = next((d for d in devices if d.type != "cpu"), devices[0])
            parts.append(torch.stack([v.to(dev, non_blocking=True) for v in device_scalars.values()]))
        job = Job(step=step, rank=-1 if self.reduce else self.rank, scalar_rank=self.rank,
                  keys=list(keys[: rows.shape[0]]) if rows is not None else [],
                  tensor_scalars=list(device_scalars), scalars=host_scalars)
        if parts:
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            if flat.device.type == "cuda":
                job.host = self.collector.pool.get(flat.numel())
                job.host.copy_(flat, non_blocking=True)
                job.event = torch.cuda.Event()
                job.event.record()
                job.pooled = True
            else:  # the CPU (computed synchronously already) or a device without events
                job.host = flat.to("cpu", copy=True)
        self.collector.submit(job)

    def flush(self, timeout: float | None = None) -> bool:
        if self.collector is None:
            return True
        return self.collector.flush(timeout) and self.transport.flush(timeout)

    def close(self, timeout: float, status: str | None = None) -> tuple[bool, int]:
        """Send what is pending (and the run ``status`` if given) and stop: (delivered, the collector's errors)."""
        if self.collector is None:
            return True, 0
        if self.closed:  # already closed at exit: the truth again
            return (self.transport.close(timeout) if self.owns_transport else self.transport.flush(timeout)), 0
        self.closed = True
        if status is not None:
            self.transport.set_run_meta(status=status)
        deadline = time.monotonic() + timeout
        ok = self.collector.close(timeout)
        left = max(0.0, deadline - time.monotonic())
        if self.owns_transport:
            return self.transport.close(left) and ok, self.collector.errors
        return self.transport.flush(left) and ok, self.collector.errors
