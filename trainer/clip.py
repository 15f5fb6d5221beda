"""Gradient clipping by global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` does it, that takes the norms of the
gradients an agent has just read for their statistics from its rows instead of reading them again.

With an agent watching every block linear's ``grad_weight``, a reporting step reads each such gradient twice: once for
its statistics row at the end of the backward pass, once more for the clipping norm. Their rows hold n, the mean and
M2 of the finite elements in fp64, so their squared norm is n mean^2 + M2 (``Agent.grad_sq_norms``); only the other
gradients (embeddings, norms, the head) are read here, with ``torch._foreach_norm`` as torch does. The result equals
torch's up to rounding: torch sums fp32 per-tensor norms, this fp64 sums (a relative difference of about 1e-7 in the
norm and the clipping coefficient). A non-finite gradient makes the norm NaN (torch: NaN or Inf). Without an agent, or
on a step whose rows it did not take, this is ``clip_grad_norm_`` itself; a gradient changed in place after its row
(an AMP unscale) is read again. Call it before any change torch does not see (a distributed all-reduce: ``fp8mon
train`` uses it on one rank only).
"""

from __future__ import annotations

import torch


def clip_grad_norm(params, max_norm: float, agent=None) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so that their global L2 norm is at most ``max_norm``; return that
    norm before clipping (fp32, on the gradients' device), as ``torch.nn.utils.clip_grad_norm_(params, max_norm)``."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if agent is None or not grads or any(g.device != grads[0].device for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    sq, covered = agent.grad_sq_norms(grads)
    if sq is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    rest = [g for g, c in zip(grads, covered) if not c]
    if rest:
        sq = sq + torch.stack(torch._foreach_norm(rest)).double().square().sum()
    total = sq.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return total
