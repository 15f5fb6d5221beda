"""The building blocks: RoPE, attention (with FOG's frozen QK-norm), SwiGLU and xIELU MLPs; RMSNorm from
``trainer.fused``.

Block GEMMs and the fused parts come from a ``trainer.parts.Parts`` factory, so that the same code builds
``nn.Linear`` (bf16/fp32) or ``Fp8Linear`` (fp8), and the fused kernels where they run. Norms, RoPE and activations
compute in fp32 and return their input's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .fused import RMSNorm
from .parts import MakeLinear, Parts, as_parts

__all__ = ["Attention", "MakeLinear", "RMSNorm", "Rotary", "SwiGLU", "XIELU", "XIELUMLP"]


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


class Attention(nn.Module):
    """Causal multi-head attention; ``qkv`` is one fused GEMM producing [q | k | v].

    llama: logits = q.k / sqrt(head_dim), RoPE on q, k.
    fog:   q^, k^ = RMSNorm per head with a frozen gain of 1, then RoPE, logits = 0.125 * q^.k^.
           RMSNorm gives ||q^|| <= sqrt(head_dim) (RMS <= 1), RoPE preserves norms, so by Cauchy-Schwarz
           |logit| <= 0.125 * head_dim (16 at head_dim 128) whatever the weights do.
    """

    def __init__(self, d_model: int, n_head: int, parts: Parts | MakeLinear, qk_norm: bool,
                 softmax_scale: float | None = None, eps: float = 1e-6):
        super().__init__()
        parts = as_parts(parts)
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = parts.linear(d_model, 3 * d_model)
        self.proj = parts.linear(d_model, d_model)
        self.q_norm = RMSNorm(self.head_dim, eps, learnable=False) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, learnable=False) if qk_norm else None
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None
        # without QK-norm, RoPE and the split into heads are one kernel (with qkv's rows)
        self.rope_qkv = None if qk_norm else parts.rope(self.qkv, n_head, self.head_dim)
        self.merge = parts.merge_heads()

    def heads(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, H, T, head_dim), q and k normed (fog) and rotated."""
        out = self.qkv(x)
        if self.rope_qkv is not None:
            return self.rope_qkv(out, rope)
        b, t, _ = out.shape
        q, k, v = out.view(b, t, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q), rope(k), v

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        q, k, v = self.heads(x, rope)
        if self.track_max_logit:
            self.max_logit = self._max_logit(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.proj(self.merge(y))

    @torch.no_grad()
    def _max_logit(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Largest causal pre-softmax logit of the first sequence (cheap: only on reporting steps)."""
        s = (q[:1].float() @ k[:1].float().transpose(-1, -2)) * self.scale
        t = s.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~causal, float("-inf")).amax()


class SwiGLU(nn.Module):
    """fc2(silu(gate) * up), with ``fc1`` one fused GEMM producing [gate | up]."""

    def __init__(self, d_model: int, hidden: int, parts: Parts | MakeLinear):
        super().__init__()
        parts = as_parts(parts)
        self.fc1 = parts.linear(d_model, 2 * hidden)
        self.fc2 = parts.linear(hidden, d_model)
        self.act = parts.swiglu(self.fc1, self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


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

    def __init__(self, d_model: int, hidden: int, parts: Parts | MakeLinear):
        super().__init__()
        parts = as_parts(parts)
        self.fc1 = parts.linear(d_model, hidden)
        self.act = XIELU()
        self.fc2 = parts.linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
