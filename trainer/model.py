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
high precision. With ``precision="fp8"`` the four block GEMMs are ``Fp8Linear`` (trainer/fp8_linear.py). The parts of
each block come from ``trainer.parts.Parts``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ARCHS, PRECISIONS, ModelConfig
from .layers import XIELUMLP, Attention, Rotary, SwiGLU
from .parts import Parts


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast for bf16 (everything) and fp8 (all but the FP8 GEMMs); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


class LlamaBlock(nn.Module):
    """The standard pre-norm block. Its norms take the rows of the inputs of qkv and fc1 (the tensors they write), its
    adds those of the outputs of proj and fc2 (the tensors they read): ``parts`` builds them around those linears."""

    def __init__(self, cfg: ModelConfig, parts: Parts, qk_norm: bool = False):
        super().__init__()
        d = cfg.d_model
        self.attn = Attention(d, cfg.n_head, parts, qk_norm=qk_norm, eps=cfg.norm_eps)
        self.attn_norm = parts.norm(d, cfg.norm_eps, feeds=self.attn.qkv)
        self.attn_add = parts.residual(self.attn.proj)
        self.mlp = SwiGLU(d, cfg.d_ff, parts)
        self.mlp_norm = parts.norm(d, cfg.norm_eps, feeds=self.mlp.fc1)
        self.mlp_add = parts.residual(self.mlp.fc2)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = self.attn_add(x, self.attn(self.attn_norm(x), rope))
        return self.mlp_add(x, self.mlp(self.mlp_norm(x)))


class FogBlock(nn.Module):
    """FOG-strong's block: no pre-norm, an RMSNorm on each branch's output (gain initialised to 1/sqrt(L))."""

    def __init__(self, cfg: ModelConfig, parts: Parts, qk_norm: bool = True):
        super().__init__()
        d, gain = cfg.d_model, 1.0 / math.sqrt(cfg.n_layer)
        self.attn = Attention(d, cfg.n_head, parts, qk_norm=qk_norm, softmax_scale=cfg.fog_softmax_scale,
                              eps=cfg.norm_eps)
        self.attn_out_norm = parts.norm(d, cfg.norm_eps, init=gain)
        self.mlp = XIELUMLP(d, cfg.fog_d_ff, parts)
        self.mlp_out_norm = parts.norm(d, cfg.norm_eps, init=gain)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.attn_out_norm(self.attn(x, rope))
        return x + self.mlp_out_norm(self.mlp(x))


BLOCKS = {"llama": LlamaBlock, "fog": FogBlock}


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
        parts = Parts(precision, recipe)
        block_kw = {} if qk_norm is None else {"qk_norm": qk_norm}
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = 1.0 / cfg.init_std if arch == "fog" else 1.0
        self.rope = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(BLOCKS[arch](cfg, parts, **block_kw) for _ in range(cfg.n_layer))
        self.norm = parts.norm(cfg.d_model, cfg.norm_eps) if arch == "llama" else None
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
