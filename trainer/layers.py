"""The building blocks: RMSNorm, RoPE, attention (with FOG's frozen QK-norm), SwiGLU and xIELU MLPs.

Block GEMMs come from a ``make_linear(in_features, out_features)`` factory so that the same code builds
``nn.Linear`` (bf16/fp32) or ``Fp8Linear`` (fp8). Norms, RoPE and activations compute in fp32 and return
their input's dtype.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MakeLinear = Callable[[int, int], nn.Module]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension in fp32, in x's dtype: torch's ops (trainer.kernels.rmsnorm's reference)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


# RMSNorm as one Triton kernel each way (trainer.kernels.rmsnorm) where Triton runs and x is contiguous, for every
# RMSNorm of the model; llama's pre-norms also take, for the agent, the row of the qkv's and fc1's input from their
# write of it (a plain linear's, marked as the block's at construction; an FP8 linear's cast takes its own).
# FP8MON_FUSED_NORM=0 gives torch's ops.
FUSED_NORM = os.environ.get("FP8MON_FUSED_NORM", "1") == "1"


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g. ``learnable=False`` keeps g as a buffer (frozen, never in the
    optimizer): FOG's QK-norm gains are fixed at 1."""

    def __init__(self, dim: int, eps: float = 1e-6, init: float = 1.0, learnable: bool = True):
        super().__init__()
        self.eps = eps
        gain = torch.full((dim,), float(init))
        if learnable:
            self.weight = nn.Parameter(gain)
        else:
            self.register_buffer("weight", gain)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether the forward of x runs the Triton kernels (and can take y's row)."""
        if not (FUSED_NORM and triton_runs(x.device)):
            return False
        from .kernels.rmsnorm import supports

        return supports(x, self.weight)

    def forward(self, x: torch.Tensor, stats=None) -> torch.Tensor:
        """``stats``: a ``triton_stats.Target`` for y's row, taken where ``fused(x)`` (else ignored)."""
        if self.fused(x):
            from .kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, stats=stats)
        return rms_norm_torch(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, learnable={isinstance(self.weight, nn.Parameter)}"


class Rotary(nn.Module):
    """RoPE, rotate-half layout: channel i pairs with i + head_dim/2 and turns by angle pos * theta^(-2i/hd).
    A rotation per pair, so it preserves every vector's norm and <R_m q, R_n k> depends on m - n only."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: (..., T, head_dim), positions offset .. offset + T - 1."""
        t = x.shape[-2]
        if offset + t > self.cos.shape[0]:
            raise ValueError(f"sequence of {offset + t} positions exceeds RoPE's max_seq_len {self.cos.shape[0]}")
        cos, sin = self.cos[offset:offset + t], self.sin[offset:offset + t]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


# RoPE on the qkv output as one Triton kernel each way (trainer.kernels.rope) where Triton runs, for attention without
# QK-norm (llama) and heads of a power of two from 16. It also takes, for the agent, the row of the qkv linear's output
# from its read of it (an FP8 qkv then leaves it to the kernel; a plain one's is marked as the block's at
# construction), and a plain qkv's grad_output row from the backward's write of it: no second read of them. On by
# default (bench/RESULTS.md: about ten times faster than torch's Rotary on the permuted views, and the rows cheaper
# than reads apart); FP8MON_FUSED_ROPE=0 gives torch's ops.
FUSED_ROPE = os.environ.get("FP8MON_FUSED_ROPE", "1") == "1"


# The attention's heads merged back for its projection as one Triton kernel (trainer.kernels.heads) where Triton runs,
# in place of torch's copy (faster, bench/RESULTS.md); FP8MON_FUSED_HEADS=0 gives torch's copy. With HEADS_ROW it also
# takes, for the agent, a plain projection's input row from its write of it (marked as the block's at construction; an
# FP8 projection's cast takes its own) rather than the hooks reading it: off, as in a step it cost what the hooks'
# read costs (bench/RESULTS.md).
FUSED_HEADS = os.environ.get("FP8MON_FUSED_HEADS", "1") == "1"
HEADS_ROW = os.environ.get("FP8MON_HEADS_ROW", "0") == "1"


class Attention(nn.Module):
    """Causal multi-head attention; ``qkv`` is one fused GEMM producing [q | k | v].

    llama: logits = q.k / sqrt(head_dim), RoPE on q, k.
    fog:   q^, k^ = RMSNorm per head with a frozen gain of 1, then RoPE, logits = 0.125 * q^.k^.
           RMSNorm gives ||q^|| <= sqrt(head_dim) (RMS <= 1), RoPE preserves norms, so by Cauchy-Schwarz
           |logit| <= 0.125 * head_dim (16 at head_dim 128) whatever the weights do.
    """

    def __init__(self, d_model: int, n_head: int, make_linear: MakeLinear, qk_norm: bool,
                 softmax_scale: float | None = None, eps: float = 1e-6):
        super().__init__()
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = make_linear(d_model, 3 * d_model)
        self.proj = make_linear(d_model, d_model)
        self.q_norm = RMSNorm(self.head_dim, eps, learnable=False) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, learnable=False) if qk_norm else None
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None
        hd = self.head_dim
        self.fused_rope = FUSED_ROPE and not qk_norm and hd >= 16 and not hd & (hd - 1)
        if self.fused_rope:
            mark_reported(self.qkv, "output", "grad_output")
        self.fused_heads = FUSED_HEADS and hd >= 8 and not hd & (hd - 1)
        self.heads_row = self.fused_heads and HEADS_ROW
        if self.heads_row:
            mark_reported(self.proj, "input")

    def heads(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, H, T, head_dim), q and k normed (fog) and rotated."""
        b, t, d = x.shape
        fused = self.fused_rope and triton_runs(x.device) and t <= rope.cos.shape[0]
        link = take_output(self.qkv, fused) if self.fused_rope else None
        grad_link = link if type(self.qkv) is nn.Linear else None  # an FP8 qkv's backward cast takes its grad_output
        out = self.qkv(x)
        if fused:
            from .kernels.rope import rope_qkv

            grad_target = (lambda: target_of(grad_link, "grad_output", out)) if grad_link is not None else None
            return rope_qkv(out, rope.cos, rope.sin, self.n_head, stats=target_of(link, "output", out),
                            grad_stats=grad_target)
        report_apart(link, "output", out)
        report_grad_apart(grad_link, out)
        q, k, v = out.view(b, t, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q), rope(k), v

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        q, k, v = self.heads(x, rope)
        if self.track_max_logit:
            self.max_logit = self._max_logit(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.proj(self.merged(y))

    def merged(self, y: torch.Tensor) -> torch.Tensor:
        """The heads y (B, H, T, head_dim) as the projection's input (B, T, d); with ``heads_row`` (set at construction,
        which marked a plain projection's input as the block's) its row, taken by the kernel that merges them or apart.
        In evaluation, no row: the hooks take none either."""
        b, h, t, hd = y.shape
        plain = self.heads_row and type(self.proj) is nn.Linear and self.proj.training  # an FP8 one's cast takes it
        link = getattr(self.proj, "fp8mon_stats", None) if plain else None
        if self.fused_heads and triton_runs(y.device):
            from .kernels.heads import merge_heads

            return merge_heads(y, stats=target_of(link, "input", y))
        out = y.transpose(1, 2).reshape(b, t, h * hd)
        report_apart(link, "input", out)
        return out

    @torch.no_grad()
    def _max_logit(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Largest causal pre-softmax logit of the first sequence (cheap: only on reporting steps)."""
        s = (q[:1].float() @ k[:1].float().transpose(-1, -2)) * self.scale
        t = s.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~causal, float("-inf")).amax()


# SwiGLU's elementwise part as one Triton kernel each way (trainer.kernels.swiglu) where Triton runs. It also takes, for
# the agent, the rows of fc1's output (an FP8 fc1 then leaves it to the kernel) and, for plain linears, of fc2's input
# and fc1's grad_output, from the tensors it reads and writes: no second read of the block's largest tensors. Read at
# construction (a plain linear's rows are marked as the block's then). On by default (bench/RESULTS.md: the step is
# faster and the agent's rows cheaper); FP8MON_FUSED_SWIGLU=0 gives torch's ops.
FUSED_SWIGLU = os.environ.get("FP8MON_FUSED_SWIGLU", "1") == "1"


class SwiGLU(nn.Module):
    """fc2(silu(gate) * up), with ``fc1`` one fused GEMM producing [gate | up]."""

    def __init__(self, d_model: int, hidden: int, make_linear: MakeLinear):
        super().__init__()
        self.fc1 = make_linear(d_model, 2 * hidden)
        self.fc2 = make_linear(hidden, d_model)
        self.fused = FUSED_SWIGLU
        if self.fused:
            mark_reported(self.fc1, "output", "grad_output")
            mark_reported(self.fc2, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused and triton_runs(x.device)
        y_link = take_output(self.fc1, fused) if self.fused else None
        h_link = getattr(self.fc2, "fp8mon_stats", None) if self.fused and type(self.fc2) is nn.Linear else None
        dy_link = y_link if type(self.fc1) is nn.Linear else None  # an FP8 fc1's backward cast takes its grad_output
        y = self.fc1(x)
        if fused:
            from .kernels.swiglu import swiglu

            dy_target = (lambda: target_of(dy_link, "grad_output", y)) if dy_link is not None else None
            h = swiglu(y, stats=target_of(y_link, "output", y), h_stats=target_of(h_link, "input", y),
                       dy_stats=dy_target)
        else:
            gate, up = y.chunk(2, dim=-1)
            h = F.silu(gate) * up
            report_apart(y_link, "output", y)
            report_apart(h_link, "input", h)
            report_grad_apart(dy_link, y)
        return self.fc2(h)


def mark_reported(linear: nn.Module, *sites: str) -> None:
    """A plain linear's ``sites`` rows are reported by the block around it (a fused consumer kernel, or the block
    through torch where that kernel does not run): an agent's hooks leave them to the block (agent.hooks, FusedLink).
    Call at construction, before ``Agent.watch``. An FP8 linear reports its sites itself (see ``take_output``)."""
    if type(linear) is nn.Linear:
        linear.fp8mon_reported_sites = (*getattr(linear, "fp8mon_reported_sites", ()), *sites)
        linear.fp8mon_stats = None


def take_output(linear: nn.Module, fused: bool):
    """The agent's link through which the block takes ``linear``'s output row in this forward (None: the linear or
    the hooks take it): an FP8 linear leaves it to a fused consumer kernel (``fused``), else takes it itself; a plain
    linear marked by ``mark_reported`` always leaves it to the block. Call right before the linear's forward."""
    link = getattr(linear, "fp8mon_stats", None)
    if hasattr(linear, "fp8mon_output_by_consumer"):
        linear.fp8mon_output_by_consumer = fused and link is not None
        return link if fused else None
    return link


def target_of(link, site: str, like: torch.Tensor):
    return link.target(site, like.device) if link is not None else None


# A bf16 linear's weight: autocast casts it to bf16 for the GEMM, a read of every weight at every step. With
# ``own_weight_row`` (set at construction) that cast is one Triton kernel that also takes the weight's row for the agent
# on a reporting step (trainer.kernels.residual.weight_cast), so no hook reads the weight again; where that cast does not
# happen or the kernel cannot run (no autocast, no Triton), the linear reports the row apart. Its backward, the cast of
# the weight's gradient back to fp32, takes the gradient's row too where that becomes .grad as it is (the step's
# first micro-batch; a later one's is added to it, and the hook reads the sum). On a reporting step the first such
# linear casts all their small weights in one launch, and their gradients go back in one (``trainer.weight_rows``).
# FP8MON_FUSED_WEIGHT=0 leaves both to the hooks.
FUSED_WEIGHT = os.environ.get("FP8MON_FUSED_WEIGHT", "1") == "1"


def own_weight_row(linear: nn.Linear) -> nn.Linear:
    """``linear`` (a plain one; returned) reporting its weight's row itself, as its cast for autocast takes it."""
    if FUSED_WEIGHT and type(linear) is nn.Linear:
        mark_reported(linear, "weight")
        linear.fp8mon_grad_weight_by_cast = True  # the hook reads the gradient unless the cast back took its row
        # an instance's forward (it stays an nn.Linear for the type checks); a partial, not a bound method, pickles
        linear.forward = functools.partial(_linear_with_weight_row, linear)
    return linear


def _linear_with_weight_row(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    link, w = self.fp8mon_stats, self.weight
    # (the hooks skip evaluation passes too; a weight not due may still have its cast from this step's batch)
    if link is None or not self.training or not (link.due("weight") or "fp8mon_cast_ready" in self.__dict__):
        return F.linear(x, w, self.bias)
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
    castable = dtype != w.dtype and w.dtype == torch.float32 and w.is_contiguous() and triton_runs(w.device)
    if castable:
        from . import weight_rows
        from .kernels.residual import weight_cast

        weight_rows.register_cast(self, link)
        cast = weight_rows.take_cast(self, link, dtype)  # this step's batch of weight casts (weight_rows)
        if cast is not None:
            return F.linear(x, cast, self.bias)
        if link.due("weight"):
            target = link.target("weight", w.device)
            if target is not None:
                return F.linear(x, weight_cast(w, dtype, target, link), self.bias)
    elif link.due("weight"):
        report_apart(link, "weight", w)
    return F.linear(x, w, self.bias)


def report_apart(link, site: str, value: torch.Tensor) -> None:
    """``value``'s row for the agent, computed apart (no fused kernel on this device)."""
    if link is not None and link.wants(site):
        from fp8mon.agent.stats import torch_path as ds

        link.report(site, ds.partials(value.detach(), fmt=link.fmt(site), outlier_k=link.outlier_k, hist=link.hist))


def report_grad_apart(link, output: torch.Tensor) -> None:
    """The row of ``output``'s gradient (the linear's grad_output), computed apart when the backward reaches it."""
    if link is not None and output.requires_grad:
        output.register_hook(lambda grad: report_apart(link, "grad_output", grad))


def triton_runs(device: torch.device) -> bool:
    """Whether the trainer's Triton kernels run on ``device``: CUDA with Triton, or the CPU under TRITON_INTERPRET."""
    from fp8mon.agent.stats import launch as triton_stats

    return triton_stats.available(device)


def softplus_inverse(y: float) -> float:
    return y + math.log(-math.expm1(-y))  # log(exp(y) - 1), stable


class XIELU(nn.Module):
    """xIELU (Huang & Schlag), as FOG uses it:
        x > 0:  alpha_p * x^2 + beta * x
        x <= 0: alpha_n * (exp(min(x, eps)) - 1) - alpha_n * x + beta * x
    alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n), beta = 0.5, eps = -1e-6; a_p and a_n are
    learnable scalars initialised so that alpha_p = alpha_n = 0.8."""

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        self.beta, self.eps = beta, eps
        self.a_p = nn.Parameter(torch.tensor(softplus_inverse(alpha_p_init)))
        self.a_n = nn.Parameter(torch.tensor(softplus_inverse(alpha_n_init - beta)))

    @property
    def alpha_p(self) -> torch.Tensor:
        return F.softplus(self.a_p)

    @property
    def alpha_n(self) -> torch.Tensor:
        return self.beta + F.softplus(self.a_n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ap, an, beta = self.alpha_p, self.alpha_n, self.beta
        pos = ap * x * x + beta * x
        neg = an * torch.expm1(torch.clamp(x, max=self.eps)) - an * x + beta * x
        return torch.where(x > 0, pos, neg)


class XIELUMLP(nn.Module):
    """FOG's non-gated MLP: fc2(xIELU(fc1 x)), hidden = 1.5 x the SwiGLU hidden (same parameter count)."""

    def __init__(self, d_model: int, hidden: int, make_linear: MakeLinear):
        super().__init__()
        self.fc1 = make_linear(d_model, hidden)
        self.act = XIELU()
        self.fc2 = make_linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
