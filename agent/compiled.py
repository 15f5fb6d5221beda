"""Statistics of models run under ``torch.compile``: hooks that Dynamo traces into the graph without a break.

The eager hooks (``hooks.LayerHooks``) do not work in a compiled graph: traced, they break it at every lock, tensor
hook and launch table; installed and removed per step, they change the module's hook set, which Dynamo guards on only
where it saw hooks at the trace (a graph traced without them never runs them; one traced with them recompiles when
they go). Here each watched layer gets one forward hook for good (``CompiledLayer``) once the agent knows the model is
compiled: it watched a compiled model (whose code compiled before, without the hook, is dropped), or Dynamo started a
compile while the agent was open (a start callback). From then on that hook is the layer's only module hook: run
eagerly it runs the eager hooks' reading; traced, it reads one flag, ``SWITCH.on`` (a reporting step, or any step
under delayed scaling), which Dynamo guards on: a compiled frame has exactly two variants, with and without the
statistics. ``close`` leaves the hook in place doing nothing (removing it would recompile) and the flag off: the
variant that runs then holds no statistics op, it is the un-monitored graph.

With the flag on, the graph calls the custom op ``fp8mon::forward_rows`` on the layer's input and output, and wraps
the output in ``_Tap``, an identity ``autograd.Function`` whose backward calls ``fp8mon::grad_rows`` on the gradient
(AOTAutograd traces it into the backward graph). The ops are opaque to the compiler: at run time they hand the
graph's tensors to the agent's sink, as the eager hooks do (the weights' rows ride with the first forward, the Triton
one-pass launch on CUDA reads each tensor once and writes straight into the step buffer, the torch path elsewhere),
so the rows are the eager agent's for the same tensors, and whether a step carries the histogram is read at run time
(no third variant). They read the tensors at once: the graph may reuse the memory afterwards. The layer is named by a
tensor of its own (``ident``, never modified, so the backward may keep it), not a number Dynamo would guard on
(blocks compiled one by one would each compile anew). An op the compiler must keep modifies an argument: the forward
op a shared token, the backward op (declared so; it does not) the gradient, which the backward returns. (A token
saved for the backward would be a saved tensor that later forwards modify; a fresh one is dead code. Where that
gradient is an input of the backward graph, the loss computed outside the compiled model, Inductor copies it once.)
grad_weight stays eager: the post-accumulate-grad hook runs after the compiled backward.

Why opaque ops and not traceable torch ops that Inductor could fuse (CPU, torch 2.13, two linears, four tensors per
reporting step, measured first): tracing ``stats.torch_path.partials`` plus the merge into the step buffer compiles
without a graph break, but as ~200 FX nodes per tensor (814 for the model), 500 KB of generated code and ~50 s of
compile; for GPT-2's 49 linears that is ~40 000 nodes, and fp64 multi-pass reductions (two-pass mean, central
moments, outliers, histogram) that Inductor would not fuse into the GEMMs anyway. The custom op: no graph break, two
variants, 29 KB of generated code, ~35 s (the model's own compile), and on CUDA one read of each tensor, as eagerly.

CUDA graphs (``mode="max-autotune"``, ``"reduce-overhead"``): the ops are tagged ``cudagraph_unsafe`` where torch has
the tag (Inductor partitions the graph around them) and the variant with statistics modifies an input, which Inductor
does not graph; either way they run at every reporting step, and the variant without statistics keeps its graph.
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch
from torch import nn

from .hooks import first_tensor, input_of

__all__ = ["SWITCH", "CompiledMode", "is_compiled", "uncompiled"]


class _Switch:
    """Whether the compiled graphs compute statistics now; Dynamo guards on ``on``."""

    on = False


SWITCH = _Switch()
_LAYERS: dict[int, weakref.ref] = {}  # address of a layer's ``ident`` -> CompiledLayer
_MODES: weakref.WeakSet = weakref.WeakSet()
_TOKENS: dict[torch.device, torch.Tensor] = {}
_registered = False  # the compile-start callback (where torch does not list them)


def _token(device) -> torch.Tensor:
    device = torch.device(device)
    t = _TOKENS.get(device)
    if t is None:
        t = _TOKENS[device] = torch.zeros(1, device=device)
    return t


def _layer(ident: torch.Tensor):
    ref = _LAYERS.get(ident.data_ptr())
    return None if ref is None else ref()


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

# Defined on a torch.library.Library, not with ``torch.library.custom_op``: the dispatcher then calls the function
# itself (about 4 us a call), where custom_op's Python layers (autograd, in-place-or-view, its backend wrapper) cost
# about 200 us, at two calls per watched layer and reporting step. Neither op returns a tensor, so no autograd
# formula is needed.
_LIB = torch.library.Library("fp8mon", "DEF")
_LIB.define("forward_rows(Tensor(a!) token, Tensor ident, Tensor? x, Tensor? y) -> ()", tags=_TAGS)
_LIB.define("grad_rows(Tensor(a!) grad, Tensor ident) -> ()", tags=_TAGS)


def _forward_rows(token: torch.Tensor, ident: torch.Tensor, x: Optional[torch.Tensor],  # noqa: UP045
                  y: Optional[torch.Tensor]) -> None:  # noqa: UP045
    layer = _layer(ident)
    if layer is not None:
        layer.forward_rows(x, y)


def _grad_rows(grad: torch.Tensor, ident: torch.Tensor) -> None:
    layer = _layer(ident)
    if layer is not None:
        layer.grad_rows(grad)


def _nothing(*args) -> None:
    return None


_LIB.impl("forward_rows", _forward_rows, "CompositeExplicitAutograd")
_LIB.impl("grad_rows", _grad_rows, "CompositeExplicitAutograd")
torch.library.register_fake("fp8mon::forward_rows", _nothing, lib=_LIB)
torch.library.register_fake("fp8mon::grad_rows", _nothing, lib=_LIB)


class _Tap(torch.autograd.Function):
    """Identity whose backward hands the gradient of a layer's output to ``fp8mon::grad_rows``."""

    @staticmethod
    def forward(ctx, y, ident):
        ctx.save_for_backward(ident)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        # the op is declared to modify the gradient (it does not): the backward's result depends on it, it is kept
        (ident,) = ctx.saved_tensors
        torch.ops.fp8mon.grad_rows(grad, ident)
        return grad, None


class CompiledLayer:
    """The traced hook of one watched layer (a ``hooks.LayerHooks``); its ops read the tensors at run time."""

    def __init__(self, hooks):
        self.hooks = hooks
        sites = hooks.sites
        self.input, self.output, self.weight = ("input" in sites), ("output" in sites), ("weight" in sites)
        self.grad = "grad_output" in sites
        probe = next(hooks.module.parameters(), None)
        device = probe.device if probe is not None else "cpu"
        self.token = _token(device)
        # which layer an op call is for: a tensor of the layer's, not a number, which Dynamo would guard on (blocks
        # compiled one by one would then each be compiled anew); never modified, so the backward may keep it
        self.ident = torch.zeros(1, device=device)
        _LAYERS[self.ident.data_ptr()] = weakref.ref(self)
        self.step_token = None  # the agent's step token at this layer's last forward with statistics
        self._handle = None

    def install(self) -> None:
        if self._handle is None and (self.input or self.output or self.weight or self.grad):
            self._handle = self.hooks.module.register_forward_hook(self._forward, with_kwargs=True)

    def detach(self) -> None:
        """The agent closed: the hook stays and does nothing (removing it would make Dynamo recompile the model)."""
        self.hooks = None
        _LAYERS.pop(self.ident.data_ptr(), None)

    def _forward(self, module, args, kwargs, output):
        if not torch.compiler.is_compiling():  # a layer run eagerly: the eager hooks' reading
            hooks = self.hooks
            return None if hooks is None else hooks._forward(module, args, kwargs, output)
        if not SWITCH.on or not module.training:
            return None
        y = first_tensor(output)
        x = input_of(args, kwargs) if self.input else None
        if self.input or self.output or self.weight:
            torch.ops.fp8mon.forward_rows(self.token, self.ident, x, y if self.output else None)
        if not (self.grad and y is not None and y.requires_grad):
            return None
        tapped = _Tap.apply(y, self.ident)
        return tapped if isinstance(output, torch.Tensor) else type(output)((tapped, *output[1:]))

    # ---- at run time, from the ops -------------------------------------------------------------------------------

    def forward_rows(self, x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        hooks = self.hooks
        agent = hooks.sink.agent
        try:
            if not hooks.sink.active():
                return
            self.step_token = agent._token
            items = [(site, t, False, False) for site, t in (("input", x), ("output", y)) if t is not None]
            with hooks.sink.waiting.copies():  # the graph may reuse the tensors' memory right after
                hooks._observe(hooks.module, items)  # the eager hooks' reading: the weight rides along
        except Exception as exc:
            agent._error("compiled forward", exc)

    def grad_rows(self, grad: torch.Tensor) -> None:
        agent = self.hooks.sink.agent
        try:
            if not self.hooks.sink.active():  # a variant with statistics run on another agent's reporting step
                return
            if self.step_token != agent._token:
                agent._error("grad_output", RuntimeError(
                    f"a gradient of step {agent.current_step - 1} arrived after log() closed it; call log() after "
                    "backward"))
                return
            with self.hooks.sink.waiting.copies():  # the graph may reuse its memory right after
                self.hooks.sink.observe(self.hooks.name, "grad_output", grad)
        except Exception as exc:
            agent._error("compiled grad_output", exc)


class CompiledMode:
    """One agent's compiled path: off until the agent watches a compiled model or Dynamo starts a compile."""

    def __init__(self, agent):
        self.agent = agent
        self.enabled = False
        self.want = False
        self.closed = False
        self.layers: list[CompiledLayer] = []
        _MODES.add(self)

    def watch(self, model: nn.Module) -> nn.Module:
        """The module to select layers from (a compiled wrapper's original); compiled mode on for compiled models.
        Registers the compile callback that turns it on when a model watched eagerly is compiled later."""
        compiled = is_compiled(model)
        self._guarded(_register_compile_callback)
        if compiled:
            self.enabled = True
        return uncompiled(model)

    def _guarded(self, fn, *args) -> None:
        """Dynamo internals that differ across torch versions: a failure is the agent's error, not the caller's."""
        try:
            fn(*args)
        except Exception as exc:
            self.agent._error("torch.compile support", exc)

    def traced(self, model: nn.Module) -> None:
        """After ``watch`` hooked the layers of ``model``: a compiled graph of it traced before, without the hooks,
        would run on without them (Dynamo guards on a module's hooks only where it saw some), so it is dropped."""
        if self.enabled:
            self._guarded(_drop_compiled_code, model)

    def add(self, hooks) -> None:
        layer = CompiledLayer(hooks)
        self.layers.append(layer)
        if self.enabled:
            self._trace(layer)

    def enable(self) -> None:
        if self.closed or self.enabled:
            return
        self.enabled = True
        for layer in self.layers:
            self._trace(layer)
        _update_switch()

    @staticmethod
    def _trace(layer: CompiledLayer) -> None:
        """The layer's forward is read by its compiled hook from now on, its eager module hooks go."""
        hooks = layer.hooks
        if not hooks.traced:
            hooks.traced = True
            if hooks.installed:
                hooks.remove()
                hooks.install()
        layer.install()

    def arm(self, want: bool) -> None:
        """Statistics wanted in this step (``Agent._arm``)."""
        self.want = want and not self.closed
        if "torch._dynamo" in sys.modules and self.layers:
            self._guarded(_register_compile_callback)
        _update_switch()

    def close(self) -> None:
        self.closed = True
        self.want = False
        for layer in self.layers:
            layer.detach()
        _update_switch()


def _update_switch() -> None:
    SWITCH.on = any(m.enabled and m.want and not m.closed for m in list(_MODES))


def _on_compile_start(*_args) -> None:
    for mode in list(_MODES):
        if not mode.closed and not mode.enabled and mode.layers:
            mode.enable()


def _register_compile_callback() -> None:
    """Dynamo's compile-start callback: a model watched before it was compiled gets its traced hooks before the
    first trace. (Importing Dynamo costs a second or so, once per process; ``torch._dynamo.reset()`` drops it.)"""
    global _registered
    from torch._dynamo import callback

    starts = getattr(callback.callback_handler, "start_callbacks", None)
    if (starts is None and not _registered) or (starts is not None and _on_compile_start not in starts):
        callback.on_compile_start(_on_compile_start)
        _registered = True


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is compiled (``torch.compile(m)`` or ``m.compile()``)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def _drop_compiled_code(model: nn.Module) -> None:
    """Drop what Dynamo compiled for the forward of the compiled modules in ``model``: it recompiles them."""
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import OptimizedModule, _debug_get_cache_entry_list

    for m in model.modules():
        if isinstance(m, OptimizedModule):
            m = m._orig_mod
        elif getattr(m, "_compiled_call_impl", None) is None:
            continue
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if code is not None and _debug_get_cache_entry_list(code):
            with convert_frame.compile_lock:
                reset_code(code)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its layers' names without ``_orig_mod.``), else ``model``."""
    if "torch._dynamo" not in sys.modules:
        return model
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model
