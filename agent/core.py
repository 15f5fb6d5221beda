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
row with the one-pass kernel of ``stats.launch`` (CUDA; the CPU only under TRITON_INTERPRET=1): the tensors
a forward hook sees (input, output, weight) in one launch that writes straight into the step buffer, a
gradient in one launch each. "torch" is ``stats.torch_path.partials``. "auto" takes Triton on CUDA when it is
installed. On the Triton path outliers are counted against the previous reporting step's mean and std of
the same (layer, site) (none before the first one), the kernel's single read cannot know this tensor's
own; the torch path counts them against the tensor's own mean and std. Layers that compute their
statistics in their own kernels (``fp8mon_reported_sites`` plus an ``fp8mon_stats`` attribute: the
trainer's ``Fp8Linear``, whose quantize kernels emit the rows of input, weight and grad_output from the
read they do for the FP8 cast, and its forward GEMM's epilogue that of output) get a ``FusedLink`` in
``fp8mon_stats``; no hook reads those sites. A reported grad_weight row replaces the step's row (it is the
accumulated gradient, as the hook sees it), the other sites merge.

CUDA graphs: ``capture()`` and ``replayed(record)`` (``graph_capture``).

The Agent is a facade over its collaborators: ``sink.HookSink`` (what the hooks and fused kernels hand tensors to,
with ``pairing.GradPairing``), ``fused_link.FusedLink`` (a self-reporting layer's link), ``graph_capture`` and
``shipping.Shipper`` (the transport and the collector thread). It owns the step state they read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

import torch
from torch import nn

from . import discovery, distributed, graph_capture, identity, torchao_sites, wire
from .compiled import CompiledMode
from .formats import Fp8Format, by_name
from .fused_link import FusedLink
from .hooks import LayerHooks, select_modules
from .pack import AmaxHistory, Slots, StepPack
from .sharded import is_dtensor
from .shipping import Shipper, check_run_meta, make_transport
from .sink import HookSink
from .stats import torch_path as ds
from .stats.reference import Moments
from .wire import SITES

log = logging.getLogger("fp8mon.agent")

DEFAULT_FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}
_MAX_LAYER = wire.MAX_LAYER_NAME


class Agent:
    """Attach to a training loop in two lines::

        agent = Agent("http://127.0.0.1:8000", run="llama-fp8-1", every=10).watch(model)
        ...  # in the loop, after backward / optimizer.step():
        agent.log(step, loss=loss, lr=lr)

    ``url``, ``run`` and ``token`` default to $FP8MON_URL, $FP8MON_RUN and $FP8MON_TOKEN.

    Run identity (W&B's ``resume``; ``identity``): ``run`` is a display name; a run is identified by an id.
    ``resume="never"``, the default, starts a new run with a fresh id (``agent.run_id``): W&B's default too, and the
    one that can never mix two trainings' data; a name the monitor has already gets a suffix there (``llama-2``,
    ``agent.status().run``). ``resume="allow"`` continues the run of ``run_id`` (or, without it, of the name) if the
    monitor has it, else creates it; ``resume="must"`` continues it or raises at construction (``ResumeRefused``)
    when the monitor answers that it has no such run. A resumed run's steps must continue after the last one
    stored: a step at or below it is dropped and counted in ``errors``. Under torch.distributed with every rank
    sending, each rank constructs its Agent with the same arguments: rank 0's id is broadcast to the others.

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
                 transport=None, stats_backend: str = "auto", fused: bool = True, resume: str = "never",
                 run_id: str | None = None, **transport_options):
        if int(every) < 1:
            raise ValueError("every must be >= 1")
        if int(hist_every) < 1:
            raise ValueError("hist_every must be >= 1")
        unknown = set(sites) - set(SITES)
        if unknown:
            raise ValueError(f"unknown sites {sorted(unknown)}; expected some of {SITES}")
        if scaling not in ("current", "delayed"):
            raise ValueError("scaling must be 'current' or 'delayed'")
        if stats_backend not in ("auto", "triton", "torch"):
            raise ValueError("stats_backend must be 'auto', 'triton' or 'torch'")
        check_run_meta(config, tags)
        identity.check(resume, run_id)
        self.sites = tuple(s for s in SITES if s in set(sites))
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
        self.stats_backend = stats_backend  # "auto" becomes "torch" for good when the Triton path fails
        self.fused = bool(fused)
        self.errors = 0
        self.last_error: str | None = None
        self._logged: set = set()

        self._slots = Slots()
        self._pack = StepPack(self._slots)
        self._history = AmaxHistory(amax_history_len, margin, self._slots) if scaling == "delayed" else None
        self._layers: list[LayerHooks] = []
        self._probes: list[torch.Tensor] = []  # a parameter per watched model: where its tensors live
        self._step = 0
        self._token = 0  # changes at every step begin: a gradient hook from an older step is late
        self._closed = False
        self.reporting = False
        self.hist_now = False
        self._sink = HookSink(self)
        self._compiled = CompiledMode(self)  # the hooks traced into torch.compile graphs

        sends = not self.reduce or self.rank == 0  # under reduce_ranks rank 0 sends for all
        owns = transport is None
        self.resume = resume
        self.run_id = run_id  # the run's id; None until known when resuming by name
        self._resume_after: int | None = None  # the resumed run's last stored step
        if transport is None and sends:
            if resume == "never":
                self.run_id = identity.new_run_id(group, 1 if self.reduce else self.world)
            transport = make_transport(url, run, token, spool_dir, transport_options, self.rank, self.world,
                                       self.run_id, resume)
            if resume != "never":
                self._resume(transport)
        self._shipper = Shipper(transport if sends else None, owns, self.rank, self.reduce, self._error)
        self._shipper.set_run_meta(**{k: v for k, v in (("config", config), ("tags", tags)) if v is not None})
        self._begin(0)

    def _resume(self, transport) -> None:
        try:
            point = identity.resume_point(transport.url, transport.run, self.run_id, self.resume, transport.token)
        except Exception:
            transport.close(0)
            raise
        if point is not None:
            self.run_id = point.get("run_uid") or self.run_id
            self._resume_after = point.get("last_step")

    # ---- public API ----------------------------------------------------------------------------

    @property
    def current_step(self) -> int:
        """The step that the hooks are observing now."""
        return self._step

    def watch(self, model: nn.Module, *, prefix: str = "") -> Agent:
        """Hook every matching linear layer of ``model`` (names prefixed with ``prefix``); a warning says why when
        there is none. A compiled model (``torch.compile``) is watched inside its graph (``compiled``), whether
        compiled before or after."""
        given = model
        model = self._compiled.watch(model)
        selected = select_modules(model, self.modules, prefix)
        if not selected:
            log.warning("%s", discovery.nothing_watched(model, self.modules, prefix))
        for name, module in selected:
            if len(name) > _MAX_LAYER:
                raise ValueError(f"layer name longer than {_MAX_LAYER} characters: {name[:60]}...")
            fused = self.fused and hasattr(module, "fp8mon_stats")
            # fused=False (the reference for fused layers): hooks read every site of a fused-capable layer
            reference = not self.fused and hasattr(module, "fp8mon_stats")
            hooks = LayerHooks(name, module, self.sites, self._sink, skip=() if reference else None)
            for site, cast in torchao_sites.site_casts(module).items():  # torchao's Float8Linear casts
                self._sink.casts[(name, site)] = cast
            for site in hooks.sites:
                self._slots.get(name, site)
            weight = getattr(module, "weight", None)
            self._sink.sharded.register(name, module, hooks.sites)
            if "weight" in hooks.sites and is_dtensor(weight):
                # FSDP2 frees the gathered weight's memory after the layer: its row cannot wait for a shared launch
                self._sink.waiting.immediate.add(self._slots.get(name, "weight"))
            if {"grad_output", "grad_weight"} <= set(hooks.sites) and isinstance(weight, torch.Tensor) and \
                    weight.is_leaf and weight.requires_grad and not self._sink.late.on:
                self._sink.pairing.pairs.add(name)
            if fused:
                # a layer that casts its weight's gradient may take that row, which its hook otherwise reads
                grad_by_cast = "grad_weight" in hooks.sites and getattr(module, "fp8mon_grad_weight_by_cast", False)
                link = FusedLink(self, name, tuple(s for s in self.sites if s not in hooks.sites), grad_by_cast)
                # an attribute of the user's module that nn.Module's typing does not know
                module.fp8mon_stats = link  # type: ignore[assignment]
            elif hasattr(module, "fp8mon_stats"):
                module.fp8mon_stats = None  # type: ignore[assignment]
            self._layers.append(hooks)
            self._compiled.add(hooks)
        probe = next(model.parameters(), None)
        if probe is not None:
            self._probes.append(probe)
        self._compiled.traced(given)
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
        """Statistics a layer computed itself, e.g. in its fused quantize kernel: a ``stats.torch_path`` row
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
        self._sink.scales[(layer, site)] = (scale, amax_history)

    def grad_sq_norms(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[bool]]:
        """The sum of the squared L2 norms of those ``grads`` whose grad_weight rows this step's statistics took
        (on the Triton path, from the gradient as the last backward pass left it), from their rows: n mean^2 + M2 of
        the finite elements, in fp64 on their device; NaN if any of them holds NaN or Inf. Also which of ``grads``
        these are. A gradient-clipping pass need not read them again (``trainer.clip``). (None, all False) when no
        row of them was taken. A gradient changed in place since its row was taken (unscaled, accumulated into) is not
        counted; one changed out of torch's sight (an all-reduce) would be: call this before such changes."""
        return self._sink.grad_sq_norms(grads)

    def flush(self, timeout: float | None = None) -> bool:
        """Hand everything logged so far to the monitor; True when it was delivered."""
        return self._shipper.flush(timeout)

    def status(self):
        """Where delivery stands: a ``delivery.DeliveryStatus`` (state, delivered, pending, in_memory, set_aside,
        lost, last_error)."""
        return self._shipper.status()

    def close(self, timeout: float = 30.0, status: str | None = None) -> bool:
        """Remove the hooks, send what is pending (and the run ``status`` if given) and stop. Statistics
        gathered after the last ``log`` are sent as ``current_step``, except under ``reduce_ranks``
        (that would be a collective call the other ranks may not make): they are dropped."""
        if self._closed:
            return self._shipper.close(timeout)[0]
        self._closed = True
        self._compiled.close()
        for hooks in self._layers:
            hooks.remove()
            if isinstance(getattr(hooks.module, "fp8mon_stats", None), FusedLink):
                hooks.module.fp8mon_stats = None  # type: ignore[assignment]
        try:
            if not self.reduce:
                self._sink.pairing.release()  # into the pack: a grad_output whose grad_weight never came
                self._sink.pairing.end_of_pass()  # grad_weights whose backward pass did not end
            if not self.reduce and self._pack.written:
                self._end(self._step, {})
        except Exception as exc:
            self._error("close", exc)
        self._sink.pairing.drop()
        self._sink.waiting.close()
        ok, errors = self._shipper.close(timeout, status)
        self.errors += errors
        return ok

    def capture(self):
        """Wrap the CUDA-graph capture of one whole training step, inside ``torch.cuda.graph``; yields a
        ``StepRecord``, complete on exit, to hand to ``replayed`` after each replay of that graph::

            with torch.cuda.graph(g), agent.capture() as record:
                train_step()               # reads static inputs only
            stats.launch.captured_copies_done()  # the captured launches' tables: on the device before a replay
            g.replay(); agent.replayed(record); agent.log(step, loss=static_loss)

        The hooks and the layers' fused kernels run at capture, so the graph holds the statistics launches of a
        step of this kind (reporting or not, with or without the histogram); whatever the step left waiting for a
        later launch is launched before the capture ends. Nothing is computed until a replay."""
        return graph_capture.capture(self)

    def replayed(self, record: graph_capture.StepRecord) -> None:
        """A replay of the graph ``capture`` recorded has run in this step: its rows are the step's, as if the
        hooks had seen its tensors. Raises when this step is not of the captured kind or the agent's buffers
        moved since (a layer or site watched after the capture): then capture again."""
        graph_capture.replayed(self, record)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="failed" if exc_type is not None else "finished")

    # ---- step lifecycle --------------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        self._step = step
        self._token += 1
        self._sink.begin_step()
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
        self._compiled.arm(want)

    def _end(self, step: int, values: dict) -> None:
        self._sink.launch_pending()
        self._sink.sharded.finish()  # collective where sharded tensors are watched
        rows = None
        if self._pack.open:
            if self.reduce:
                rows = distributed.reduce_rows(self._pack.take(self._device()), self.group)
            elif self._pack.written:
                rows = self._pack.take(self._device())
            self._pack.open = False
            if rows is not None:
                self._sink.update_centers(rows)
        if self._history is not None:
            self._history.roll()
        self._ship(step, rows, values)

    def _device(self) -> torch.device:
        return self._probes[0].device if self._probes else torch.device("cpu")

    def _ship(self, step: int, rows: torch.Tensor | None, values: dict) -> None:
        if self._resume_after is not None and step <= self._resume_after:
            run = getattr(self._shipper.transport, "run", "")
            self._error("log", identity.step_error(step, self._resume_after, run))
            return
        self._shipper.ship(step, rows, values, self._slots.keys)

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{where}: {exc!r}"
        key = (where, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.error("fp8mon agent: %s failed (%r); training continues, further such errors are only counted",
                      where, exc, exc_info=exc if exc.__traceback__ else None)  # a raised one
