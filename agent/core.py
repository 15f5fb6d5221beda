"""The Agent: watch a model's linear layers, compute SPEC section-4 statistics every N steps on the
device, and stream them with the step's scalars to the monitor.

Step model. The agent counts steps: ``log(step, ...)`` ends ``step`` (the records of everything the hooks
saw since the previous ``log`` carry that step) and the next step is ``step + 1``; ``step(n)`` declares
the step about to run explicitly (resuming, or logging less often than every step). A step ``n`` with
``n % every == 0`` is a reporting step: only then are statistics computed and sent (scalars are sent
whenever ``log`` is called). Call ``log`` once the step's backward is done (after the optimizer step is
fine): gradients arriving after their step was closed are dropped and counted as errors.

Per reporting step the training thread launches the statistics ops on the device, merges them into one
packed ``[slots, WIDTH]`` buffer (``pack.StepPack``), optionally all-gathers it across ranks
(``distributed``), and issues one non-blocking copy into pinned host memory plus a CUDA event; the
collector thread waits for the event and builds the wire blocks. Nothing on the training thread reads a
device value. Any exception inside the agent is logged once per kind, counted in ``errors``, and training
goes on.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from . import device_stats as ds
from . import distributed
from .collector import Collector, Job
from .formats import Fp8Format, by_name
from .hooks import LayerHooks, select_modules
from .pack import AmaxHistory, Slots, StepPack
from .stats import Moments
from . import wire
from .wire import SITES

log = logging.getLogger("fp8mon.agent")

DEFAULT_FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}
_RUN_NAME = re.compile(wire.RUN_NAME_PATTERN)
_SCALAR_NAME = re.compile(wire.SCALAR_NAME_PATTERN)
_MAX_LAYER, _MAX_NAME, _MAX_RUN = wire.MAX_LAYER_NAME, wire.MAX_SCALAR_NAME, wire.MAX_RUN_NAME


class Agent:
    """Attach to a training loop in two lines::

        agent = Agent("http://127.0.0.1:8000", run="llama-fp8-1", every=10).watch(model)
        ...  # in the loop, after backward / optimizer.step():
        agent.log(step, loss=loss, lr=lr)

    ``url``, ``run`` and ``token`` default to $FP8MON_URL, $FP8MON_RUN and $FP8MON_TOKEN.

    Options: ``every`` (report every N steps), ``modules`` (regex searched in qualified module names),
    ``sites`` (subset of input/weight/output/grad_output/grad_weight), ``formats`` (site -> "e4m3" |
    "e5m2" | None, merged over DEFAULT_FORMATS), ``scaling`` ("current": s = max/amax of the tensor;
    "delayed": s = max/max(amax history)/2**margin with a per-tensor device history of
    ``amax_history_len`` steps), ``outlier_k``, ``hist`` (log2 histogram), ``reduce_ranks`` (merge all
    ranks' statistics, rank 0 sends them as rank -1), ``group`` (process group), ``config``/``tags``
    (run metadata), ``spool_dir`` and further keyword arguments for the ``Transport``.
    """

    def __init__(self, url: str | None = None, run: str | None = None, *, token: str | None = None,
                 every: int = 1, modules: str | None = None, sites: Iterable[str] = SITES,
                 formats: dict[str, str | None] | None = None, scaling: str = "current",
                 amax_history_len: int = 1024, margin: float = 0, outlier_k: float = 6.0, hist: bool = True,
                 reduce_ranks: bool = False, group=None, config: dict | None = None,
                 tags: dict[str, str] | None = None, spool_dir: str | os.PathLike | None = None,
                 transport=None, **transport_options):
        if int(every) < 1:
            raise ValueError("every must be >= 1")
        self.sites = tuple(s for s in SITES if s in set(sites))
        unknown = set(sites) - set(SITES)
        if unknown:
            raise ValueError(f"unknown sites {sorted(unknown)}; expected some of {SITES}")
        if scaling not in ("current", "delayed"):
            raise ValueError("scaling must be 'current' or 'delayed'")
        fmts = {**DEFAULT_FORMATS, **(formats or {})}
        self.formats: dict[str, Fp8Format | None] = {s: None if f is None else by_name(f) for s, f in fmts.items()
                                                     if s in SITES}
        self.every = int(every)
        self.modules = re.compile(modules) if modules else None
        self.outlier_k = float(outlier_k)
        self.hist = bool(hist)
        self.group = group
        self.rank, self.world = distributed.rank_and_world(group)
        self.reduce = bool(reduce_ranks) and self.world > 1
        self.errors = 0
        self.last_error: str | None = None

        self._slots = Slots()
        self._pack = StepPack(self._slots)
        self._history = AmaxHistory(amax_history_len, margin, self._slots) if scaling == "delayed" else None
        self._layers: list[LayerHooks] = []
        self._probes: list[torch.Tensor] = []  # a parameter per watched model: where its tensors live
        self._scales: dict[tuple[str, str], tuple] = {}
        self._logged: set = set()
        self._step = 0
        self._token = 0  # changes at every step begin: a gradient hook from an older step is late
        self._seen: set[int] = set()
        self._closed = False
        self.reporting = False

        self._owns_transport = transport is None
        if transport is None and (not self.reduce or self.rank == 0):
            transport = self._make_transport(url, run, token, spool_dir, transport_options)
        self._transport = transport if (not self.reduce or self.rank == 0) else None
        self._collector = Collector(self._transport) if self._transport is not None else None
        if self._transport is not None and (config is not None or tags is not None):
            self._transport.set_run_meta(**{k: v for k, v in (("config", config), ("tags", tags)) if v is not None})
        self._begin(0)

    def _make_transport(self, url, run, token, spool_dir, options):
        from .spool import default_spool_dir
        from .transport import Transport  # httpx/msgpack: only when the agent really sends

        url = url or os.environ.get("FP8MON_URL")
        run = run or os.environ.get("FP8MON_RUN")
        token = token or os.environ.get("FP8MON_TOKEN")
        if not url or not run:
            raise ValueError("Agent needs url= and run= (or $FP8MON_URL and $FP8MON_RUN)")
        if len(run) > _MAX_RUN or not _RUN_NAME.match(run):
            raise ValueError(f"invalid run name {run!r}: letters, digits and ._:@+/=- , at most {_MAX_RUN}")
        if self.world > 1:  # one spool per rank: ranks on one host must not share a directory
            spool_dir = Path(spool_dir or default_spool_dir(run)) / f"rank{self.rank}"
        return Transport(url, run, token=token, spool_dir=spool_dir, **options)

    # ---- public API ----------------------------------------------------------------------------

    @property
    def current_step(self) -> int:
        """The step that the hooks are observing now."""
        return self._step

    def watch(self, model: nn.Module, *, prefix: str = "") -> "Agent":
        """Hook every matching linear layer of ``model`` (names prefixed with ``prefix``)."""
        for name, module in select_modules(model, self.modules, prefix):
            if len(name) > _MAX_LAYER:
                raise ValueError(f"layer name longer than {_MAX_LAYER} characters: {name[:60]}...")
            hooks = LayerHooks(name, module, self.sites, self)
            for site in hooks.sites:
                self._slots.get(name, site)
            self._layers.append(hooks)
        probe = next(model.parameters(), None)
        if probe is not None:
            self._probes.append(probe)
        self._arm()
        return self

    def log(self, step: int, loss=None, grad_norm=None, lr=None, **scalars) -> None:
        """Record the step's scalars (numbers or tensors; tensors are read without a sync) and end
        ``step``: the statistics gathered since the previous ``log`` are sent as ``step``."""
        try:
            values = {"loss": loss, "grad_norm": grad_norm, "lr": lr, **scalars}
            values = {k: v for k, v in values.items() if v is not None}
            step = int(step)
            if step < self._step:  # a step already closed: only its scalars
                self._ship(step, None, values)
                return
            try:
                self._end(step, values)
            finally:
                self._begin(step + 1)
        except Exception as exc:
            self._error("log", exc)

    def step(self, step: int) -> None:
        """Declare that ``step`` runs next. If it differs from ``current_step``, the step in progress
        ends first (what it gathered is sent under its own number). Under ``reduce_ranks`` every rank
        must make the same calls, as with ``log``."""
        try:
            step = int(step)
            if step != self._step:
                try:
                    self._end(self._step, {})
                finally:
                    self._begin(step)
        except Exception as exc:
            self._error("step", exc)

    def report(self, layer: str, site: str, stats: torch.Tensor | Moments) -> None:
        """Statistics a layer computed itself, e.g. in its fused quantize kernel: a ``device_stats`` row
        (``[WIDTH]`` fp64, any device, merged without a sync) or a ``stats.Moments``. Only on reporting
        steps (check ``agent.reporting`` before computing them); several calls per step are merged."""
        try:
            if site not in SITES:
                raise ValueError(f"unknown site {site!r}")
            if not self.reporting:
                return
            if len(layer) > _MAX_LAYER:
                raise ValueError(f"layer name longer than {_MAX_LAYER} characters")
            row = ds.from_moments(stats, self._device()) if isinstance(stats, Moments) else stats.detach()
            self._pack.add(self._slots.get(layer, site), row.to(torch.float64))
        except Exception as exc:
            self._error("report", exc)

    def set_scale(self, layer: str, site: str, scale, amax_history=None) -> None:
        """The FP8 scale a layer really uses for ``site`` (a tensor, a number, or a callable returning
        one, read at each reporting step on the device), and optionally its amax history tensor: the
        statistics then use it instead of the agent's current/delayed scaling emulation."""
        if site not in SITES:
            raise ValueError(f"unknown site {site!r}")
        self._scales[(layer, site)] = (scale, amax_history)

    def flush(self, timeout: float | None = None) -> bool:
        """Hand everything logged so far to the monitor; True when it was delivered."""
        if self._collector is None:
            return True
        return self._collector.flush(timeout) and self._transport.flush(timeout)

    def close(self, timeout: float = 30.0, status: str | None = None) -> bool:
        """Remove the hooks, send what is pending (and the run ``status`` if given) and stop. Statistics
        gathered after the last ``log`` are sent as ``current_step``, except under ``reduce_ranks``
        (that would be a collective call the other ranks may not make): they are dropped."""
        if self._closed:
            return True
        self._closed = True
        for hooks in self._layers:
            hooks.remove()
        try:
            if not self.reduce and self._pack.written:
                self._end(self._step, {})
        except Exception as exc:
            self._error("close", exc)
        if self._collector is None:
            return True
        if status is not None:
            self._transport.set_run_meta(status=status)
        ok = self._collector.close(timeout)
        self.errors += self._collector.errors
        if self._owns_transport:
            return self._transport.close(timeout) and ok
        return self._transport.flush(timeout) and ok

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="failed" if exc_type is not None else "finished")

    # ---- step lifecycle --------------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        self._step = step
        self._token += 1
        self._seen = set()
        self.reporting = step % self.every == 0 and not self._closed
        if self.reporting:
            self._pack.begin()
        self._arm()

    def _arm(self) -> None:
        """Hooks only while something reads them: no hook at all on the other steps."""
        want = (self.reporting or self._history is not None) and not self._closed
        for hooks in self._layers:
            hooks.install() if want else hooks.remove()

    def _end(self, step: int, values: dict) -> None:
        rows = None
        if self._pack.open:
            if self.reduce:
                rows = distributed.reduce_rows(self._pack.take(self._device()), self.group)
            elif self._pack.written:
                rows = self._pack.take(self._device())
            self._pack.open = False
        if self._history is not None:
            self._history.roll()
        self._ship(step, rows, values)

    def _device(self) -> torch.device:
        return self._probes[0].device if self._probes else torch.device("cpu")

    def _ship(self, step: int, rows: torch.Tensor | None, values: dict) -> None:
        """One device-to-host copy (rows + tensor scalars) and a job for the collector thread."""
        if self._collector is None:
            return
        host_scalars, device_scalars = {}, {}
        for name, value in values.items():
            if len(name) > _MAX_NAME or not _SCALAR_NAME.match(name):
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
                  keys=list(self._slots.keys[: rows.shape[0]]) if rows is not None else [],
                  tensor_scalars=list(device_scalars), scalars=host_scalars)
        if parts:
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            if flat.device.type == "cuda":
                job.host = self._collector.pool.get(flat.numel())
                job.host.copy_(flat, non_blocking=True)
                job.event = torch.cuda.Event()
                job.event.record()
                job.pooled = True
            else:  # the CPU (computed synchronously already) or a device without events
                job.host = flat.to("cpu", copy=True)
        self._collector.submit(job)

    # ---- hook sink (hooks.Sink) -------------------------------------------------------------------

    def active(self) -> bool:
        return self.reporting or self._history is not None

    def observe(self, layer: str, site: str, x: torch.Tensor, once: bool = False, replace: bool = False) -> None:
        try:
            slot = self._slots.get(layer, site)
            if once:
                if slot in self._seen:
                    return
                self._seen.add(slot)
            fmt = self.formats.get(site)
            scale, ahm, emulated = self._scale_for(layer, site, slot, fmt, x.device)
            if self.reporting:
                row = ds.partials(x, fmt=fmt, scale=scale, amax_history_max=ahm, outlier_k=self.outlier_k,
                                  hist=self.hist)
                self._pack.add(slot, row, replace=replace)
                if emulated:
                    self._history.observe(slot, row[ds.AMAX])
            elif emulated:
                self._history.observe(slot, ds.amax(x))
        except Exception as exc:
            self._error(f"hook {site}", exc)

    def grad_hook(self, layer: str) -> Callable[[torch.Tensor], None]:
        token = self._token

        def hook(grad: torch.Tensor) -> None:
            if token != self._token:
                self._error("grad_output", RuntimeError(
                    f"a gradient of step {self._step - 1} arrived after log() closed it; call log() after backward"))
                return
            self.observe(layer, "grad_output", grad)

        return hook

    def _scale_for(self, layer, site, slot, fmt, device):
        """(scale, amax_history_max, emulated-delayed?) for a tensor of the slot."""
        if fmt is None:
            return None, None, False
        given = self._scales.get((layer, site))
        if given is not None:
            scale, history = (v() if callable(v) else v for v in given)
            ahm = history.detach().amax() if isinstance(history, torch.Tensor) else history
            if scale is not None:
                return scale, ahm, False
        if self._history is not None:
            scale, ahm = self._history.scale(slot, fmt, device)
            return scale, ahm, True
        return None, None, False

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{where}: {exc!r}"
        key = (where, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.error("fp8mon agent: %s failed (%r); training continues, further such errors are only counted",
                      where, exc, exc_info=exc)
