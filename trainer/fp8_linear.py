"""``Fp8Linear``: a linear layer whose forward GEMM and both backward GEMMs run in FP8.

    forward   y  = x Wᵀ          x: E4M3, W: E4M3     fast accumulation (recipe.fast_accum_fwd)
    dgrad     dx = G W            G: E5M2, W: E4M3     precise accumulation
    wgrad     dW = Gᵀ x           G: E5M2, x: E4M3     precise accumulation, fp32 output

Tensorwise scaling per tensor (``agent.formats``): current (s = fmt.max / amax of this tensor) or
delayed (s = fmt.max / max(amax history) / 2**margin; TE's recipe: history rolled on every forward,
index 0 newest, the scale of this call computed from the history *before* this call's amax). The
module keeps the fp32 master weight; the forward saves only the FP8 tensors and their scale_invs for
the backward, never the high-precision x.

Two paths, chosen per call (``module.backend``: "auto" | "triton" | "torch"):
  * Triton (CUDA, compute capability >= 8.9): ``trainer.kernels`` quantize_transpose (one pass writes
    the FP8 tensor and the transpose the other GEMM needs K-major) and fp8_gemm. No host sync.
  * torch reference (CPU, or CUDA without Triton FP8): torch float8 casts and ``torch._scaled_mm`` on CUDA,
    dequantize + fp32 matmul on the CPU or where _scaled_mm refuses a case (see ``fp8_gemm_ref``). Same scales,
    same casts, bit-identical FP8 tensors; GEMM results equal up to accumulation order.
  "triton" on CPU tensors runs the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1`` set
  before Triton is imported; tests only).

Host overhead: a forward + backward is about nine Triton launches plus autograd, so eagerly small layers are bound by
the host. The path has no host sync and allocates only through the caching allocator, so it can be captured in a CUDA
graph once every shape has run once (the first call of a shape compiles, autotunes and synchronizes).

Statistics: with an agent watching (it sets ``module.fp8mon_stats`` to its ``FusedLink``), on a reporting
step the quantize kernels of input, weight (E4M3) and grad_output (E5M2) also write those tensors' SPEC
section-4 rows, with the scale they cast with, straight into the agent's step buffer (``stats=`` of
``quantize_transpose``): no hook reads a GEMM input a second time. Under current scaling the weights' rows (and
amaxes) of a reporting step come from one launch for all layers at the first weight cast (``weight_rows``); each
weight's cast then reads its amax. The torch path computes the same rows with ``stats.torch_path.partials`` and reports
them. The row of ``output`` (y as returned, in its dtype) is Fp8Linear's too, unless a fused kernel that consumes y
takes it (``trainer.fused``). How it is taken (``output_stats_mode``): eagerly, by the forward GEMM's statistics
epilogue (``fp8_gemm(stats=)``), which adds no launch to a step that the agent's launches make host-bound; while a
CUDA graph captures the step, "deferred": the standalone statistics kernel's read of y joins the next statistics
launch on the device (``stats.launch.defer``: the next current-scaled cast's, which reads its input for its row in
place of the amax pass), the way of least device time, as a replay pays no launch's host time. y must then not be
modified in place before that launch (an in-place activation after the layer would be). No hook reads y.
``grad_weight`` is left to the agent's hook, whose row is read from ``weight.grad`` by the standalone statistics
kernel, once per backward pass for all layers together (``HookSink.observe_after_backward``); that read also gives
gradient clipping its norms (``trainer.clip``). A wgrad epilogue could take it (the row of weight.grad + dW, given
weight.grad), but it cost the wgrads more than one read of the fp32 gradient per step costs.

For the statistics fusion, after a forward (and backward) ``module.fp8_amax`` and ``module.fp8_scale``
map site -> fp32 0-d device tensor: "input", "weight" (forward), "grad_output" (backward). amax is
max |x| over finite elements of the high-precision tensor; scale is the one used for the cast. Reading
them costs nothing until someone copies them to the host.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from fp8mon.agent.formats import E4M3, E5M2, Fp8Format

from . import weight_rows

SITES = ("input", "weight", "grad_output")  # the quantized tensors
GEMM_SITES = ("output",)  # the GEMM results whose rows Fp8Linear takes (``output_stats_mode``)
_FORMATS = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}
_GEMM_STATS = {"ok": True}  # False once a GEMM with fused statistics failed: the statistics are then taken apart
log = logging.getLogger("fp8mon.fp8_linear")


@dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "current"  # "current" | "delayed"
    amax_history_len: int = 1024  # delayed scaling (TE defaults: 1024, algo max, margin 0)
    margin: int = 0
    fast_accum_fwd: bool = True  # fast accumulation in the forward GEMM, precise in the two backward GEMMs
    # Delayed scaling: after this many quantizations of a site (one per optimizer step without gradient
    # accumulation; for the weight under cache_fp8_weights, one per step always) its scale stops being
    # refreshed from the amax history: static scales calibrated over the first steps, or a history that
    # stopped updating. 0: refreshed at every step (TE's delayed scaling).
    freeze_scale_after: int = 0
    # False: a value past the format's range becomes NaN (E4M3) or +-Inf (E5M2), as in torch's own float8
    # conversion, instead of saturating to +-max: an FP8 stack that forgets to clamp (torch backend only)
    saturate: bool = True

    def __post_init__(self):
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"scaling must be 'current' or 'delayed', not {self.scaling!r}")
        if self.amax_history_len < 1:
            raise ValueError("amax_history_len must be >= 1")
        if self.freeze_scale_after < 0:
            raise ValueError("freeze_scale_after must be >= 0")
        if self.freeze_scale_after and self.scaling != "delayed":
            raise ValueError("freeze_scale_after applies to delayed scaling only")


def _triton_fp8_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _resolve_backend(requested: str, device: torch.device, recipe: Fp8Recipe = Fp8Recipe()) -> str:
    if requested == "auto":
        return "triton" if _triton_fp8_ok(device) and _recipe_ok_on_triton(recipe) else "torch"
    if requested not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', not {requested!r}")
    if requested == "triton" and not _recipe_ok_on_triton(recipe):
        raise ValueError("the Triton FP8 kernels always saturate and refresh delayed scales at every step: "
                         "Fp8Recipe(saturate=False) or freeze_scale_after needs the torch backend")
    return requested


def _recipe_ok_on_triton(recipe: Fp8Recipe) -> bool:
    """The Triton kernels saturate and refresh delayed scales at every step."""
    return recipe.saturate and not recipe.freeze_scale_after


class _State:
    """What the autograd function needs from the module (plain references, no module cycle)."""

    def __init__(self, module: Fp8Linear, backend: str, device: torch.device):
        self.recipe = module.recipe
        self.backend = backend
        self.amax = module.fp8_amax
        self.scale = module.fp8_scale
        self.link = module.fp8mon_stats  # the agent's FusedLink, or None
        consumer = module.fp8mon_output_consumer  # a fused kernel that takes the output row where it runs
        self.output_by_consumer = self.link is not None and consumer is not None and consumer(device)
        self.weight = module.weight  # its .grad: what the wgrad result accumulates into
        self.weight_cache = module.fp8_weight_cache
        self.weight_ready = module.fp8_weight_ready
        self.cache_weight = module.fp8_cache_weight
        self.delayed = module.recipe.scaling == "delayed"
        if self.delayed:
            self.history = {s: getattr(module, f"amax_history_{s}") for s in SITES}
            self.next_scale = {s: getattr(module, f"scale_{s}") for s in SITES}
            self.accum = {s: getattr(module, f"amax_accum_{s}") for s in SITES}
            if module.recipe.freeze_scale_after:
                self.updates = {s: getattr(module, f"scale_updates_{s}") for s in SITES}

    def quantize(self, site: str, x2d: torch.Tensor, want_q: bool, want_t: bool):
        """(q, q_t, scale_inv): q (M, N) and/or q_t (N, M) K-major FP8 of the 2-D x."""
        fmt: Fp8Format = _FORMATS[site]
        link = self.link
        if self.backend == "triton":
            from .kernels import delayed_update, quantize_transpose

            # a weight's row and amax may come from this step's batch of weight rows (``weight_rows``)
            ready = weight_rows.take(link, self.weight_ready, x2d) \
                if site == "weight" and link is not None and not self.delayed else None
            target = link.target(site, x2d.device) if link is not None and ready is None else None
            if ready is not None:
                r = quantize_transpose(x2d, fmt, write_q=want_q, write_qt=want_t, stats=ready[0], amax_ready=ready[1])
            elif self.delayed:
                if target is not None:  # the history the scale of this call came from
                    target.amax_history_max = self.history[site].amax()
                r = quantize_transpose(x2d, fmt, scale=self.next_scale[site], accum=self.accum[site],
                                       write_q=want_q, write_qt=want_t, stats=target)
                delayed_update(self.accum[site], self.history[site], self.next_scale[site], r.meta, fmt,
                               self.recipe.margin)
            else:
                r = quantize_transpose(x2d, fmt, write_q=want_q, write_qt=want_t, stats=target)
        else:
            from fp8mon.agent.stats import torch_path as ds

            from .kernels import delayed_update_ref, quantize_ref

            wants = link is not None and link.wants(site)
            ahm = self.history[site].amax() if self.delayed and wants else None
            r = quantize_ref(x2d, fmt, scale=self.next_scale[site] if self.delayed else None, transpose=want_t)
            if not self.recipe.saturate:
                r = _unsaturated(x2d, r, fmt, want_t)
            if wants:
                link.report(site, ds.partials(x2d, fmt=fmt, scale=r.scale, amax_history_max=ahm,
                                              outlier_k=link.outlier_k, hist=link.hist))
            if self.delayed:
                scale = self.next_scale[site]
                kept = scale.clone() if self.recipe.freeze_scale_after else None
                delayed_update_ref(r.amax, self.history[site], scale, fmt, self.recipe.margin)
                if kept is not None:  # on the device: no host sync
                    count = self.updates[site]
                    scale.copy_(torch.where(count >= self.recipe.freeze_scale_after, kept, scale))
                    count.add_(1)
        self.amax[site] = r.amax
        self.scale[site] = r.scale
        return r.data, r.data_t, r.meta[2:3]

    def quantize_weight(self, weight: torch.Tensor, want_t: bool):
        """``quantize("weight", ...)``, and with weight caching on (``cache_fp8_weights``) cast once per
        optimizer step: the micro-batches of a step reuse the first one's FP8 weight and transpose (TE's FP8
        weight caching). The cache is dropped after each optimizer step (a step hook: a fused optimizer
        writes the weight without bumping its version counter), and is not used when the weight's data
        pointer or version changed (a checkpoint load), when the transpose is newly wanted, or when the agent
        still wants this step's weight row. Delayed scaling then rolls the weight's amax history once per
        optimizer step, not per micro-batch; the module's very first cast, made with an empty history (scale
        1), is not reused."""
        if not self.cache_weight:
            return self.quantize("weight", weight, want_q=True, want_t=want_t)
        key = (weight.data_ptr(), weight._version)
        hit = self.weight_cache[0]
        # due: the agent wants this step's weight row, or this step's batch took it and the cast adds its underflow
        due = self.link is not None and (self.link.due("weight") or self.weight_ready[0] is not None)
        if hit is not None and hit[0] == key and (hit[1][1] is not None or not want_t) and not due:
            return hit[1]
        out = self.quantize("weight", weight, want_q=True, want_t=want_t)
        # the first cast of a delayed-scaling module had an empty history (scale 1): not worth reusing
        if self.weight_cache[1] or not self.delayed:
            self.weight_cache[0] = (key, out)
        self.weight_cache[1] += 1
        return out

    def gemm(self, a, b, sa, sb, out_dtype, fast_accum, bias=None, site=None):
        """(a @ bᵀ) * sa * sb, a (M, K), b (N, K) FP8; with ``site`` also the statistics row of the result for the
        agent."""
        link = self.link if site is not None and not (site == "output" and self.output_by_consumer) else None
        if self.backend == "triton":
            from .kernels import fp8_gemm

            wanted = link is not None and link.wants(site)
            mode = output_stats_mode()
            fused = wanted and mode == "epilogue" and _GEMM_STATS["ok"]
            target = link.target(site, a.device) if fused else None
            if target is not None:
                try:
                    return fp8_gemm(a, b, sa, sb, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum,
                                    stats=target)
                except Exception as exc:  # a statistics variant that cannot compile or launch must not stop training
                    _GEMM_STATS["ok"] = False
                    log.error("FP8 GEMM with fused statistics failed (%r); computing %s statistics apart from now on",
                              exc, site)
            y = fp8_gemm(a, b, sa, sb, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)
            if wanted:
                self.side_stats(site, y, defer=mode == "deferred")
            return y
        from .kernels import fp8_gemm_ref

        y = fp8_gemm_ref(a, b, sa, sb, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)
        if link is not None:
            self.side_stats(site, y)
        return y

    def side_stats(self, site: str, value: torch.Tensor, defer: bool = False) -> None:
        """The row of ``value`` for the agent, computed apart from any kernel of the layer (``defer``: by the next
        statistics launch, ``stats.launch.defer``)."""
        link = self.link
        if link is None:
            return
        if self.backend == "triton":
            from fp8mon.agent.stats import launch as ts

            t = link.target(site, value.device)
            if t is not None and defer:
                ts.defer(value, t)
            elif t is not None:
                ts.rows([value], fmt=[t.fmt], center=[t.center], outlier_k=t.outlier_k, hist=t.hist, out=t.rows,
                        index=[t.index], merge=[t.merge])
        elif link.wants(site):
            from fp8mon.agent.stats import torch_path as ds

            link.report(site, ds.partials(value, fmt=link.fmt(site), outlier_k=link.outlier_k, hist=link.hist))


def output_stats_mode() -> str:
    """How the Triton path takes the output row in this call: "deferred" while the stream captures a CUDA graph (a
    replay pays no launch's host time, so the path of least device time wins), else "epilogue" (eager steps are
    host-bound with the agent on, and the epilogue adds no launch)."""
    return "deferred" if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() else "epilogue"


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: _State, out_dtype: torch.dtype, need_dx: bool, need_dw: bool):
        in_features = weight.shape[1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        with torch.autocast(x.device.type, enabled=False):  # the fallback matmul must stay fp32
            qx, qx_t, sx = state.quantize("input", x2, want_q=True, want_t=need_dw)
            qw, qw_t, sw = state.quantize_weight(weight, want_t=need_dx)
            y = state.gemm(qx, qw, sx, sw, out_dtype, state.recipe.fast_accum_fwd, bias, site="output")
        ctx.save_for_backward(qx_t if need_dw else None, qw_t if need_dx else None, sx, sw)
        ctx.state, ctx.x_dtype, ctx.w_dtype, ctx.lead = state, x.dtype, weight.dtype, lead
        ctx.has_bias = bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        qx_t, qw_t, sx, sw = ctx.saved_tensors
        state: _State = ctx.state
        out_features = grad_out.shape[-1]
        g2 = grad_out.reshape(-1, out_features)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        if need_dx or need_dw:
            with torch.autocast(grad_out.device.type, enabled=False):
                qg, qg_t, sg = state.quantize("grad_output", g2, want_q=need_dx, want_t=need_dw)
                if need_dx:  # (M, N) @ (N, K): B = Wᵀ stored (K, N)
                    dx = state.gemm(qg, qw_t, sg, sw, ctx.x_dtype, False).reshape(*ctx.lead, -1)
                if need_dw:  # (N, M) @ (M, K): A = Gᵀ (N, M), B = xᵀ stored (K, M)
                    dw = _wgrad(state, qg_t, qx_t, sg, sx, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.to(torch.float32).sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None


def _unsaturated(x2d: torch.Tensor, r, fmt: Fp8Format, want_t: bool):
    """``r`` as a cast without saturation gives it: every |s*x| past the format's range becomes NaN
    (E4M3, which has no infinity) or +-Inf (E5M2), as torch's own float8 conversion does."""
    scaled = x2d.to(torch.float32) * r.scale
    over = scaled.abs() > fmt.overflow_threshold
    lost = torch.full_like(scaled, math.nan) if fmt.name == "e4m3" else torch.copysign(torch.full_like(
        scaled, math.inf), scaled)
    data = torch.where(over, lost, r.data.to(torch.float32)).to(r.data.dtype)
    return r._replace(data=data, data_t=data.t() if want_t else None)


def _wgrad(state: _State, qg_t, qx_t, sg, sx, w_dtype) -> torch.Tensor:
    """dW in the weight's dtype (its grad_weight row comes from the agent's hook: see the module docstring)."""
    dw = state.gemm(qg_t, qx_t, sg, sx, torch.float32, False)
    return dw if w_dtype == torch.float32 else dw.to(w_dtype)


class Fp8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` (weight (out, in), optional bias) with FP8 GEMMs (see module docstring).

    ``forward(x)``: x of any leading shape, fp32 or bf16; returns the autocast dtype under autocast,
    else x's dtype. ``backend`` attribute: "auto" (Triton on CUDA sm89+, else torch) | "triton" | "torch".
    """

    fp8mon_linear = True
    FORMATS = _FORMATS  # the format each quantized site is cast to
    fp8mon_reported_sites = SITES + GEMM_SITES  # by the quantize kernels and the layer's own output row (docstring)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, recipe: Fp8Recipe = Fp8Recipe(),
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype if dtype is not None else torch.float32}
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.backend = "auto"
        self.fp8mon_stats = None  # set by agent.Agent.watch
        # ``fuses(device)`` of the module that consumes this layer's output and takes its row on the devices where its
        # kernel runs (``trainer.reporting.SiteRow``); this layer then does not
        self.fp8mon_output_consumer = None
        self.fp8_cache_weight = False  # set by cache_fp8_weights
        # [((data_ptr, version), (q, q_t, scale_inv)) or None, casts so far]: see _State.quantize_weight
        self.fp8_weight_cache: list = [None, 0]
        self.fp8_weight_ready: list = [None]  # the weight's row and amax from this step's batch (weight_rows)
        self.fp8_amax: dict[str, torch.Tensor] = {}
        self.fp8_scale: dict[str, torch.Tensor] = {}
        if recipe.scaling == "delayed":
            for site in SITES:
                self.register_buffer(f"amax_history_{site}",
                                     torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device))
                self.register_buffer(f"scale_{site}", torch.ones((), dtype=torch.float32, device=device))
                self.register_buffer(f"amax_accum_{site}", torch.zeros((), dtype=torch.float32, device=device),
                                     persistent=False)
                if recipe.freeze_scale_after:  # scale refreshes so far (saved: a resumed run stays frozen)
                    self.register_buffer(f"scale_updates_{site}", torch.zeros((), dtype=torch.int64, device=device))
        self.reset_parameters()

    @property
    def fp8mon_stats(self):
        """The agent's ``FusedLink`` (set by ``agent.Agent.watch``), or None. Setting one counts the layer in that
        agent's batches of weight rows (``weight_rows``)."""
        return self._fp8mon_stats

    @fp8mon_stats.setter
    def fp8mon_stats(self, link) -> None:
        self._fp8mon_stats = link
        if link is not None:
            weight_rows.register(self)

    def backend_on(self, device: torch.device) -> str:
        """The backend ("triton" | "torch") this layer's forward runs on ``device``."""
        return _resolve_backend(self.backend, device, self.recipe)

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scaling={self.recipe.scaling}")

    # torch.compile cannot trace the Triton launches inside the autograd function: the model compiles around
    # each Fp8Linear (a graph break), which still fuses the norms, RoPE and activations between them.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        grad = torch.is_grad_enabled()
        need_dx = grad and x.requires_grad
        need_dw = grad and self.weight.requires_grad
        state = _State(self, self.backend_on(x.device), x.device)
        return _Fp8LinearFn.apply(x, self.weight, self.bias, state, out_dtype, need_dx, need_dw)


def cache_fp8_weights(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Cast each ``Fp8Linear`` weight of ``model`` once per step of ``optimizer`` (see
    ``_State.quantize_weight``): worth it with gradient accumulation. Returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.fp8_cache_weight = True

    def drop(*_):
        for m in layers:
            m.fp8_weight_cache[0] = None

    optimizer.register_step_post_hook(drop)
    return len(layers)
