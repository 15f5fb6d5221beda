"""Statistics of sharded tensors (DTensor: FSDP2's parameters and gradients, any placement), exact across shards.

A rank holds one shard of an FSDP2 weight or gradient; the row it sends is that of the whole tensor, exactly as if
the tensor had been gathered. Where a hook hands the agent a DTensor of a watched weight or grad_weight (a
*registered* slot: ``register`` at ``watch``), on a reporting step:

* its local shard (``to_local()``: without the padding of uneven shards) is copied: the step's optimizer update,
  a gradient clip or ``zero_grad`` would change it before the step ends. The copies of a step's watched shards (1/world
  of the tensors) live until the step's end;
* at the step's end (``finish``, on every rank, before the step's rows are taken): each rank's rows of its shards go
  through the rank reduction once per shard group (``distributed.reduce_rows``: all_reduces of O(rows) bytes):
  every rank holds the rows of the whole tensors; amax, moments, zero/nonzero/non-finite counts and the histogram
  are then exact. The counts that need the whole tensor before they can be counted, underflow/overflow at its
  current scale (fmt.max over the whole tensor's amax) and outliers against its mean and std, are counted on each
  shard with those and summed by one ``all_reduce``. A given scale (``set_scale``) or delayed scaling's is used as given.
* Under ``reduce_ranks`` a rank's row is its shard's, with those counts; the agent's rank merge then makes the
  whole tensor's row (of the concatenation over replicas, with a replicated mesh dimension, as for DDP).

Under delayed scaling a sharded tensor's amax entering the history is the whole tensor's (an ``all_reduce`` MAX at
every step's end). The rows are computed with the torch path (``stats.torch_path``) on the shards' device, also
where the other rows take the Triton path. Every rank must end every step (``log``/``step``) in lockstep, as FSDP's
own collectives require; statistics pending at ``close`` are dropped.

A DTensor in a slot not registered (or sharded otherwise than its registration) is gathered where the hook sees it
(``full_tensor()``, a collective there); one replicated on every mesh dimension is its local tensor; a partial one is
made replicated first.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import distributed
from .stats import launch as ts
from .stats import torch_path as ds

__all__ = ["ShardedRows", "is_dtensor"]

_SHARDED_SITES = ("weight", "grad_weight")
_COUNTS = [ds.OUTLIERS, ds.UNDERFLOW, ds.OVERFLOW]  # counted at the whole tensor's scale and center


def is_dtensor(x) -> bool:
    # (a DTensor exists only once its module is imported; importing it here would cost every agent a second)
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(x, dtensor.DTensor)


def _shard_groups(x) -> tuple:
    """The process groups of the mesh dimensions over which ``x`` is split (neither replicated nor partial)."""
    return tuple(x.device_mesh.get_group(d) for d, p in enumerate(x.placements)
                 if not p.is_replicate() and not p.is_partial())


def _without_partial(x):
    if any(p.is_partial() for p in x.placements):
        from torch.distributed.tensor import Replicate

        x = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    return x


@dataclass
class _Held:
    shards: list = field(default_factory=list)  # local shards (copies), merged in order
    fmt: object = None
    scale: object = None  # None: current scaling from the whole tensor's amax
    amax_history_max: object = None
    emulated: bool = False  # delayed scaling emulated by the agent: the step's amax enters its history


class ShardedRows:
    """The sharded slots of one agent and what a step holds of them."""

    def __init__(self, agent):
        self.agent = agent
        self.groups: dict[int, tuple] = {}  # slot -> shard groups, in registration order (the same on every rank)
        self._held: dict[int, _Held] = {}
        self._amax: dict[int, torch.Tensor] = {}  # non-reporting steps under delayed scaling: the shards' amax
        self._lock = threading.Lock()  # hooks may run on autograd's device threads

    def register(self, layer: str, module, sites) -> None:
        """The weight and grad_weight slots of ``layer`` whose weight is sharded (call in the same order on every
        rank, before the first step that observes them)."""
        weight = getattr(module, "weight", None)
        if not is_dtensor(weight):
            return
        groups = _shard_groups(weight)
        if groups:
            for site in _SHARDED_SITES:
                if site in sites:
                    self.groups[self.agent._slots.get(layer, site)] = groups

    # ---- what the hooks hand over ---------------------------------------------------------------------------------

    def take(self, slot: int, x, fmt, scale, amax_history_max, emulated: bool, replace: bool):
        """A DTensor observed as ``slot``: None when held here for the step's end, else the plain tensor the caller
        observes instead (the whole tensor)."""
        x = _without_partial(x)
        groups = _shard_groups(x)
        if not groups:
            return x.to_local()
        if self.groups.get(slot) != groups:
            return x.full_tensor()
        local = x.to_local().detach()
        with self._lock:
            if not self.agent.reporting:
                if emulated:
                    a = ds.amax(local)
                    before = self._amax.get(slot)
                    self._amax[slot] = a if before is None else torch.maximum(before, a)
                return None
            held = self._held.get(slot)
            if held is None or replace:
                held = self._held[slot] = _Held([], fmt, scale, amax_history_max, emulated)
            held.shards.append(local.clone())
        return None

    # ---- the step's end -------------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Write the step's rows of the sharded slots into the step's pack (a reporting step), or feed the whole
        tensors' amax to the delayed-scaling history (another step under delayed scaling). Collective: every rank
        calls it at the end of every step."""
        agent = self.agent
        with self._lock:
            held, amaxes, self._held, self._amax = self._held, self._amax, {}, {}
        if not self.groups or agent._closed or not (agent._pack.open or agent._history is not None):
            return
        by_groups: dict[tuple, list[int]] = {}
        for slot, groups in self.groups.items():
            by_groups.setdefault(groups, []).append(slot)
        for groups, slots in by_groups.items():
            if agent._pack.open:
                self._rows(groups, slots, held)
            elif agent._history is not None:
                self._amaxes(groups, slots, amaxes)

    def _rows(self, groups: tuple, slots: list[int], held: dict[int, _Held]) -> None:
        agent = self.agent
        entries = [(i, h, shard) for i, s in enumerate(slots) if (h := held.get(s)) is not None for shard in h.shards]
        device = entries[0][2].device if entries else agent._device()
        shards = [e[2] for e in entries]
        local = _merged_into(ds.empty(len(slots), device), entries,
                             self._computed(shards, fmt=None, center=None, hist=agent.hist_now))
        whole = local
        for group in groups:
            whole = distributed.reduce_rows(whole, group).to(device)
        # the counts that need the whole tensor: at its scale (current scaling), against its mean and std
        current = {f: ds.scale_from_amax(whole[:, ds.AMAX], f) for f in {e[1].fmt for e in entries} if f is not None}
        centers = torch.stack([whole[:, ds.MEAN], (whole[:, ds.M2] / whole[:, ds.N]).sqrt()], 1)  # n = 0: no outlier
        scales = [h.scale if h.scale is not None or h.fmt is None else current[h.fmt][i] for i, h, _ in entries]
        counted = _merged_into(ds.empty(len(slots), device), entries, self._computed(
            shards, fmt=[h.fmt for _, h, _ in entries], scale=scales, center=[centers[i] for i, _, _ in entries],
            amax_history_max=[h.amax_history_max for _, h, _ in entries], hist=False))
        if agent.reduce:
            out = local.clone()
            out[:, _COUNTS] = counted[:, _COUNTS]
        else:
            out = whole.clone()
            out[:, _COUNTS] = self._summed(counted[:, _COUNTS], groups)
        out[:, ds.SCALE] = counted[:, ds.SCALE]
        out[:, ds.AMAX_HISTORY_MAX] = counted[:, ds.AMAX_HISTORY_MAX]
        for i, slot in enumerate(slots):
            h = held.get(slot)
            if h is None:
                continue
            agent._pack.add(slot, out[i], replace=True)
            if h.emulated:
                agent._history.observe(slot, whole[i, ds.AMAX])

    def _computed(self, shards: list[torch.Tensor], *, fmt, center, hist: bool, scale=None,
                  amax_history_max=None) -> torch.Tensor:
        """``[len(shards), WIDTH]``: the rows of ``shards`` (per-shard arguments as lists) in one launch where the
        agent's hooks take the Triton path, else on the torch path."""
        agent = self.agent
        k = agent.outlier_k
        n = len(shards)
        if not n:  # a reporting step ended before its hooks saw a shard (``step`` jumping over it): no rows
            return ds.empty(0, agent._device())
        fmts, scales, centers, ahms = (ts.each(v, n) for v in (fmt, scale, center, amax_history_max))
        if shards and all(agent._sink._triton_for(x) and x.numel() and x.device == shards[0].device for x in shards):
            try:
                return ts.rows(shards, fmt=fmts, scale=scales, center=centers, outlier_k=k, amax_history_max=ahms,
                               hist=hist)
            except Exception as exc:
                if agent.stats_backend != "auto":
                    raise
                agent._error("Triton statistics (the torch path from now on)", exc)
                agent.stats_backend = "torch"
        # (the torch path counts outliers against the shard's own mean and std without a center: not taken then)
        return torch.stack([ds.partials(x, fmt=f, scale=s, amax_history_max=a, outlier_k=k, hist=hist,
                                        outlier_center=c) for x, f, s, c, a in zip(shards, fmts, scales, centers, ahms)])

    @staticmethod
    def _summed(counts: torch.Tensor, groups: tuple) -> torch.Tensor:
        """``counts`` summed over the ranks of ``groups`` (one all_reduce per group)."""
        device = distributed.collective_device(groups[0], counts.device)
        total = counts.to(device).contiguous()
        for group in groups:
            dist.all_reduce(total, group=group)
        return total.to(counts.device)

    def _amaxes(self, groups: tuple, slots: list[int], amaxes: dict[int, torch.Tensor]) -> None:
        history = self.agent._history
        device = next((a.device for a in amaxes.values()), self.agent._device())
        local = torch.stack([amaxes[s].to(device, torch.float32) if s in amaxes else
                             torch.zeros((), dtype=torch.float32, device=device) for s in slots])
        total = local.to(distributed.collective_device(groups[0], device))
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        total = total.to(device)
        for i, slot in enumerate(slots):
            if slot in amaxes:
                history.observe(slot, total[i])


def _merged_into(rows: torch.Tensor, entries: list, parts: torch.Tensor) -> torch.Tensor:
    """``rows`` with each entry's part merged into its row ``entries[j][0]``: one stack of the first part of each row
    (a step holds one shard per slot, but for repeated non-replacing observations), a merge for the others. (No
    index tensor: its host-to-device copy would wait for the device.)"""
    if not entries:
        return rows
    parts = parts.to(rows.device)
    out = list(rows.unbind(0))
    firsts = set()
    for j, (i, _, _) in enumerate(entries):
        out[i] = parts[j] if i not in firsts else ds.merge(out[i], parts[j])
        firsts.add(i)
    return torch.stack(out)
