"""The attention's heads merged back for its output projection, (B, NH, T, HD) -> (B, T, NH * HD), in one pass that
can also take the statistics row of what it writes (the projection's ``input``) for the agent.

``y.transpose(1, 2).reshape(b, t, nh * hd)`` is a copy for the layout the attention returns (torch's, one
``elementwise_kernel`` a layer). Here one pass reads y at its strides (the last dimension contiguous) and writes the
projection's input contiguous, in about half torch's time; with ``stats=`` (an ``agent.triton_stats.Target``) it
accumulates the row as ``trainer.kernels.rope`` does (``triton_stats.stream_add``, with the careful path of
``triton_stats.careful_tiles``), in place of a statistics kernel's read of the result (``trainer.layers.HEADS_ROW``;
off by default: in a step the two cost the same, bench/RESULTS.md). The values are copied, not computed: the result
equals torch's bit for bit. The backward is a view of the gradient (the transpose's). Reference beside it:
``merge_heads_ref``.

Persistent programs (a few per SM) loop over tiles of positions of one batch row and head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats.device import (SMEM_HIST, fused_bounds, fused_epilogue, htab, stream_add, stream_partial,
                                       stream_start)

from .quantize import cdiv, persistent_programs, reg_cap
from .rope import _where

BT = 32  # positions per tile
# Elements per tile with a row (positions x head size): a tile of 32 positions at the 124M heads' 64 channels left the
# programs waiting on their loads; 4096 elements took the copy with its row from 55 to 32 us of device time there
# (bench/heads.py on an H100, bench/RESULTS.md).
STATS_TILE = 4096
PROGRAMS_PER_SM = 4
STATS_PROGRAMS_PER_SM = 2  # two programs of 8 warps at the register cap fill an SM's registers
STATS_MAXNREG = 128
STATS_STAGES = 1  # software-pipelining depth of the tile loop with a row (``tl.range``'s num_stages)


def supported(head_dim: int) -> bool:
    """Whether the kernel takes this head size: a power of two from 8 (a thread's statistics row is 8 elements)."""
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
def _tile_mask(pm, HD: tl.constexpr):
    return pm[:, None] & (tl.arange(0, HD)[None, :] < HD)


@triton.jit
def _part(src, t, part, BT: tl.constexpr, HD: tl.constexpr):
    """The careful path's loader (``triton_stats.careful_tiles``): tile t of y, fp32, as the statistics' [R, 8] view,
    with its mask (one part a tile)."""
    y_ptr, T, NH, sb, sh, st = src
    b, h, pos, pm = _where(t, T, NH, BT)
    m = _tile_mask(pm, HD)
    x = tl.load(_src(y_ptr, b, h, pos, sb, sh, st, HD), mask=m, other=0.0)
    R: tl.constexpr = BT * HD // 8
    return tl.reshape(x.to(tl.float32), [R, 8]), tl.reshape(m, [R, 8])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _merge_heads_kernel(y_ptr, out_ptr, T, NH, sb, sh, st, tiles, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr,
                        c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr,
                        AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                        SMODE: tl.constexpr, BT: tl.constexpr, HD: tl.constexpr, STAGES: tl.constexpr):
    """The heads of y copied into (B, T, NH * HD), persistent over tiles; with STATS the result's row (the shift from
    the program's first tile)."""
    R: tl.constexpr = BT * HD // 8
    pid = tl.program_id(0)
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        b0, h0, pos0, pm0 = _where(pid, T, NH, BT)
        m0 = _tile_mask(pm0, HD)
        x0 = tl.load(_src(y_ptr, b0, h0, pos0, sb, sh, st, HD), mask=m0, other=0.0).to(tl.float32)
        c, p, ok, ncp, acc = stream_start(x0, m0, R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        b, h, pos, pm = _where(t, T, NH, BT)
        m = _tile_mask(pm, HD)
        x = tl.load(_src(y_ptr, b, h, pos, sb, sh, st, HD), mask=m, other=0.0)
        tl.store(_dst(out_ptr, b, h, pos, T, NH, HD), x, mask=m)
        if STATS:
            inside = tl.sum(pm.to(tl.int32), 0)
            acc = stream_add(acc, x.to(tl.float32), m, inside == BT, p, ncp, lo, hi, HIST, R, 8, ht)
            ce += inside * HD
    if STATS:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, ce, c, p, ok, _part, (y_ptr, T, NH, sb, sh, st), tiles, 1, lo, hi, HIST, R, BT, HD, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


def merge_heads_forward(y: torch.Tensor, stats: "ts.Target | None" = None) -> torch.Tensor:
    """(B, T, NH * HD) of y (B, NH, T, HD); with ``stats`` the result's row into that target."""
    b, nh, t, hd = y.shape
    if not supported(hd):
        raise ValueError(f"merge_heads: head size {hd} is not a power of two >= 8")
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty(b, t, nh * hd, dtype=y.dtype, device=y.device)
    bt = BT if stats is None else max(1, STATS_TILE // hd)
    tiles = cdiv(t, bt) * b * nh
    if tiles == 0:
        return out
    programs = persistent_programs(tiles, STATS_PROGRAMS_PER_SM if stats is not None else PROGRAMS_PER_SM, y.device)
    _merge_heads_kernel[(programs,)](y, out, t, nh, y.stride(0), y.stride(1), y.stride(2), tiles,
                                     **ts.epilogue_args(stats, programs, out, later=True), BT=bt, HD=hd,
                                     STAGES=STATS_STAGES if stats is not None else 1,
                                     num_warps=max(1, min(8, bt * hd // (8 * 32))),
                                     **reg_cap(STATS_MAXNREG if stats is not None else None))
    return out


class _MergeHeadsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, stats):
        ctx.shape = y.shape
        return merge_heads_forward(y, stats)

    @staticmethod
    def backward(ctx, grad):
        b, nh, t, hd = ctx.shape
        return grad.reshape(b, t, nh, hd).transpose(1, 2), None


def merge_heads(y: torch.Tensor, stats: "ts.Target | None" = None) -> torch.Tensor:
    """The attention's heads y (B, NH, T, HD) as its projection's input (B, T, NH * HD), differentiable, in one pass
    (see the module docstring); with ``stats`` that input's statistics row."""
    return _MergeHeadsFn.apply(y, stats)


def merge_heads_ref(y: torch.Tensor) -> torch.Tensor:
    """torch's: ``Attention.forward``'s ``y.transpose(1, 2).reshape(b, t, d)``."""
    b, nh, t, hd = y.shape
    return y.transpose(1, 2).reshape(b, t, nh * hd)
