"""Torch references of the trainer's fused kernels: what the model computes where Triton does not run (the CPU), and
what the kernels' tests compare against. Imports only torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension in fp32, in x's dtype (``trainer.kernels.rmsnorm``'s reference)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of y = [gate | up] (``trainer.kernels.swiglu``'s reference)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
