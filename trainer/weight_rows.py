"""The weights' statistics rows of a reporting step, in one launch.

With current scaling on the Triton path, the row of a tensor about to be cast comes from the standalone statistics
kernel, in place of the cast's amax pass: one launch per cast. Each launch costs a chain of latencies over the amax
pass it replaces (set-up, per-program result, the last program's merge) whatever the tensor's size, so small weights
pay it the most. A model's
weights are known before its forward, so the first weight cast of a reporting step takes the rows and amaxes of
every due weight of the agent's ``Fp8Linear`` layers in one launch (``stats.launch.cast_rows``). Each layer's cast
then reads its amax (``quantize_transpose(amax_ready=)``) and adds its underflow count to its row, as after its own
launch.

A layer registers itself when an agent attaches to it (``register``, from ``Fp8Linear.fp8mon_stats``). A layer that
the batch covered but whose forward did not run that step keeps a row without its underflow count, and drops the
prepared amax at its next cast (the step or the weight no longer match).

A bf16 model's plain linears (``trainer.fused.own_weight_row``) cast their fp32 weights for autocast, each cast taking
the weight's row: there the first cast of a reporting step casts every due weight of the agent's such linears, rows
included, in one launch (``take_cast``, ``trainer.kernels.weight_casts``), and each linear's forward takes its cast
from it; the gradients' casts back, with their rows, take one launch too (``grads_together``). Such a linear
registers itself at its first forward with a link (``register_cast``).

Under FSDP2 a batch leaves out the weights that are sharded at that moment (the other blocks', between their
forwards): each block's first cast of a reporting step then batches that block's gathered weights.
"""

from __future__ import annotations

import weakref

import torch

from fp8mon.agent.sharded import is_dtensor
from fp8mon.agent.stats import launch as stats_launch

_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # agent -> WeakSet of its Fp8Linear layers
# agent -> WeakSet of its own_weight_row linears
_cast_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(module) -> None:
    """Count ``module`` (an ``Fp8Linear`` whose ``fp8mon_stats`` is an agent's link) in its agent's batches."""
    agent = getattr(module.fp8mon_stats, "agent", None)
    if agent is not None:
        _layers.setdefault(agent, weakref.WeakSet()).add(module)


def take(link, ready: list, weight: torch.Tensor):
    """``(target, amax)`` for this cast of ``weight``: its row target and the float32 tensor of 3 whose first element
    holds its amax, both prepared by this step's batch; None when the cast takes its row itself (or none).
    ``ready``: the layer's holder of what the batch prepared for it (``Fp8Linear.fp8_weight_ready``). The first
    call of a reporting step that finds its weight due launches the batch."""
    agent = getattr(link, "agent", None)
    if agent is None:
        return None
    got = _pop_current(ready, agent, weight)
    if got is None and link.due("weight"):
        _launch(agent, weight.device)
        got = _pop_current(ready, agent, weight)
    return got


def _pop_current(ready: list, agent, weight: torch.Tensor):
    got, ready[0] = ready[0], None
    if got is None:
        return None
    step, key, target, amax = got
    if step != agent.current_step or key != (weight.data_ptr(), weight._version):
        return None
    return target, amax


def _launch(agent, device: torch.device) -> None:
    """One ``cast_rows`` launch for every registered layer of ``agent`` on ``device`` whose weight row is due and
    whose cast takes its row in place of the amax pass (Triton, current scaling)."""
    items = []
    for module in list(_layers.get(agent, ())):
        link, weight = module.fp8mon_stats, module.weight
        if getattr(link, "agent", None) is not agent or module.recipe.scaling == "delayed" or is_dtensor(weight) or \
                weight.device != device or weight.dim() != 2 or not link.due("weight") or \
                module.backend_on(device) != "triton":
            continue
        target = link.target("weight", device)  # claims the row: the layer's own cast will not ask again
        if target is None:
            continue
        amax = torch.empty(3, dtype=torch.float32, device=device)
        items.append((weight, module.FORMATS["weight"], target, amax))
        module.fp8_weight_ready[0] = (agent.current_step, (weight.data_ptr(), weight._version), target, amax)
    if items:
        stats_launch.cast_rows(items, device)


def register_cast(module, link) -> None:
    """Count ``module`` (a plain linear of ``own_weight_row`` whose ``fp8mon_stats`` is ``link``) in its agent's batches
    of weight casts."""
    agent = getattr(link, "agent", None)
    if agent is not None:
        layers = _cast_layers.get(agent)
        if layers is None:
            layers = _cast_layers[agent] = weakref.WeakSet()
        if module not in layers:
            layers.add(module)


# The batch takes weights of at most this many elements. Small weights' casts are bound by their launches; a large
# weight's own cast, just before its GEMM, leaves the result in L2 for it, which the GEMM lost when the batch took it.
BATCH_MAX_ELEMENTS = 1 << 22


def grads_together() -> bool:
    """Whether the batch's weights are one autograd node (``kernels.weight_casts.weight_casts``), whose backward casts
    all their gradients back in one launch at the end of the backward pass, or each its own (``residual.weight_cast``:
    a launch per gradient, as it comes): together unless torch.distributed is initialized, where a data-parallel wrapper
    reduces each gradient as it comes, overlapping the backward pass."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def take_cast(module, link, dtype: torch.dtype) -> torch.Tensor | None:
    """This step's cast of ``module``'s weight to ``dtype`` from the batch (its row already taken), differentiable, or
    None. The first call of a reporting step that finds its weight due launches the batch: every registered linear of
    the agent whose weight is due, castable, on the same device and of at most ``BATCH_MAX_ELEMENTS``, cast to
    ``dtype``."""
    agent = getattr(link, "agent", None)
    weight = module.weight
    if agent is None or weight.numel() > BATCH_MAX_ELEMENTS:
        return None
    got = _pop_cast(module, agent, weight, dtype)
    if got is None and link.due("weight"):
        _launch_casts(agent, weight.device, dtype)
        got = _pop_cast(module, agent, weight, dtype)
    if got is None:
        return None
    cast, differentiable = got
    if differentiable:
        return cast
    from .kernels.residual import weight_cast

    return weight_cast(weight, dtype, None, link, cast)


def _pop_cast(module, agent, weight: torch.Tensor, dtype: torch.dtype):
    got = module.__dict__.pop("fp8mon_cast_ready", None)
    if got is None:
        return None
    step, key, cast, differentiable = got
    if step != agent.current_step or key != (weight.data_ptr(), weight._version) or cast.dtype != dtype:
        return None
    return cast, differentiable


def _launch_casts(agent, device: torch.device, dtype: torch.dtype) -> None:
    from .kernels import weight_casts as wc

    modules, weights, targets = [], [], []
    for module in list(_cast_layers.get(agent, ())):
        link, weight = getattr(module, "fp8mon_stats", None), module.weight
        if getattr(link, "agent", None) is not agent or not module.training or is_dtensor(weight) or \
                weight.device != device or \
                weight.dtype != torch.float32 or not wc.castable(weight) or weight.numel() > BATCH_MAX_ELEMENTS or \
                not link.due("weight"):
            continue
        target = link.target("weight", device)  # claims the row: the layer's own forward will not ask again
        if target is not None:
            modules.append(module)
            weights.append(weight)
            targets.append(target)
    if not modules:
        return
    together = grads_together()
    if together:
        casts = wc.weight_casts(weights, dtype, targets, [m.fp8mon_stats for m in modules])
    else:  # each linear's forward makes its cast differentiable (take_cast)
        casts = wc.grouped_casts([w.detach() for w in weights], dtype, targets)
    for module, weight, cast in zip(modules, weights, casts):
        module.fp8mon_cast_ready = (agent.current_step, (weight.data_ptr(), weight._version), cast, together)
