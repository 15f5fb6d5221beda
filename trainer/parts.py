"""The factory of a block's parts: which module computes each, by precision (the linears) and by what the block asks
for (the architecture's block, ``trainer.model``, says which linear's tensors each part computes).

``Parts(precision, recipe)``: ``linear(fan_in, fan_out)`` builds the block GEMMs (``Fp8Linear`` for fp8, a bf16
linear whose weight cast takes the weight's row for bf16, ``nn.Linear`` for fp32); the other methods build the fused
modules of ``trainer.fused``, which pick Triton or torch's ops per call by the tensor's device, and the head sizes
their kernels take. ``Parts(linear=make)`` keeps a given linear factory (tests build blocks of their own linears).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from . import fused

MakeLinear = Callable[[int, int], nn.Module]


def _plain_linear(fan_in: int, fan_out: int) -> nn.Module:
    return nn.Linear(fan_in, fan_out, bias=False)


def _bf16_linear(fan_in: int, fan_out: int) -> nn.Module:
    return fused.own_weight_row(nn.Linear(fan_in, fan_out, bias=False))


class Parts:
    """The parts of a block for one precision (see the module docstring)."""

    def __init__(self, precision: str = "fp32", recipe=None, linear: MakeLinear | None = None):
        if linear is None:
            linear = {"fp8": lambda: _fp8_linear(recipe), "bf16": lambda: _bf16_linear}.get(
                precision, lambda: _plain_linear)()
        self.linear = linear

    def norm(self, dim: int, eps: float, init: float = 1.0, feeds: nn.Module | None = None) -> fused.RMSNorm:
        """An RMSNorm (learnable gain); ``feeds``: the linear whose input it writes, whose row it then takes."""
        return fused.RMSNorm(dim, eps, init=init, feeds=feeds)

    def residual(self, writer: nn.Module) -> fused.ResidualAdd:
        """The add of a branch whose last linear is ``writer``."""
        return fused.ResidualAdd(writer)

    def rope(self, qkv: nn.Module, n_head: int, head_dim: int) -> fused.RopeQKV | None:
        """RoPE on ``qkv``'s output as one kernel, for heads it takes (a power of two from 16), else None."""
        if head_dim >= 16 and not head_dim & (head_dim - 1):
            return fused.RopeQKV(qkv, n_head)
        return None

    def merge_heads(self) -> fused.MergeHeads:
        """The attention's heads merged back for its projection."""
        return fused.MergeHeads()

    def swiglu(self, fc1: nn.Module, fc2: nn.Module) -> fused.SwiGLUAct:
        """silu(gate) * up between ``fc1`` (producing [gate | up]) and ``fc2``."""
        return fused.SwiGLUAct(fc1, fc2)


def _fp8_linear(recipe) -> MakeLinear:
    from .fp8_linear import Fp8Linear, Fp8Recipe  # imported only for fp8: it needs the agent's formats

    recipe = recipe if recipe is not None else Fp8Recipe()
    return lambda fan_in, fan_out: Fp8Linear(fan_in, fan_out, bias=False, recipe=recipe)


def as_parts(parts: Parts | MakeLinear) -> Parts:
    """``parts``, or a ``Parts`` around a linear factory."""
    return parts if isinstance(parts, Parts) else Parts(linear=parts)
