"""Layer names as the user wrote them, whatever wrapper surrounds the modules.

Wrappers add components to ``named_modules()``: ``module.`` (DistributedDataParallel, DataParallel), ``_orig_mod.``
(torch.compile), ``_fsdp_wrapped_module.`` (FSDP1), ``_checkpoint_wrapped_module.`` (activation checkpointing).
The records of a layer carry one name however the model is wrapped, so a run compares with another. A user's own
submodule called ``module`` keeps its name: the component goes only where its parent is a DDP/DataParallel wrapper.
"""

from __future__ import annotations

from torch import nn

__all__ = ["user_name", "user_names"]

# torch's own attribute names of the wrapped module, never a user's
_RESERVED = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _is_data_parallel(module: nn.Module) -> bool:
    return isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def user_name(root: nn.Module, qualified: str) -> str:
    """``qualified`` (a name from ``root.named_modules()``) without the components that wrappers added."""
    if not qualified:
        return qualified
    kept = []
    parent = root
    for part in qualified.split("."):
        child = parent._modules[part]
        if part not in _RESERVED and not (part == "module" and _is_data_parallel(parent)):
            kept.append(part)
        parent = child
    return ".".join(kept)


def user_names(root: nn.Module, prefix: str = "", keep=lambda name, module: True) -> list[tuple[str, nn.Module]]:
    """(user name, module) of the modules of ``root`` that ``keep(user name, module)`` accepts, in ``named_modules``
    order, the names prefixed with ``prefix``. Two of them with one user name are a ValueError. (A wrapper and the
    module it wraps have one name: keep at most one of them.)"""
    base = prefix.rstrip(".")
    out, owner = [], {}
    for qualified, module in root.named_modules():
        # the model itself, watched without a prefix: its class name (the monitor takes no empty layer name)
        name = ".".join(p for p in (base, user_name(root, qualified)) if p) or type(module).__name__
        if not keep(name, module):
            continue
        if name in owner:
            raise ValueError(f"modules {owner[name]!r} and {qualified!r} both have the layer name {name!r} once "
                             "their wrappers' components (module., _orig_mod., _fsdp_wrapped_module., "
                             "_checkpoint_wrapped_module.) are left out; rename one of them")
        owner[name] = qualified
        out.append((name, module))
    return out
