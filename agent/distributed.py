"""Ranks under torch.distributed, and the cross-rank reduction of a step's packed rows.

The reduction is one ``all_gather`` of the ``[slots, WIDTH]`` fp64 buffer per reporting step, then an
exact pairwise merge in rank order on the device (amax max, counts and histograms summed, moments by
the Chan/Pebay formulas). No host synchronisation: with NCCL the collective is stream-ordered.

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

from .stats import torch_path as ds


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
    """All ranks' ``[slots, WIDTH]`` rows merged, on every rank (one all_gather)."""
    world = dist.get_world_size(group)
    device = collective_device(group, rows.device)
    local = rows.to(device, non_blocking=True).contiguous()
    gathered = torch.empty((world, *local.shape), dtype=local.dtype, device=device)
    dist.all_gather(list(gathered.unbind(0)), local, group=group)
    return ds.merge_all(gathered)
