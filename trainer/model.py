"""Decoder-only LM in two architectures.

llama (the standard block, which diverges in full FP8)::

    x = embed(tokens)
    x = x + attn(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x))      (pre-norm, per block)
    logits = head(RMSNorm(x))

fog (FOG-strong, "Towards Fully FP8 GEMM LLM Training at Scale", arXiv 2505.20524)::

    x = embed(tokens) / sigma_init                                (x50 at sigma 0.02)
    x = x + g_a * RMSNorm(attn(x));  x = x + g_m * RMSNorm(xIELU-MLP(x))   (no pre-norm; g init 1/sqrt(L))
    attention: QK-RMSNorm per head with a frozen gain of 1, RoPE after it, softmax scale 0.125
    logits = head(x)                                              (no final norm)

Module names as the monitor shows them: ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``,
``blocks.{i}.mlp.fc1`` (SwiGLU: [gate | up] fused), ``blocks.{i}.mlp.fc2``; ``embed`` and ``head`` stay in
high precision. With ``precision="fp8"`` the four block GEMMs are ``Fp8Linear`` (trainer/fp8_linear.py).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import layers
from .config import ARCHS, PRECISIONS, ModelConfig
from .layers import (Attention, MakeLinear, RMSNorm, Rotary, SwiGLU, XIELUMLP, mark_reported, report_apart,
                     report_grad_apart, take_output, target_of, triton_runs)


def linear_factory(precision: str, recipe=None) -> MakeLinear:
    """Block GEMMs: Fp8Linear for fp8 (imported only then), else a bias-free nn.Linear (bf16: one that takes its
    weight's row from autocast's cast of it)."""
    if precision == "fp8":
        from .fp8_linear import Fp8Linear, Fp8Recipe

        recipe = recipe if recipe is not None else Fp8Recipe()
        return lambda fan_in, fan_out: Fp8Linear(fan_in, fan_out, bias=False, recipe=recipe)
    if precision == "bf16":  # autocast casts each weight: the cast takes its row (layers.own_weight_row)
        return lambda fan_in, fan_out: layers.own_weight_row(nn.Linear(fan_in, fan_out, bias=False))
    return lambda fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False)


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast for bf16 (everything) and fp8 (all but the FP8 GEMMs); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: str, make_linear: MakeLinear, qk_norm: bool | None = None):
        super().__init__()
        self.arch = arch
        d = cfg.d_model
        fog = arch == "fog"
        self.attn = Attention(d, cfg.n_head, make_linear, qk_norm=fog if qk_norm is None else qk_norm,
                              softmax_scale=cfg.fog_softmax_scale if fog else None, eps=cfg.norm_eps)
        if fog:
            gain = 1.0 / math.sqrt(cfg.n_layer)
            self.attn_out_norm = RMSNorm(d, cfg.norm_eps, init=gain)  # on the branch output, before the add
            self.mlp = XIELUMLP(d, cfg.fog_d_ff, make_linear)
            self.mlp_out_norm = RMSNorm(d, cfg.norm_eps, init=gain)
        else:
            self.attn_norm = RMSNorm(d, cfg.norm_eps)  # pre-norm, on the branch input
            self.mlp = SwiGLU(d, cfg.d_ff, make_linear)
            self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        # llama's pre-norms take the row of the input of the branch's first linear (layers.FUSED_NORM)
        self.norm_rows = layers.FUSED_NORM and not fog
        if self.norm_rows:
            mark_reported(self.attn.qkv, "input")
            mark_reported(self.mlp.fc1, "input")
        # llama's residual adds take the row of the branch's last linear's output (FUSED_RESIDUAL)
        self.fused_residual = FUSED_RESIDUAL and not fog
        if self.fused_residual:
            mark_reported(self.attn.proj, "output", "grad_output")
            mark_reported(self.mlp.fc2, "output", "grad_output")

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        if self.arch == "fog":
            x = x + self.attn_out_norm(self.attn(x, rope))
            return x + self.mlp_out_norm(self.mlp(x))
        if not self.fused_residual:
            x = x + self.attn(_normed(self.attn_norm, x, self.attn.qkv, self.norm_rows), rope)
            return x + self.mlp(_normed(self.mlp_norm, x, self.mlp.fc1, self.norm_rows))
        fused = triton_runs(x.device)
        # (take_output before the branch runs: it tells an FP8 linear whether to leave its output row to the add)
        link = take_output(self.attn.proj, fused)
        x = _residual(x, self.attn.proj, link, self.attn(_normed(self.attn_norm, x, self.attn.qkv, self.norm_rows),
                                                         rope), fused)
        link = take_output(self.mlp.fc2, fused)
        return _residual(x, self.mlp.fc2, link, self.mlp(_normed(self.mlp_norm, x, self.mlp.fc1, self.norm_rows)),
                         fused)


def _normed(norm: RMSNorm, x: torch.Tensor, linear: nn.Module, rows: bool) -> torch.Tensor:
    """norm(x), the input of ``linear``; with ``rows`` (set at construction, which marked a plain linear's input as the
    block's) a plain linear's input row, taken by the norm's kernel or apart."""
    link = getattr(linear, "fp8mon_stats", None) if rows and type(linear) is nn.Linear else None
    if link is None:
        return norm(x)
    if norm.fused(x):
        return norm(x, stats=target_of(link, "input", x))
    y = norm(x)
    report_apart(link, "input", y)
    return y


# The residual add as one Triton kernel (trainer.kernels.residual) where Triton runs, taking, for the agent, the row of
# the output of the attention's proj and of the MLP's fc2 from its read of them (an FP8 linear then leaves it to the
# add; a plain one's is marked as the block's at construction), and a plain one's grad_output row from the backward's
# cast of it: no second read of them. On by default
# (bench/RESULTS.md: faster than torch's add, and the agent's rows cheaper); FP8MON_FUSED_RESIDUAL=0 gives torch's add.
FUSED_RESIDUAL = os.environ.get("FP8MON_FUSED_RESIDUAL", "1") == "1"


def _residual(x: torch.Tensor, linear: nn.Module, link, branch: torch.Tensor, fused: bool) -> torch.Tensor:
    """x + branch, the rows of the branch (the output of ``linear``, whose agent link is ``link``) and, for a plain
    linear, of its gradient (the linear's grad_output) taken by the fused add and its backward, or apart."""
    grad_link = link if type(linear) is nn.Linear else None  # an FP8 linear's backward cast takes its grad_output
    if fused and x.shape == branch.shape:
        from .kernels.residual import residual_add

        grad_target = (lambda: target_of(grad_link, "grad_output", branch)) if grad_link is not None else None
        return residual_add(x, branch, stats=target_of(link, "output", branch), grad_stats=grad_target)
    report_apart(link, "output", branch)
    report_grad_apart(grad_link, branch)
    return x + branch


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: str = "llama", precision: str = "fp32", recipe=None,
                 qk_norm: bool | None = None):
        """``qk_norm``: None = the architecture's own (fog: QK-RMSNorm, llama: none); True/False forces it."""
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}")
        self.cfg, self.arch, self.precision = cfg, arch, precision
        make_linear = linear_factory(precision, recipe)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = 1.0 / cfg.init_std if arch == "fog" else 1.0
        self.rope = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg, arch, make_linear, qk_norm) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if arch == "llama" else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.track_diagnostics = False
        self._lse: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, sigma) everywhere; the residual-stream writers (attn.proj, mlp.fc2) get sigma/sqrt(2L)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layer)
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.head.weight, std=std)
        for block in self.blocks:
            for lin, s in ((block.attn.qkv, std), (block.attn.proj, out_std),
                           (block.mlp.fc1, std), (block.mlp.fc2, out_std)):
                nn.init.normal_(lin.weight, std=s)
                if getattr(lin, "bias", None) is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or the mean cross-entropy when ``targets`` are given."""
        x = self.embed(idx)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        for block in self.blocks:
            x = block(x, self.rope)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.head(x)
        if targets is None:
            return logits
        logits = logits.float()
        if self.track_diagnostics:
            with torch.no_grad():
                self._lse = logits.logsumexp(-1).mean()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    # ---- monitoring helpers -----------------------------------------------------------------------

    def set_diagnostics(self, enabled: bool) -> None:
        """Compute ``diagnostics()`` in the following forwards (costs one small QK^T per layer)."""
        self.track_diagnostics = enabled
        for block in self.blocks:
            block.attn.track_max_logit = enabled
            block.attn.max_logit = None
        self._lse = None

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Device scalars of the last forward: ``attn_max_logit`` (max over layers of the largest causal
        pre-softmax logit of the first sequence) and ``logit_logsumexp`` (mean log Z of the LM head)."""
        out = {}
        logits = [b.attn.max_logit for b in self.blocks if b.attn.max_logit is not None]
        if logits:
            out["attn_max_logit"] = torch.stack(logits).amax()
        if self._lse is not None:
            out["logit_logsumexp"] = self._lse
        return out

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices (linear weights, embedding, head); none on gains and xIELU scalars."""
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        other = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after ``idx`` (B, T); no KV cache, the window is cfg.seq_len."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
