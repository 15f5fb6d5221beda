"""Ranks under torch.distributed, and the cross-rank reduction of a step's packed rows.

The reduction (``reduce_rows``) moves O(rows) bytes per rank, whatever the number of ranks: three
``all_reduce`` calls on buffers of the ``[slots, WIDTH]`` fp64 rows' size, no gather of every rank's rows.

1. SUM of the additive fields (parts, counts, histogram bins, n·mean) and MAX of amax, of -scale (the
   minimum scale) and of the amax-history max, with the flags that say which rank's row stands in where
   no merge happens (below);
2. with the global mean known, each rank shifts its central moments M2..M4 (about its own mean) to the
   global mean (Pebay's exact shift formulas, fp64), and a second SUM gives the merged moments.

The result is the exact pairwise merge (``stats.torch_path.merge_all`` of the gathered rows, ``Moments.merge``):
a row that observed nothing (parts 0) or an empty tensor (numel 0) is the identity, a side without finite
elements keeps the other's moments, absent (NaN) counts, histogram, amax and scale propagate, a NaN history
max is skipped. Where no rank or one rank has finite elements, the moments are that rank's as they are.
No host synchronisation: with NCCL the collectives are stream-ordered.

What the reduced record means, per statistic: everything equals the statistics of the concatenation of
all ranks' tensors, except (as in ``stats.Moments.merge``) ``outlier_frac``, counted on each rank
against that rank's own mean/std, and, under current scaling, ``underflow_frac``/``overflow_frac``,
counted at each rank's own scale: that is how each rank quantizes its shard. ``scale`` is the minimum
over ranks.

Every rank must take part in every reporting step's collective with the same slots (same model, same
``modules``/``sites``, same ``every``, ``report`` calls for the same layers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .stats.layout import AMAX, AMAX_HISTORY_MAX, HIST, M2, M3, M4, MEAN, NUMEL, PARTS, SCALE, N

NAN = float("nan")
_FINITE_RANKS = M2  # (columns of the first SUM that the rows' layout leaves free there)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group=None) -> tuple[int, int]:
    if not initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group, fallback: torch.device) -> torch.device:
    """The device the group's backend communicates from: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if fallback.type == "cpu" or "gloo" in backend:
        return torch.device("cpu")
    return fallback


def reduce_rows(rows: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' ``[slots, WIDTH]`` rows merged, on every rank (three all_reduces of O(slots) bytes)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = collective_device(group, rows.device)
    r = rows.to(device, non_blocking=True).to(torch.float64).contiguous()
    observed = r[:, PARTS] > 0
    merged = observed & (r[:, NUMEL] > 0)  # what the pairwise merge does not skip as an identity
    finite = merged & (r[:, N] > 0)
    sums, maxes = _first_round(r, rank, world, observed, merged, finite)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)

    n_all = sums[:, N]
    mean = sums[:, MEAN] / n_all.clamp(min=1.0)
    stand_in = torch.remainder(maxes[:, 3], world) == rank  # this rank's row stands in where nothing merges
    second = torch.cat([_shifted(r, finite, mean), torch.where(stand_in.unsqueeze(1), r, 0.0)], 1)
    dist.all_reduce(second, group=group)
    moments, fallback = second[:, :3], second[:, 3:]

    out = torch.empty_like(r)
    out[:, NUMEL:AMAX] = sums[:, NUMEL:AMAX]
    out[:, AMAX] = torch.where(sums[:, AMAX] > 0, NAN, maxes[:, 0])
    out[:, SCALE] = torch.where(sums[:, SCALE] > 0, NAN, -maxes[:, 1])
    out[:, AMAX_HISTORY_MAX] = torch.where(maxes[:, 2] == -torch.inf, NAN, maxes[:, 2])
    several = (sums[:, _FINITE_RANKS] > 1).unsqueeze(1)  # else one rank's moments (or none) stay as they are
    out[:, MEAN:M4 + 1] = torch.where(several, torch.cat([mean.unsqueeze(1), moments], 1), fallback[:, MEAN:M4 + 1])
    out[:, HIST:] = sums[:, HIST:]
    out = torch.where((maxes[:, 4] >= 0).unsqueeze(1), out, fallback)
    out[:, PARTS] = sums[:, PARTS]
    return out


def _first_round(r: torch.Tensor, rank: int, world: int, observed, merged, finite):
    """This rank's share of the first SUM (a row's layout: additive fields, n·mean at MEAN, NaN flags at AMAX and
    SCALE, the number of ranks with finite elements at M2) and of the MAX (amax, -scale, history max, the stand-in
    key, the last merged rank)."""
    m = merged.unsqueeze(1)
    sums = torch.where(m, r, 0.0)
    sums[:, PARTS] = r[:, PARTS]
    sums[:, MEAN] = torch.where(finite, r[:, N] * r[:, MEAN], 0.0)
    sums[:, AMAX] = (merged & r[:, AMAX].isnan()).to(r.dtype)
    sums[:, SCALE] = (merged & r[:, SCALE].isnan()).to(r.dtype)
    sums[:, _FINITE_RANKS] = finite.to(r.dtype)
    sums[:, M3:M4 + 1] = 0.0
    sums[:, AMAX_HISTORY_MAX] = 0.0
    # the rank whose row stands in: the last with finite elements, else the last merged, else the last that observed
    # something (an empty tensor), else the last rank, as the pairwise merge leaves it; key % world is that rank
    tier = finite.to(r.dtype) + merged.to(r.dtype) + observed.to(r.dtype)
    maxes = torch.stack([
        _or_lowest(merged, r[:, AMAX]),
        _or_lowest(merged, -r[:, SCALE]),
        _or_lowest(merged, r[:, AMAX_HISTORY_MAX]),
        tier * world + rank,
        merged.to(r.dtype) * (rank + 1) - 1,
    ], 1)
    return sums.contiguous(), maxes


def _or_lowest(keep: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.where(keep & ~v.isnan(), v, -torch.inf)


def _shifted(r: torch.Tensor, finite: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``[slots, 3]``: this rank's M2, M3, M4 about the global ``mean`` (0 without finite elements)."""
    f = finite.unsqueeze(1)
    n = torch.where(finite, r[:, N], 0.0)
    d = torch.where(finite, r[:, MEAN] - mean, 0.0)
    m2, m3, m4 = torch.where(f, r[:, M2:M4 + 1], 0.0).unbind(1)
    d2 = d * d
    return torch.stack([
        m2 + n * d2,
        m3 + 3.0 * d * m2 + n * d2 * d,
        m4 + 4.0 * d * m3 + 6.0 * d2 * m2 + n * d2 * d2,
    ], 1)
