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

Statistics backends (``stats_backend``): "triton" computes every
row with the one-pass kernel of ``triton_stats`` (CUDA; the CPU only under TRITON_INTERPRET=1): the tensors
a forward hook sees (input, output, weight) in one launch that writes straight into the step buffer, a
gradient in one launch each. "torch" is ``device_stats.partials``. "auto" takes Triton on CUDA when it is
installed. On the Triton path outliers are counted against the previous reporting step's mean and std of
the same (layer, site) (none before the first one), the kernel's single read cannot know this tensor's
own; the torch path counts them against the tensor's own mean and std. Layers that compute their
statistics in their own kernels (``fp8mon_reported_sites`` plus an ``fp8mon_stats`` attribute: the
trainer's ``Fp8Linear``, whose quantize kernels emit the rows of input, weight and grad_output from the
read they do for the FP8 cast, and its forward GEMM's epilogue that of output) get a ``FusedLink`` in
``fp8mon_stats``; no hook reads those sites. A reported grad_weight row replaces the step's row (it is the
accumulated gradient, as the hook sees it), the other sites merge.

CUDA graphs. A step captured into a graph runs the hooks and the layers' launches once, at capture: ``capture()``
wraps the capture and returns a ``StepRecord`` of the rows that step writes, and ``replayed(record)`` after each
replay declares them for the step in progress (``trainer.graphs.StepGraphs`` does both). A graph belongs to one kind
of step (reporting or not, with or without the histogram) and to the agent's buffers as they were at capture.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import weakref
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from .stats import torch_path as ds
from . import distributed
from .stats import launch as ts
from .collector import Collector, Job
from .formats import Fp8Format, by_name
from .hooks import LayerHooks, select_modules
from .pack import AmaxHistory, Slots, StepPack, _grown
from .stats.reference import Moments
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
    ``amax_history_len`` steps), ``outlier_k``, ``hist`` (log2 histogram) and ``hist_every`` (it rides along on every
    ``hist_every``-th reporting step only, as W&B logs histograms less often than scalars: the histogram is the
    costliest statistic to compute; on the other steps a row's ``log2_hist`` is absent, and so is the underflow
    that current scaling of a tensor the trainer does not cast derives from it), ``reduce_ranks`` (merge all
    ranks' statistics, rank 0 sends them as rank -1), ``group`` (process group), ``config``/``tags``
    (run metadata), ``spool_dir`` and further keyword arguments for the ``Transport``. ``stats_backend``
    ("auto" | "triton" | "torch", see the module docstring); ``fused=False`` hooks every site even of layers
    that could report their own (a reference for the fused path).
    """

    def __init__(self, url: str | None = None, run: str | None = None, *, token: str | None = None,
                 every: int = 1, modules: str | None = None, sites: Iterable[str] = SITES,
                 formats: dict[str, str | None] | None = None, scaling: str = "current",
                 amax_history_len: int = 1024, margin: float = 0, outlier_k: float = 6.0, hist: bool = True,
                 hist_every: int = 10, reduce_ranks: bool = False, group=None, config: dict | None = None,
                 tags: dict[str, str] | None = None, spool_dir: str | os.PathLike | None = None,
                 transport=None, stats_backend: str = "auto", fused: bool = True, **transport_options):
        if int(every) < 1:
            raise ValueError("every must be >= 1")
        if int(hist_every) < 1:
            raise ValueError("hist_every must be >= 1")
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
        self.hist_every = int(hist_every)
        self.group = group
        self.rank, self.world = distributed.rank_and_world(group)
        self.reduce = bool(reduce_ranks) and self.world > 1
        self.errors = 0
        self.last_error: str | None = None
        backend = stats_backend
        if backend not in ("auto", "triton", "torch"):
            raise ValueError("stats_backend must be 'auto', 'triton' or 'torch'")
        self.stats_backend = backend
        self.fused = bool(fused)
        self._centers: torch.Tensor | None = None  # [slots, 2] fp64: previous reporting step's (mean, std)

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
        # A layer's grad_output waits for its grad_weight (computed right after it in the same backward node)
        # to share one statistics launch: one launch fewer per watched layer and step. At most one waits.
        self._pairs: set[str] = set()  # layers whose hooks observe both
        self._waiting: tuple[str, torch.Tensor] | None = None
        self._waiting_lock = threading.Lock()  # backward hooks may run on several device threads
        # The other layers' grad_weight rows wait, as (layer, site) -> parameter, for the next statistics launch of
        # the same backward pass or for its end: a launch costs ~0.1 ms of host time, and a layer's .grad is final
        # for the pass once its accumulate hook has run. On an FP8 model, whose other sites come from its fused
        # kernels, a step's grad_weights are then one launch instead of one per layer.
        self._after: dict[tuple[str, str], torch.Tensor] = {}
        self._after_queued = False  # the end-of-pass callback is queued
        self._after_lock = threading.Lock()
        # id(gradient) -> (slot, weak reference to it, its version then): the grad_weight rows the Triton path took
        # this step, for ``grad_sq_norms`` (weak: the optimizer frees the gradients after its step)
        self._grad_slots: dict[int, tuple[int, weakref.ref, int]] = {}
        # layer -> (data pointer, version, slot) of the gradient whose grad_weight row the layer's own cast took in this
        # backward pass (FusedLink.grad_weight_target): its hook then leaves that gradient alone. (The cast's result
        # becomes .grad as it is, but not as the same Python object: its memory tells it.)
        self._cast_grads: dict[str, tuple[int, int, int]] = {}
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
            fused = self.fused and hasattr(module, "fp8mon_stats")
            # fused=False (the reference for fused layers): hooks read every site of a fused-capable layer
            reference = not self.fused and hasattr(module, "fp8mon_stats")
            hooks = LayerHooks(name, module, self.sites, self, skip=() if reference else None)
            for site in hooks.sites:
                self._slots.get(name, site)
            weight = getattr(module, "weight", None)
            if {"grad_output", "grad_weight"} <= set(hooks.sites) and isinstance(weight, torch.Tensor) and \
                    weight.is_leaf and weight.requires_grad:
                self._pairs.add(name)
            if fused:
                # a layer that casts its weight's gradient may take that row, which its hook otherwise reads
                grad_by_cast = "grad_weight" in hooks.sites and getattr(module, "fp8mon_grad_weight_by_cast", False)
                module.fp8mon_stats = FusedLink(self, name, tuple(s for s in self.sites if s not in hooks.sites),
                                                grad_by_cast)
            elif hasattr(module, "fp8mon_stats"):
                module.fp8mon_stats = None
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

    def report(self, layer: str, site: str, stats: torch.Tensor | Moments, replace: bool = False) -> None:
        """Statistics a layer computed itself, e.g. in its fused quantize kernel: a ``device_stats`` row
        (``[WIDTH]`` fp64, any device, merged without a sync) or a ``stats.Moments``. Only on reporting
        steps (check ``agent.reporting`` before computing them); several calls per step are merged, unless
        ``replace``."""
        try:
            if site not in SITES:
                raise ValueError(f"unknown site {site!r}")
            if not self.reporting:
                return
            if len(layer) > _MAX_LAYER:
                raise ValueError(f"layer name longer than {_MAX_LAYER} characters")
            row = ds.from_moments(stats, self._device()) if isinstance(stats, Moments) else stats.detach()
            self._pack.add(self._slots.get(layer, site), row.to(torch.float64), replace=replace)
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
            if isinstance(getattr(hooks.module, "fp8mon_stats", None), FusedLink):
                hooks.module.fp8mon_stats = None
        try:
            if not self.reduce:
                self._release_waiting()  # into the pack: a grad_output whose grad_weight never came
                self._observe_after()  # grad_weights whose backward pass did not end
            if not self.reduce and self._pack.written:
                self._end(self._step, {})
        except Exception as exc:
            self._error("close", exc)
        self._waiting = None
        if self._collector is None:
            return True
        if status is not None:
            self._transport.set_run_meta(status=status)
        ok = self._collector.close(timeout)
        self.errors += self._collector.errors
        if self._owns_transport:
            return self._transport.close(timeout) and ok
        return self._transport.flush(timeout) and ok

    @contextlib.contextmanager
    def capture(self):
        """Wrap the CUDA-graph capture of one whole training step, inside ``torch.cuda.graph``; yields a
        ``StepRecord``, complete on exit, to hand to ``replayed`` after each replay of that graph::

            with torch.cuda.graph(g), agent.capture() as record:
                train_step()               # reads static inputs only
            triton_stats.captured_copies_done()  # the captured launches' tables: on the device before a replay
            g.replay(); agent.replayed(record); agent.log(step, loss=static_loss)

        The hooks and the layers' fused kernels run at capture, so the graph holds the statistics launches of a
        step of this kind (reporting or not, with or without the histogram); whatever the step left waiting for a
        later launch is launched before the capture ends. Nothing is computed until a replay."""
        if self.reporting and self._pack.written:  # (a step that does not report keeps the last report's set)
            raise RuntimeError("agent.capture(): this step already has rows; capture a whole step from its start")
        record = StepRecord(self.reporting, self.hist_now)
        before = self._buffers()
        yield record
        self._launch_pending()
        record.written = frozenset(self._pack.written) if self.reporting else frozenset()
        record.seen = frozenset(self._seen)
        record.history_seen = self._history is not None and self._history.seen
        record.buffers = self._buffers()
        if record.buffers != before:  # launches captured before the move wrote the old buffer
            raise RuntimeError("the agent's device buffers grew during the capture: run a step of this kind eagerly "
                               "before capturing it")

    def replayed(self, record: "StepRecord") -> None:
        """A replay of the graph ``capture`` recorded has run in this step: its rows are the step's, as if the
        hooks had seen its tensors. Raises when this step is not of the captured kind or the agent's buffers
        moved since (a layer or site watched after the capture): then capture again."""
        if (self.reporting, self.hist_now) != (record.reporting, record.hist):
            raise ValueError(f"step {self._step} (reporting={self.reporting}, histogram={self.hist_now}) is not "
                             f"the kind of step the graph captured (reporting={record.reporting}, "
                             f"histogram={record.hist})")
        if self._buffers() != record.buffers:
            raise RuntimeError("the agent's device buffers moved since the graph was captured: capture it again")
        with self._pack._lock:
            if self._pack.written & record.written:
                raise RuntimeError("rows of this step were written before the replay; the graph would overwrite "
                                   "them")
            self._pack.written |= record.written
        self._seen |= record.seen
        if record.history_seen:
            self._history.seen = True

    def _buffers(self) -> tuple:
        """Addresses of the device buffers a captured step writes or reads by address."""
        h = self._history
        return tuple(0 if t is None else t.data_ptr() for t in (
            self._pack.rows, self._centers, None if h is None else h.history, None if h is None else h.current))

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="failed" if exc_type is not None else "finished")

    # ---- step lifecycle --------------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        self._step = step
        self._token += 1
        self._seen = set()
        self._grad_slots = {}
        self._cast_grads = {}
        self.reporting = step % self.every == 0 and not self._closed
        self.hist_now = self.hist and step % (self.every * self.hist_every) == 0  # this step's rows carry it
        if self.reporting:
            self._pack.begin()
        self._arm()

    def _arm(self) -> None:
        """Hooks only while something reads them: no hook at all on the other steps."""
        want = (self.reporting or self._history is not None) and not self._closed
        for hooks in self._layers:
            hooks.install() if want else hooks.remove()

    def _launch_pending(self) -> None:
        """Launch what the step left waiting for a later statistics launch: rows a layer's kernels deferred
        (``triton_stats.defer``), a grad_output waiting for its grad_weight, grad_weights waiting for their pass's end."""
        self._release_waiting()
        self._observe_after()
        ts.flush_deferred()  # last: it also merges the rows the launches above left to it (triton_stats.merge_later)

    def _end(self, step: int, values: dict) -> None:
        self._launch_pending()
        rows = None
        if self._pack.open:
            if self.reduce:
                rows = distributed.reduce_rows(self._pack.take(self._device()), self.group)
            elif self._pack.written:
                rows = self._pack.take(self._device())
            self._pack.open = False
            if rows is not None and self._centers is not None:
                self._update_centers(rows)
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
        self.observe_many(layer, [(site, x, once, replace)])

    def observe_many(self, layer: str, items) -> None:
        """Tensors of one layer, ``(site, tensor, once, replace)`` each, with the grad_weights waiting for a launch:
        on the Triton path one launch. A failure is counted (and logged once) per site, as if each had been
        observed alone."""
        if self._waiting is not None and any(it[0] == "grad_weight" for it in items):
            grad = self._take_waiting(layer)
            if grad is not None:
                items = [("grad_output", grad, False, False), *items]
        todo = [(layer, *it) for it in items]
        # The first forward of a reporting step that reads a weight reads every due hooked weight on its device in the
        # same launch: a step's weights cost one multi-tensor launch, not one small launch per linear. The weights do
        # not change within a step, so the rows are the same; a layer whose forward does not run that step still gets
        # its weight's row, as FP8 layers do (trainer.weight_rows).
        if self.reporting:
            weight = next((it[1] for it in items if it[0] == "weight" and it[2]), None)
            if weight is not None and self._slots.get(layer, "weight") not in self._seen:
                todo += self._due_weights(layer, weight.device)
        self._observe(todo + self._take_after(items[0][1].device if items else None))

    def _due_weights(self, layer: str, device) -> list:
        """``_observe`` items of the hooked weights on ``device`` of the layers other than ``layer``, in training mode,
        not yet read this step."""
        out = []
        for hooks in self._layers:
            module, name = hooks.module, hooks.name
            w = getattr(module, "weight", None)
            if name == layer or "weight" not in hooks.sites or not hooks.installed or not module.training or \
                    not isinstance(w, torch.Tensor) or w.device != device:
                continue
            if self._slots.get(name, "weight") not in self._seen:
                out.append((name, "weight", w, True, False))
        return out

    def observe_after_backward(self, layer: str, site: str, param: torch.Tensor) -> None:
        """``param.grad`` as ``site`` of ``layer`` (replacing), observed with the next launch of this backward pass
        or at its end, whichever comes first. A layer whose grad_output the hooks observe (a pair) is observed now,
        in one launch with its waiting grad_output (the same backward node produced both)."""
        if layer in self._pairs:
            self.observe_many(layer, [(site, param.grad, False, True)])
            return
        with self._after_lock:
            self._after[(layer, site)] = param
            if self._after_queued:
                return
            self._after_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._observe_after)
        except Exception:  # not within a backward pass (queue_callback refuses): now
            self._observe_after()

    def _take_after(self, device) -> list:
        """The waiting grad_weights on ``device`` (all, for None) as ``_observe`` items; they no longer wait."""
        if not self._after:
            return []
        with self._after_lock:
            taken = [(key, p) for key, p in self._after.items() if device is None or p.device == device]
            for key, _ in taken:
                del self._after[key]
        return [(layer, site, p.grad, False, True) for (layer, site), p in taken if p.grad is not None]

    def _observe_after(self) -> None:
        """The end of a backward pass (autograd calls this; it must not raise): the grad_weights still waiting."""
        try:
            with self._after_lock:
                self._after_queued = False
            items = self._take_after(None)
            if items:
                self._observe(items)
        except Exception as exc:
            self._error("hook grad_weight", exc)

    def _observe(self, items) -> None:
        """``(layer, site, tensor, once, replace)`` items: on the Triton path one launch (per device)."""
        todo = []
        for layer, site, x, once, replace in items:
            try:
                slot = self._slots.get(layer, site)
                if once:
                    if slot in self._seen:
                        continue
                    self._seen.add(slot)
                fmt = self.formats.get(site)
                scale, ahm, emulated = self._scale_for(layer, site, slot, fmt, x.device)
                if not self.reporting:
                    if emulated:
                        self._history.observe(slot, ds.amax(x))
                    continue
                todo.append((slot, x, fmt, scale, ahm, emulated, replace, site))
            except Exception as exc:
                self._error(f"hook {site}", exc)
        if not todo:
            return
        if self._triton_for(todo[0][1]) and all(t[1].device == todo[0][1].device for t in todo):
            try:
                self._observe_triton(todo)
                return
            except Exception as exc:
                if self.stats_backend != "auto":
                    for t in todo:
                        self._error(f"hook {t[7]}", exc)
                    return
                # "auto" falls back to the torch path for good: these rows and all later ones are still taken
                self._error("Triton statistics (the torch path from now on)", exc)
                self.stats_backend = "torch"
        for slot, x, fmt, scale, ahm, emulated, replace, site in todo:
            try:
                row = ds.partials(x, fmt=fmt, scale=scale, amax_history_max=ahm, outlier_k=self.outlier_k,
                                  hist=self.hist_now)
                self._pack.add(slot, row, replace=replace)
                if emulated:
                    self._history.observe(slot, row[ds.AMAX])
            except Exception as exc:
                self._error(f"hook {site}", exc)

    def _triton_for(self, x: torch.Tensor) -> bool:
        if self.stats_backend == "torch" or not ts.supports(x):
            return False
        if self.stats_backend == "auto" and x.device.type != "cuda":
            return False
        return ts.available(x.device)

    def _claim(self, slots: list[int], replace: list[bool], device) -> tuple[torch.Tensor, list[bool], torch.Tensor]:
        """The step buffer on ``device`` grown to every slot, whether each slot's row is merged into
        (already written this step, and not replaced), and the outlier centers; marks the slots written."""
        pack = self._pack
        with pack._lock:
            pack.grow(device)
            merge = [s in pack.written and not r for s, r in zip(slots, replace)]
            pack.written.update(slots)
            self._centers = _grown(self._centers, len(self._slots), device, _no_centers)
            return pack.rows, merge, self._centers

    def _observe_triton(self, todo) -> None:
        slots = [t[0] for t in todo]
        device = todo[0][1].device
        rows, merge, centers = self._claim(slots, [t[6] for t in todo], device)
        # rows no scale decides and no history reads now are merged by the launch that ends the step (_launch_pending):
        # no launch ends in its last program's merge
        later = all(t[3] is None and t[4] is None and not t[5] for t in todo)
        ts.rows([t[1] for t in todo], fmt=[t[2] for t in todo], scale=[t[3] for t in todo],
                center=[centers[s] for s in slots], outlier_k=self.outlier_k,
                amax_history_max=[t[4] for t in todo], hist=self.hist_now, out=rows, index=slots, merge=merge,
                later=later)
        for slot, x, fmt, scale, ahm, emulated, replace, site in todo:
            if emulated:
                self._history.observe(slot, rows[slot, ds.AMAX])
            if site == "grad_weight" and replace:
                self._grad_slots[id(x)] = (slot, weakref.ref(x), x._version)

    def cast_took(self, layer: str, grad: torch.Tensor) -> bool:
        """Whether ``layer``'s own cast took the row of ``grad`` (its weight's gradient, unchanged since) in this
        backward pass; asked once, by the layer's grad_weight hook."""
        got = self._cast_grads.pop(layer, None)
        if got is None or got[:2] != (grad.data_ptr(), grad._version):
            return False
        self._grad_slots[id(grad)] = (got[2], weakref.ref(grad), grad._version)  # for clipping, as the hooks' reads
        return True

    def grad_sq_norms(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[bool]]:
        """The sum of the squared L2 norms of those ``grads`` whose grad_weight rows this step's statistics took
        (on the Triton path, from the gradient as the last backward pass left it), from their rows: n mean^2 + M2 of
        the finite elements, in fp64 on their device; NaN if any of them holds NaN or Inf. Also which of ``grads``
        these are. A gradient-clipping pass need not read them again (``trainer.clip``). (None, all False) when no
        row of them was taken. A gradient changed in place since its row was taken (unscaled, accumulated into) is not
        counted; one changed out of torch's sight (an all-reduce) would be: call this before such changes."""
        slots, covered = [], []
        for g in grads:
            got = self._grad_slots.get(id(g))
            hit = got is not None and got[1]() is g and g._version == got[2]
            covered.append(hit)
            if hit:
                slots.append(got[0])
        if not slots:
            return None, covered
        ts.merge_later()  # (their rows may wait for their merge)
        rows = self._pack.rows.index_select(0, ts.to_device(slots, self._pack.rows.device))
        n, mean, m2 = rows[:, ds.N], rows[:, ds.MEAN], rows[:, ds.M2]
        sq = torch.where(n > 0, n * mean * mean + m2, 0.0).sum()
        return torch.where((rows[:, ds.NONFINITE] > 0).any(), float("nan"), sq), covered

    def _update_centers(self, rows: torch.Tensor) -> None:
        """The reporting step's (mean, std) per slot become the next steps' outlier centers (device ops)."""
        k = min(rows.shape[0], self._centers.shape[0])
        r = rows[:k].to(self._centers.device)
        n = r[:, ds.N]
        new = torch.stack([r[:, ds.MEAN], (r[:, ds.M2] / n.clamp(min=1)).sqrt()], 1)
        seen = (r[:, ds.PARTS] > 0) & (n > 0)
        self._centers[:k] = torch.where(seen.unsqueeze(1), new, self._centers[:k])

    def fused_target(self, layer: str, site: str, device) -> "ts.Target | None":
        """Where a layer's kernel writes the row of ``site`` this step (None: nothing to compute). The slot
        is claimed: call it only right before the kernel that writes it."""
        if not self.reporting or site not in self.sites:
            return None
        slot = self._slots.get(layer, site)
        if site == "weight":
            if slot in self._seen:
                return None
            self._seen.add(slot)
        rows, merge, centers = self._claim([slot], [site in _REPLACED], device)
        fmt = self.formats.get(site)  # a GEMM epilogue's row takes this format's current scaling, as the hooks do
        return ts.Target(rows, slot, merge[0], centers[slot], self.outlier_k, self.hist_now, None,
                         None if fmt is None else fmt.name)

    def grad_hook(self, layer: str) -> Callable[[torch.Tensor], None]:
        token = self._token

        def hook(grad: torch.Tensor) -> None:
            if token != self._token:
                self._error("grad_output", RuntimeError(
                    f"a gradient of step {self._step - 1} arrived after log() closed it; call log() after backward"))
                return
            if layer in self._pairs and self.reporting:
                with self._waiting_lock:
                    before, self._waiting = self._waiting, (layer, grad)  # observed with the layer's grad_weight
                if before is not None:  # its grad_weight did not follow
                    self.observe(before[0], "grad_output", before[1])
            else:
                self.observe(layer, "grad_output", grad)

        return hook

    def _take_waiting(self, layer: str) -> torch.Tensor | None:
        """``layer``'s waiting grad_output, no longer waiting (None: none waits)."""
        with self._waiting_lock:
            if self._waiting is None or self._waiting[0] != layer:
                return None
            grad, self._waiting = self._waiting[1], None
            return grad

    def _release_waiting(self) -> None:
        """Observe a waiting grad_output alone (its grad_weight did not follow)."""
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self.observe(waiting[0], "grad_output", waiting[1])

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


# sites whose row of a step is the last one written, not a merge: grad_weight is the accumulated gradient
# (the hooks observe param.grad after each accumulation), the layers report it as such
_REPLACED = ("grad_weight",)


def _no_centers(k: int, device) -> torch.Tensor:
    return torch.full((k, 2), float("nan"), dtype=torch.float64, device=device)


class StepRecord:
    """What ``Agent.capture`` saw a captured step do on the host: the rows its launches write, per the kind of
    step it was."""

    def __init__(self, reporting: bool, hist: bool):
        self.reporting, self.hist = reporting, hist
        self.written: frozenset[int] = frozenset()
        self.seen: frozenset[int] = frozenset()
        self.history_seen = False
        self.buffers: tuple = ()


class FusedLink:
    """What the agent puts in a self-reporting layer's ``fp8mon_stats``: the sites it reports, and

    * ``target(site, device)``: a ``triton_stats.Target`` for the layer's kernel (None: not this step);
    * ``wants(site)`` / ``report(site, row)``: for a layer without such kernels (e.g. on the CPU), which
      computes a ``device_stats`` row itself and hands it over.
    """

    def __init__(self, agent: Agent, layer: str, sites: tuple[str, ...], grad_by_cast: bool = False):
        self.agent, self.layer, self.sites, self.grad_by_cast = agent, layer, sites, grad_by_cast

    def grad_weight_target(self, device) -> "ts.Target | None":
        """A target for the row of the layer's weight gradient, for a layer that casts that gradient to its weight's
        dtype (``fp8mon_grad_weight_by_cast``, a watched grad_weight) where the cast's result becomes ``.grad`` as it
        is (no gradient accumulated yet in this step): None when not this step. Name the result with
        ``took_grad_weight``; the hook then leaves it alone. A later micro-batch, whose gradient is added to it, asks
        for none and the hook reads the sum, replacing the row."""
        agent = self.agent
        if not (self.grad_by_cast and agent.reporting) or agent._history is not None:  # delayed: the hooks' history
            return None
        return self._claimed("grad_weight", device)

    def took_grad_weight(self, grad: torch.Tensor, target: "ts.Target") -> None:
        """``grad`` (the gradient the cast returned, written with its row into ``target``) as the step's gradient of the
        layer's weight: its hook leaves it alone, and gradient clipping may take its norm from the row."""
        self.agent._cast_grads[self.layer] = (grad.data_ptr(), grad._version, int(target.index))

    def target(self, site: str, device) -> "ts.Target | None":
        if site not in self.sites:
            return None
        return self._claimed(site, device)

    def _claimed(self, site: str, device) -> "ts.Target | None":
        """The agent's target for ``site`` (claimed), or None with the failure counted."""
        try:
            return self.agent.fused_target(self.layer, site, device)
        except Exception as exc:
            self.agent._error("fused target", exc)
            return None

    def due(self, site: str) -> bool:
        """Whether ``target``/``wants`` would still ask for ``site``'s row this step (claims nothing)."""
        agent = self.agent
        if site not in self.sites or not agent.reporting:
            return False
        return site != "weight" or agent._slots.get(self.layer, site) not in agent._seen

    def wants(self, site: str) -> bool:
        agent = self.agent
        if site not in self.sites or not agent.reporting:
            return False
        if site == "weight":
            slot = agent._slots.get(self.layer, site)
            if slot in agent._seen:
                return False
            agent._seen.add(slot)
        return True

    @property
    def outlier_k(self) -> float:
        return self.agent.outlier_k

    @property
    def hist(self) -> bool:
        return self.agent.hist_now

    def fmt(self, site: str):
        """The format the agent assumes for ``site`` (a tensor the layer does not cast itself), or None."""
        return self.agent.formats.get(site)

    def report(self, site: str, row: torch.Tensor) -> None:
        self.agent.report(self.layer, site, row, replace=site in _REPLACED)
