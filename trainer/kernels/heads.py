"""The attention's heads merged back for its output projection, (B, NH, T, HD) -> (B, T, NH * HD), in one pass.

``y.transpose(1, 2).reshape(b, t, nh * hd)`` is a copy for the layout the attention returns (torch's generic
elementwise kernel). Here one pass reads y at its strides (the last dimension contiguous) and writes the projection's
input contiguous, faster than torch's copy. The values are copied, not computed: the result equals torch's bit for
bit. The backward is a view of the gradient (the transpose's). Reference beside it: ``merge_heads_ref``.

Persistent programs (a few per SM) loop over tiles of positions of one batch row and head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import cdiv, persistent_programs
from .rope import _where

BT = 32  # positions per tile
PROGRAMS_PER_SM = 4


def supported(head_dim: int) -> bool:
    """Whether the kernel takes this head size: a power of two from 8."""
    return head_dim >= 8 and head_dim & (head_dim - 1) == 0


@triton.jit
def _src(y_ptr, b, h, pos, sb, sh, st, HD: tl.constexpr):
    """Head h of batch row b at positions ``pos`` of y (B, NH, T, HD) with strides sb, sh, st (and 1)."""
    return (y_ptr + b.to(tl.int64) * sb + h.to(tl.int64) * sh + pos.to(tl.int64)[:, None] * st
            + tl.arange(0, HD)[None, :])


@triton.jit
def _dst(out_ptr, b, h, pos, T, NH, HD: tl.constexpr):
    """The same elements in the contiguous (B, T, NH * HD) result."""
    row = b.to(tl.int64) * T + pos
    return out_ptr + row[:, None] * (NH * HD) + h * HD + tl.arange(0, HD)[None, :]


@triton.jit
def _merge_heads_kernel(y_ptr, out_ptr, T, NH, sb, sh, st, tiles, BT: tl.constexpr, HD: tl.constexpr):
    """The heads of y copied into (B, T, NH * HD), persistent over tiles."""
    pid = tl.program_id(0)
    for t in range(pid, tiles, tl.num_programs(0)):
        b, h, pos, pm = _where(t, T, NH, BT)
        m = pm[:, None] & (tl.arange(0, HD)[None, :] < HD)
        x = tl.load(_src(y_ptr, b, h, pos, sb, sh, st, HD), mask=m, other=0.0)
        tl.store(_dst(out_ptr, b, h, pos, T, NH, HD), x, mask=m)


def merge_heads_forward(y: torch.Tensor) -> torch.Tensor:
    """(B, T, NH * HD) of y (B, NH, T, HD)."""
    b, nh, t, hd = y.shape
    if not supported(hd):
        raise ValueError(f"merge_heads: head size {hd} is not a power of two >= 8")
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty(b, t, nh * hd, dtype=y.dtype, device=y.device)
    tiles = cdiv(t, BT) * b * nh
    if tiles == 0:
        return out
    programs = persistent_programs(tiles, PROGRAMS_PER_SM, y.device)
    _merge_heads_kernel[(programs,)](y, out, t, nh, y.stride(0), y.stride(1), y.stride(2), tiles, BT=BT, HD=hd,
                                     num_warps=max(1, min(8, BT * hd // (8 * 32))))
    return out


class _MergeHeadsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.shape = y.shape
        return merge_heads_forward(y)

    @staticmethod
    def backward(ctx, grad):
        b, nh, t, hd = ctx.shape
        return grad.reshape(b, t, nh, hd).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """The attention's heads y (B, NH, T, HD) as its projection's input (B, T, NH * HD), differentiable, in one pass
    (see the module docstring)."""
    return _MergeHeadsFn.apply(y)


def merge_heads_ref(y: torch.Tensor) -> torch.Tensor:
    """torch's: ``y.transpose(1, 2).reshape(b, t, d)``."""
    b, nh, t, hd = y.shape
    return y.transpose(1, 2).reshape(b, t, nh * hd)
