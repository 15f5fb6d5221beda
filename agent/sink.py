"""The hook sink: what the layer hooks (``hooks.LayerHooks``) and the layers' fused kernels hand their tensors to.

It turns tensors into rows of the agent's step buffer (``pack.StepPack``): on the Triton path the tensors a hook
sees go to one launch that writes straight into the buffer (``stats.launch.rows``); on the torch path each is a
``stats.torch_path.partials`` row. Outliers on the Triton path are counted against the previous reporting step's mean
and std of the same (layer, site) (``centers``), which the kernel's single read needs before it starts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .batching import PendingRows
from .late_grads import LateGrads
from .pack import _grown
from .pairing import GradPairing
from .sharded import ShardedRows, is_dtensor
from .stats import launch as ts
from .stats import torch_path as ds

# sites whose row of a step is the last one written, not a merge: grad_weight is the accumulated gradient
# (the hooks observe param.grad after each accumulation), the layers report it as such
REPLACED = ("grad_weight",)


def _no_centers(k: int, device) -> torch.Tensor:
    return torch.full((k, 2), float("nan"), dtype=torch.float64, device=device)


class HookSink:
    """The sink of one agent (``hooks.Sink``); it reads the agent's step state (reporting, histogram, slots)."""

    def __init__(self, agent):
        self.agent = agent
        self.pairing = GradPairing(self.observe, self.observe_items, agent._error)
        self.waiting = PendingRows(self._launch_waiting, agent._error)
        self.centers: torch.Tensor | None = None  # [slots, 2] fp64: previous reporting step's (mean, std)
        self.scales: dict[tuple[str, str], tuple] = {}
        # (layer, site) -> the layer's own cast of the site (torchao_sites.SiteCast): x -> (x as cast, format, scales)
        self.casts: dict[tuple[str, str], Callable] = {}
        self.seen: set[int] = set()  # slots read once per step (weights) and read already
        # id(gradient) -> (slot, weak reference to it, its version then): the grad_weight rows the Triton path took
        # this step, for ``grad_sq_norms`` (weak: the optimizer frees the gradients after its step)
        self.grad_slots: dict[int, tuple[int, weakref.ref, int]] = {}
        # layer -> (data pointer, version, slot) of the gradient whose grad_weight row the layer's own cast took in
        # this backward pass (FusedLink.grad_weight_target): its hook then leaves that gradient alone. (The cast's
        # result becomes .grad as it is, but not as the same Python object: its memory tells it.)
        self.cast_grads: dict[str, tuple[int, int, int]] = {}
        self.sharded = ShardedRows(agent)
        self.late = LateGrads(self.observe_items, agent._error, on=agent.world > 1)

    def begin_step(self) -> None:
        self.seen = set()
        self.grad_slots = {}
        self.cast_grads = {}

    def launch_pending(self) -> None:
        """Launch what the step left waiting for a later statistics launch: rows a layer's kernels deferred
        (``stats.launch.defer``), a grad_output waiting for its grad_weight, grad_weights waiting for their pass's
        end."""
        self.late.flush()
        self.pairing.release()
        self.pairing.end_of_pass()
        self.waiting.flush()
        ts.flush_deferred()  # last: it also merges the rows the launches above left to it

    # ---- what the hooks call (hooks.Sink) ---------------------------------------------------------------------

    def active(self) -> bool:
        return self.agent.reporting or self.agent._history is not None

    def observe(self, layer: str, site: str, x: torch.Tensor, once: bool = False, replace: bool = False) -> None:
        self.observe_many(layer, [(site, x, once, replace)])

    def observe_many(self, layer: str, items) -> None:
        """Tensors of one layer, ``(site, tensor, once, replace)`` each, with the grad_weights waiting for a launch:
        on the Triton path one launch. A failure is counted (and logged once) per site, as if each had been
        observed alone."""
        if self.pairing.waiting() and any(it[0] == "grad_weight" for it in items):
            grad = self.pairing.take(layer)
            if grad is not None:
                items = [("grad_output", grad, False, False), *items]
        todo = [(layer, *it) for it in items]
        # The first forward of a reporting step that reads a weight reads every due hooked weight on its device in the
        # same launch: a step's weights cost one multi-tensor launch, not one small launch per linear. The weights do
        # not change within a step, so the rows are the same; a layer whose forward does not run that step still gets
        # its weight's row, as FP8 layers do (trainer.weight_rows).
        if self.agent.reporting:
            weight = next((it[1] for it in items if it[0] == "weight" and it[2]), None)
            if weight is not None and self.agent._slots.get(layer, "weight") not in self.seen:
                todo += self._due_weights(layer, weight.device)
        self.observe_items(todo + self.pairing.take_after(items[0][1].device if items else None))

    def observe_after_backward(self, layer: str, site: str, param: torch.Tensor) -> None:
        """``param.grad`` as ``site`` of ``layer`` (replacing), observed with the next launch of this backward pass
        or at its end, whichever comes first. A layer whose grad_output the hooks observe (a pair) is observed now,
        in one launch with its waiting grad_output (the same backward node produced both). With several ranks, after
        everything else the pass ends with (DDP's reduction: ``late_grads``)."""
        if self.late.on:
            self.late.add(layer, site, param)
        elif layer in self.pairing.pairs:
            self.observe_many(layer, [(site, param.grad, False, True)])
        else:
            self.pairing.after_backward(layer, site, param)

    def cast_took(self, layer: str, grad: torch.Tensor) -> bool:
        """Whether ``layer``'s own cast took the row of ``grad`` (its weight's gradient, unchanged since) in this
        backward pass; asked once, by the layer's grad_weight hook."""
        got = self.cast_grads.pop(layer, None)
        if got is None or got[:2] != (grad.data_ptr(), grad._version):
            return False
        self.grad_slots[id(grad)] = (got[2], weakref.ref(grad), grad._version)  # for clipping, as the hooks' reads
        return True

    def grad_hook(self, layer: str) -> Callable[[torch.Tensor], None]:
        agent = self.agent
        token = agent._token

        def hook(grad: torch.Tensor) -> None:
            if token != agent._token:
                agent._error("grad_output", RuntimeError(
                    f"a gradient of step {agent.current_step - 1} arrived after log() closed it; call log() after "
                    "backward"))
                return
            if layer in self.pairing.pairs and agent.reporting:
                self.pairing.hold(layer, grad)  # observed with the layer's grad_weight
            else:
                self.observe(layer, "grad_output", grad)

        return hook

    # ---- rows ----------------------------------------------------------------------------------------------------

    def _due_weights(self, layer: str, device) -> list:
        """Observe items of the hooked weights on ``device`` of the layers other than ``layer``, in training mode,
        not yet read this step."""
        out = []
        for hooks in self.agent._layers:
            module, name = hooks.module, hooks.name
            w = getattr(module, "weight", None)
            if name == layer or "weight" not in hooks.sites or not hooks.installed or not module.training or \
                    not isinstance(w, torch.Tensor) or w.device != device:
                continue
            if self.agent._slots.get(name, "weight") not in self.seen:
                out.append((name, "weight", w, True, False))
        return out

    def observe_items(self, items) -> None:
        """``(layer, site, tensor, once, replace)`` items: on the Triton path one launch (per device)."""
        agent = self.agent
        todo = []
        for layer, site, x, once, replace in items:
            try:
                slot = agent._slots.get(layer, site)
                if once:
                    if slot in self.seen:
                        continue
                    self.seen.add(slot)
                if is_dtensor(x):  # a shard: its row is merged across the shards at the step's end
                    fmt = agent.formats.get(site)
                    scale, ahm, emulated = self._scale_for(layer, site, slot, fmt, x.device)
                    x = self.sharded.take(slot, x, fmt, scale, ahm, emulated, replace)
                    if x is None:
                        continue
                else:
                    x, fmt, scale, ahm, emulated = self._cast_for(layer, site, slot, x)
                if not agent.reporting:
                    if emulated:
                        agent._history.observe(slot, ds.amax(x))
                    continue
                todo.append((slot, x, fmt, scale, ahm, emulated, replace, site))
            except Exception as exc:
                agent._error(f"hook {site}", exc)
        if todo:
            self._launch(todo)

    def _launch(self, todo) -> None:
        """Rows of ``todo`` items (``(slot, tensor, fmt, scale, ahm, emulated, replace, site)``): on the Triton path
        one launch, or waiting for a shared one (``batching``); else the torch path's rows."""
        # per-row scales (torchao's rowwise casts) take the torch path: the Triton kernels take one scale per tensor
        rowwise = [t for t in todo if not ds.is_scalar_scale(t[3])]
        todo = [t for t in todo if ds.is_scalar_scale(t[3])]
        if todo and self._triton_for(todo[0][1]) and all(t[1].device == todo[0][1].device for t in todo):
            try:
                self._observe_triton(todo)
                todo = []
            except Exception as exc:
                if not self._fall_back(todo, exc):
                    todo = []
        self._torch_rows(todo + rowwise)

    def _launch_waiting(self, todo) -> None:
        """The items that waited for a shared launch (``batching.PendingRows``)."""
        try:
            self._launch_triton(todo, _merged_later(todo))
            return
        except Exception as exc:
            if not self._fall_back(todo, exc):
                return
        self._torch_rows(todo)

    def _fall_back(self, todo, exc: Exception) -> bool:
        """After a failed Triton launch: whether the torch path takes ``todo`` (backend "auto": for good)."""
        agent = self.agent
        if agent.stats_backend != "auto":
            for t in todo:
                agent._error(f"hook {t[7]}", exc)
            return False
        # "auto" falls back to the torch path for good: these rows and all later ones are still taken
        agent._error("Triton statistics (the torch path from now on)", exc)
        agent.stats_backend = "torch"
        return True

    def _torch_rows(self, todo) -> None:
        agent = self.agent
        for slot, x, fmt, scale, ahm, emulated, replace, site in todo:
            try:
                row = ds.partials(x, fmt=fmt, scale=scale, amax_history_max=ahm, outlier_k=agent.outlier_k,
                                  hist=agent.hist_now)
                agent._pack.add(slot, row, replace=replace)
                if emulated:
                    agent._history.observe(slot, row[ds.AMAX])
            except Exception as exc:
                agent._error(f"hook {site}", exc)

    def _triton_for(self, x: torch.Tensor) -> bool:
        backend = self.agent.stats_backend
        if backend == "torch" or not ts.supports(x):
            return False
        if backend == "auto" and x.device.type != "cuda":
            return False
        return ts.available(x.device)

    def claim(self, slots: list[int], replace: list[bool], device) -> tuple[torch.Tensor, list[bool], torch.Tensor]:
        """The step buffer on ``device`` grown to every slot, whether each slot's row is merged into
        (already written this step, and not replaced), and the outlier centers; marks the slots written."""
        pack = self.agent._pack
        with pack._lock:
            pack.grow(device)
            merge = []
            for s, r in zip(slots, replace):  # in order: a slot twice (two micro-batches) merges the second
                merge.append(s in pack.written and not r)
                pack.written.add(s)
            self.centers = _grown(self.centers, len(self.agent._slots), device, _no_centers)
            return pack.rows, merge, self.centers

    def _observe_triton(self, todo) -> None:
        # rows no history reads now (delayed scaling's) wait for a launch shared with others (batching), with their
        # scale if they have one (a layer's own cast: a fresh tensor)
        if all(t[4] is None and not t[5] for t in todo) and all(self.waiting.can_wait(t[0], t[1]) for t in todo):
            self.waiting.add(todo)
            return
        self._launch_triton(todo, _merged_later(todo))

    def _launch_triton(self, todo, later: bool) -> None:
        agent = self.agent
        slots = [t[0] for t in todo]
        device = todo[0][1].device
        rows, merge, centers = self.claim(slots, [t[6] for t in todo], device)
        ts.rows([t[1] for t in todo], fmt=[t[2] for t in todo], scale=[t[3] for t in todo],
                center=[centers[s] for s in slots], outlier_k=agent.outlier_k,
                amax_history_max=[t[4] for t in todo], hist=agent.hist_now, out=rows, index=slots, merge=merge,
                later=later)
        for slot, x, fmt, scale, ahm, emulated, replace, site in todo:
            if emulated:
                agent._history.observe(slot, rows[slot, ds.AMAX])
            if site == "grad_weight" and replace:
                self.grad_slots[id(x)] = (slot, weakref.ref(x), x._version)

    def _cast_for(self, layer, site, slot, x):
        """(tensor, format, scale, amax_history_max, emulated-delayed?) for a tensor of the slot: the layer's own cast
        (``casts``) where it has one, else the agent's format of the site and ``_scale_for``."""
        cast = self.casts.get((layer, site))
        if cast is None:
            fmt = self.agent.formats.get(site)
            return (x, fmt, *self._scale_for(layer, site, slot, fmt, x.device))
        if not self.agent.reporting:
            return x, None, None, None, False
        x, fmt, scale = cast(x)
        return x, fmt, scale, None, False

    def _scale_for(self, layer, site, slot, fmt, device):
        """(scale, amax_history_max, emulated-delayed?) for a tensor of the slot."""
        if fmt is None:
            return None, None, False
        given = self.scales.get((layer, site))
        if given is not None:
            scale, history = (v() if callable(v) else v for v in given)
            ahm = history.detach().amax() if isinstance(history, torch.Tensor) else history
            if scale is not None:
                return scale, ahm, False
        history = self.agent._history
        if history is not None:
            scale, ahm = history.scale(slot, fmt, device)
            return scale, ahm, True
        return None, None, False

    def update_centers(self, rows: torch.Tensor) -> None:
        """The reporting step's (mean, std) per slot become the next steps' outlier centers (device ops)."""
        if self.centers is None:
            return
        k = min(rows.shape[0], self.centers.shape[0])
        r = rows[:k].to(self.centers.device)
        n = r[:, ds.N]
        new = torch.stack([r[:, ds.MEAN], (r[:, ds.M2] / n.clamp(min=1)).sqrt()], 1)
        seen = (r[:, ds.PARTS] > 0) & (n > 0)
        self.centers[:k] = torch.where(seen.unsqueeze(1), new, self.centers[:k])

    # ---- the layers' own kernels ---------------------------------------------------------------------------------

    def fused_target(self, layer: str, site: str, device) -> ts.Target | None:
        """Where a layer's kernel writes the row of ``site`` this step (None: nothing to compute). The slot
        is claimed: call it only right before the kernel that writes it."""
        agent = self.agent
        if not agent.reporting or site not in agent.sites:
            return None
        slot = agent._slots.get(layer, site)
        if site == "weight":
            if slot in self.seen:
                return None
            self.seen.add(slot)
        rows, merge, centers = self.claim([slot], [site in REPLACED], device)
        fmt = agent.formats.get(site)  # a GEMM epilogue's row takes this format's current scaling, as the hooks do
        return ts.Target(rows, slot, merge[0], centers[slot], agent.outlier_k, agent.hist_now, None,
                         None if fmt is None else fmt.name)

    def grad_sq_norms(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[bool]]:
        """See ``Agent.grad_sq_norms``."""
        self.waiting.flush()
        slots, covered = [], []
        for g in grads:
            got = self.grad_slots.get(id(g))
            hit = got is not None and got[1]() is g and g._version == got[2]
            covered.append(hit)
            if hit:
                slots.append(got[0])
        if not slots:
            return None, covered
        ts.merge_later()  # (their rows may wait for their merge)
        pack_rows = self.agent._pack.rows
        rows = pack_rows.index_select(0, ts.to_device(slots, pack_rows.device))
        n, mean, m2 = rows[:, ds.N], rows[:, ds.MEAN], rows[:, ds.M2]
        sq = torch.where(n > 0, n * mean * mean + m2, 0.0).sum()
        return torch.where((rows[:, ds.NONFINITE] > 0).any(), float("nan"), sq), covered


def _merged_later(todo) -> bool:
    """Whether the rows of ``todo`` can be merged by the launch that ends the step (``launch_pending``) rather than by
    their launch's last program: rows with no scale (the later merge knows none)."""
    return all(t[3] is None and t[4] is None for t in todo)
