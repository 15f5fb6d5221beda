"""Module and tensor hooks on the watched linear layers: they hand tensors to the agent, nothing more.

Watched: every ``nn.Linear`` whose qualified name matches the regex, and any module that declares
itself a linear layer with ``fp8mon_linear = True`` (the trainer's FP8 linear): input = first
positional argument (or ``input=``), output = the returned tensor (or the first element of a returned
tuple), weight = ``module.weight``. A module that computes some sites' statistics itself (the fused
quantize kernel) lists them in ``fp8mon_reported_sites`` and calls ``Agent.report``; the hooks skip them.

Sites and when they are read:
  input, output   forward hook, every call (micro-batches and repeated calls are merged); the input in a
                  forward pre-hook instead, before the layer runs, where the hooks read no output
  weight          with the input or the output, first call of the step (the weight does not change within
                  a step)
  grad_output     tensor hook on the output, registered in the forward; every backward through it
  grad_weight     post-accumulate-grad hook on the weight: the accumulated ``.grad`` after each
                  backward, last one wins, i.e. with gradient accumulation the summed gradient the
                  optimizer sees. The agent reads it right away with the layer's grad_output where it
                  watches both through hooks, else with its next launch of that backward pass or at
                  the pass's end (an FP8 layer's: one launch for all). (Not a leaf: a tensor hook, the
                  gradient of one backward.)

Hooks are installed only while needed (a reporting step, or every step under delayed scaling) and
removed otherwise, so steps that report nothing run the model without any hook.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from .names import user_names
from .wire import SITES


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or bool(getattr(module, "fp8mon_linear", False))


def select_modules(model: nn.Module, pattern: str | re.Pattern | None, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """(name, module) of the linear layers whose name matches ``pattern`` (re.search); names are the user's module
    names, without the components wrappers add (``names.user_name``)."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    return user_names(model, prefix, lambda name, module: is_linear(module) and (rx is None or rx.search(name)))


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def input_of(args, kwargs) -> torch.Tensor | None:
    """A forward's input: its first positional argument, or ``input=``."""
    return first_tensor(args[0] if args else kwargs.get("input"))


class Sink(Protocol):
    """What the hooks call (``sink.HookSink`` implements it; every method must be safe to call and not raise)."""

    def active(self) -> bool: ...
    def observe(self, layer: str, site: str, x: torch.Tensor, once: bool = False, replace: bool = False) -> None: ...
    # optional: observe_many(layer, [(site, tensor, once, replace), ...]), several tensors at once
    # optional: observe_after_backward(layer, site, param): param.grad (replacing), read later in the same
    # backward pass, when its value is final
    def grad_hook(self, layer: str) -> Callable[[torch.Tensor], None] | None: ...


class LayerHooks:
    """The hooks of one watched layer; ``install``/``remove`` are idempotent."""

    def __init__(self, name: str, module: nn.Module, sites: Iterable[str], sink: Sink,
                 skip: Iterable[str] | None = None):
        skip = set(getattr(module, "fp8mon_reported_sites", ()) if skip is None else skip)
        self.name, self.module, self.sink = name, module, sink
        self.sites = tuple(s for s in SITES if s in set(sites) and s not in skip)
        self._handles: list = []
        self._weight = None  # the weight whose gradient hook is installed
        self._input_before = False
        # set by compiled.CompiledMode: the module's forward is read by its permanent hook (compiled.CompiledLayer),
        # whose presence Dynamo guards on; these hooks install only the weight's gradient hook
        self.traced = False

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles and getattr(self.module, "weight", None) is self._weight:
            return
        self.remove()  # (the weight was replaced since: FSDP2's fully_shard after watch, a reloaded state)
        self._weight = getattr(self.module, "weight", None)
        if not self.sites:
            return
        # Where the hooks read a layer's input and not its output, they read it before the layer runs, right after the
        # kernel that wrote it, while much of it is still in the GPU's L2 cache; read after the layer, it follows the
        # layer's own output through the cache. (Where they read both, one launch after the layer takes both.) The
        # weight, where watched, is read in the same launch as the input.
        self._input_before = "input" in self.sites and "output" not in self.sites and not self.traced
        if self._input_before:
            self._handles.append(self.module.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
        after = {"input", "output", "weight", "grad_output"} & set(self.sites)
        if self._input_before:
            after -= {"input", "weight"}  # the pre-hook's
        if after and not self.traced:
            self._handles.append(self.module.register_forward_hook(self._forward, with_kwargs=True))
        weight = getattr(self.module, "weight", None)
        if "grad_weight" in self.sites and isinstance(weight, torch.Tensor) and weight.requires_grad:
            if weight.is_leaf:
                self._handles.append(weight.register_post_accumulate_grad_hook(self._grad_weight))
            else:
                self._handles.append(weight.register_hook(self._grad_weight_tensor))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_pre(self, module, args, kwargs) -> None:
        """``_input_before``: the input, with the weight, before the layer runs."""
        if torch.compiler.is_compiling():
            return  # in a compiled graph, compiled.CompiledLayer reads the layer
        if not module.training or not self.sink.active():
            return
        x = input_of(args, kwargs)
        self._observe(module, [("input", x, False, False)] if x is not None else [])

    def _forward(self, module, args, kwargs, output) -> None:
        if torch.compiler.is_compiling():
            return  # in a compiled graph, compiled.CompiledLayer reads the layer
        sink, name, sites = self.sink, self.name, self.sites
        if not module.training or not sink.active():
            return  # evaluation passes between two steps are not training statistics
        y = first_tensor(output)
        if not self._input_before:
            x = input_of(args, kwargs)
            items = [("input", x, False, False)] if x is not None and "input" in sites else []
            if y is not None and "output" in sites:
                items.append(("output", y, False, False))
            self._observe(module, items)
        if y is not None and "grad_output" in sites and y.requires_grad:
            hook = sink.grad_hook(name)
            if hook is not None:
                y.register_hook(hook)

    def _observe(self, module, items: list) -> None:
        """The forward's ``items`` and the weight (where watched), in one call: the agent reads them in one launch."""
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and "weight" in self.sites:
            items = [*items, ("weight", weight, True, False)]
        if not items:
            return
        many = getattr(self.sink, "observe_many", None)
        if many is not None:
            many(self.name, items)
        else:
            for site, t, once, replace in items:
                self.sink.observe(self.name, site, t, once=once, replace=replace)

    def _grad_weight(self, param: torch.Tensor) -> None:
        took = getattr(self.sink, "cast_took", None)
        if param.grad is not None and took is not None and took(self.name, param.grad):
            return  # the layer's cast of the gradient took its row
        if param.grad is not None and self.sink.active():
            later = getattr(self.sink, "observe_after_backward", None)
            if later is not None:
                later(self.name, "grad_weight", param)
            else:
                self.sink.observe(self.name, "grad_weight", param.grad, replace=True)

    def _grad_weight_tensor(self, grad: torch.Tensor) -> None:
        if self.sink.active():
            self.sink.observe(self.name, "grad_weight", grad)
