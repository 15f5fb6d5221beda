"""A transformer block's residual add, out = x + b (b: a branch's output, from the attention's or the MLP's last
linear), in one pass, optionally taking b's statistics row for the agent from the read it does anyway: the row of that
linear's ``output``, which the linear then leaves to it (``trainer.fused.ResidualAdd``), instead of a statistics kernel
reading b once more.

x and b have one shape; out takes torch's type promotion of the two (an fp32 residual stream plus a bf16 branch is
fp32), and its values are torch's: the sum in fp32, rounded once to out's dtype. The backward is torch's: the gradient
to each input, in its dtype. Reference beside it: ``residual_add_ref``. With ``grad_stats`` the backward casts b's
gradient in one kernel (``branch_grad``) that also takes its row: the grad_output of a plain branch linear (an FP8
linear's backward cast takes its own). The same kernel is ``weight_cast``: a bf16 linear's weight cast for autocast
with the weight's row, and its gradient cast back with the gradient's row (``trainer.fused.own_weight_row``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats.device import (
    SMEM_HIST,
    fused_bounds,
    fused_epilogue,
    htab,
    stream_add,
    stream_partial,
    stream_start,
)

from .fp8_gemm import _to_out
from .quantize import INTERPRET, cdiv, persistent_programs, reg_cap

BLOCK = 2048
PROGRAMS_PER_SM = 4
# Persistent programs per SM of the kernels with a row, their register cap (ptxas), blocks and warps. Uncapped, the add
# with a row fits one program of 8 warps per SM. At 128 registers (no spill in the tile loops) 16 warps fill an SM's
# registers, as two programs of 8 warps or four of 4; four of 4 with half the block is the fastest
# (``trainer.kernels.swiglu.STATS_WARPS`` says why smaller programs can be faster). The careful loop (a block with NaN
# or Inf) spills at 4 warps; it runs only on such blocks.
STATS_PROGRAMS_PER_SM = 4
STATS_MAXNREG = 128
WARPS = 8
STATS_BLOCK = 1024
STATS_WARPS = 4
# Software-pipelining depth of the tile loops with a row (``tl.range``'s num_stages: from 2 on, Triton issues the
# next blocks' loads into shared memory, cp.async, ahead of this block's arithmetic): the best depth found. Without a
# row the add streams at copy speed and takes 1.
STATS_STAGES = 3
_SOFT_ROUND = tl.constexpr(INTERPRET)  # for the careful path's loader of b's gradient (kernels take it as an argument)


@triton.jit
def _block(x_ptr, b_ptr, out_ptr, n, blk, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """out = x + b on block ``blk``; returns b's values (fp32) and the mask."""
    offs = (blk + tl.zeros([], tl.int64)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _to_out(x + b, out_ptr.dtype.element_ty, SOFT_ROUND), mask=mask)
    return b, mask


@triton.jit
def _b_part(src, blk, part, BLOCK: tl.constexpr, V: tl.constexpr):
    """The careful path's loader (``stats.device.careful_tiles``): block ``blk`` of b again, fp32, as the
    statistics' [R, V] view, with its mask (one part)."""
    b_ptr, n = src
    offs = (blk + tl.zeros([], tl.int64)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.reshape(b, [BLOCK // V, V]), tl.reshape(mask, [BLOCK // V, V])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _residual_add_kernel(x_ptr, b_ptr, out_ptr, n, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean, c_std,
                         k, ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr, AHM_PTR: tl.constexpr,
                         HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr, SMODE: tl.constexpr,
                         BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Persistent programs over blocks of BLOCK elements. With STATS, b's statistics as the standalone kernel takes
    them (``stats.device.tile_fast``: each thread sums its own rows of V elements, about a shift from the program's
    first block, in fp32), and its careful path (``stats.device.careful_tiles``: two exact fp64 passes re-reading b)
    where the shift was poor or b holds NaN/Inf."""
    pid = tl.program_id(0)
    nblk = tl.cdiv(n, BLOCK)
    if not STATS:
        for blk in tl.range(pid, nblk, tl.num_programs(0), num_stages=STAGES):
            _block(x_ptr, b_ptr, out_ptr, n, blk, BLOCK, SOFT_ROUND)
    else:
        V: tl.constexpr = 8
        R: tl.constexpr = BLOCK // V
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        b0, m0 = _b_part((b_ptr, n), pid, 0, BLOCK, V)
        c, p, ok, ncp, st = stream_start(b0, m0, R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
        ce = tl.zeros([], tl.int32)
        for blk in tl.range(pid, nblk, tl.num_programs(0), num_stages=STAGES):
            b, mask = _block(x_ptr, b_ptr, out_ptr, n, blk, BLOCK, SOFT_ROUND)
            inside = tl.minimum(n - (blk + tl.zeros([], tl.int64)) * BLOCK, BLOCK).to(tl.int32)
            st = stream_add(st, b, mask, inside == BLOCK, p, ncp, lo, hi, HIST, R, V, ht)
            ce += inside
        ce, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            st, ce, c, p, ok, _b_part, (b_ptr, n), nblk, 1, lo, hi, HIST, R, BLOCK, V, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, ce, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


@triton.jit
def _grad_block(g_ptr, n, blk, DTYPE: tl.constexpr, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Block ``blk`` of g (fp32), the same rounded to DTYPE (as ``g.to(DTYPE)``), and the mask."""
    offs = (blk + tl.zeros([], tl.int64)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return g, _to_out(g, DTYPE, SOFT_ROUND), offs, mask


@triton.jit
def _db_part(src, blk, part, BLOCK: tl.constexpr, V: tl.constexpr):
    """The careful path's loader of the branch gradient's row: block ``blk`` of it, recomputed from g (not re-read:
    other threads of the program stored it), fp32, as the statistics' [R, V] view, with its mask."""
    g_ptr, db_ptr, n = src
    _, d, _, mask = _grad_block(g_ptr, n, blk, db_ptr.dtype.element_ty, BLOCK, _SOFT_ROUND)
    return tl.reshape(d.to(tl.float32), [BLOCK // V, V]), tl.reshape(mask, [BLOCK // V, V])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _branch_grad_kernel(g_ptr, db_ptr, n, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean, c_std, k,
                        ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr, AHM_PTR: tl.constexpr,
                        HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr, SMODE: tl.constexpr,
                        BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr,
                        SOURCE_ROW: tl.constexpr = False):
    """db = g in b's dtype, persistent over blocks, with db's row (the branch linear's ``grad_output``) taken as the
    forward takes b's; with SOURCE_ROW the row of g itself (``weight_cast``: a weight before its cast)."""
    V: tl.constexpr = 8
    R: tl.constexpr = BLOCK // V
    dtype = db_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nblk = tl.cdiv(n, BLOCK)
    lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
    if SOURCE_ROW:
        d0, m0 = _b_part((g_ptr, n), pid, 0, BLOCK, V)
    else:
        d0, m0 = _db_part((g_ptr, db_ptr, n), pid, 0, BLOCK, V)
    c, p, ok, ncp, st = stream_start(d0, m0, R)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    ce = tl.zeros([], tl.int32)
    for blk in tl.range(pid, nblk, tl.num_programs(0), num_stages=STAGES):
        g, d, offs, mask = _grad_block(g_ptr, n, blk, dtype, BLOCK, SOFT_ROUND)
        tl.store(db_ptr + offs, d, mask=mask)
        inside = tl.minimum(n - (blk + tl.zeros([], tl.int64)) * BLOCK, BLOCK).to(tl.int32)
        st = stream_add(st, g if SOURCE_ROW else d.to(tl.float32), mask, inside == BLOCK, p, ncp, lo, hi, HIST, R, V,
                        ht)
        ce += inside
    if SOURCE_ROW:
        ce, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            st, ce, c, p, ok, _b_part, (g_ptr, n), nblk, 1, lo, hi, HIST, R, BLOCK, V, ht)
    else:
        ce, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            st, ce, c, p, ok, _db_part, (g_ptr, db_ptr, n), nblk, 1, lo, hi, HIST, R, BLOCK, V, ht)
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, ce, nfin, nonfin, zeros, outl,
                   under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


def _launch_shape(n: int, device: torch.device, rows: bool) -> tuple[int, int, int]:
    """(programs, block, warps) of a launch over n elements, with a statistics row or without."""
    block, warps, per_sm = ((STATS_BLOCK, STATS_WARPS, STATS_PROGRAMS_PER_SM) if rows
                            else (BLOCK, WARPS, PROGRAMS_PER_SM))
    return persistent_programs(cdiv(n, block), per_sm, device), block, warps


def branch_grad(g: torch.Tensor, dtype: torch.dtype, stats: ts.Target, source_row: bool = False) -> torch.Tensor:
    """The branch's gradient, ``g.to(dtype)`` (a new tensor even where the dtype is g's), in one pass with its row
    into ``stats``; with ``source_row`` the row of g, not of the result."""
    gc = g.contiguous()
    db = torch.empty(g.shape, dtype=dtype, device=g.device)
    programs, block, warps = _launch_shape(db.numel(), g.device, True)
    _branch_grad_kernel[(programs,)](gc, db, db.numel(), **ts.epilogue_args(stats, programs, db, later=True),
                                     BLOCK=block, SOFT_ROUND=INTERPRET, num_warps=warps, STAGES=STATS_STAGES,
                                     SOURCE_ROW=source_row, **reg_cap(STATS_MAXNREG))
    return db


class _WeightCastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dtype, stats, link, cast):
        ctx.dtype, ctx.link = w.dtype, link
        ctx.weight = weakref.ref(w) if link is not None else None
        return branch_grad(w.detach(), dtype, stats, source_row=True) if cast is None else cast[0]

    @staticmethod
    def backward(ctx, g):
        w = ctx.weight() if ctx.weight is not None else None
        # the cast back becomes w.grad as it is only while no gradient is accumulated yet: then it takes the row
        target = ctx.link.grad_weight_target(g.device) if w is not None and w.grad is None else None
        if target is None:
            return g.to(ctx.dtype), None, None, None, None
        grad = branch_grad(g, ctx.dtype, target)
        ctx.link.took_grad_weight(grad, target)
        return grad, None, None, None, None


@torch.compiler.disable
def weight_cast(w: torch.Tensor, dtype: torch.dtype, stats: ts.Target | None, link=None,
                cast: torch.Tensor | None = None) -> torch.Tensor:
    """``w.to(dtype)``, differentiable as that (the gradient cast back to w's dtype), in one pass that takes the row
    of w's own values into ``stats``: autocast's cast of a weight, with the weight's row for the agent from the same
    read. ``link`` (the layer's ``agent.core.FusedLink``): the backward's cast takes the row of w's gradient where it
    asks for it (``grad_weight_target``). ``cast``: w's cast made already, row included (``weight_casts``, a batch of
    a step's weights), which this returns as w's, differentiable. Reference: ``w.to(dtype)``."""
    # (a tensor argument returned as it is would come back as a view of it: handed over in a tuple, it is an output)
    return _WeightCastFn.apply(w, dtype, stats, link, None if cast is None else (cast,))


def residual_add_forward(x: torch.Tensor, b: torch.Tensor, stats: ts.Target | None = None) -> torch.Tensor:
    """x + b (same shape) in one pass; with ``stats`` b's row into the target."""
    if x.shape != b.shape:
        raise ValueError(f"residual_add: x {tuple(x.shape)} and b {tuple(b.shape)} must have one shape")
    xc, bc = x.contiguous(), b.contiguous()
    out = torch.empty(x.shape, dtype=torch.result_type(x, b), device=x.device)
    n = out.numel()
    programs, block, warps = _launch_shape(n, x.device, stats is not None)
    _residual_add_kernel[(programs,)](xc, bc, out, n, **ts.epilogue_args(stats, programs, out, later=True),
                                      BLOCK=block, SOFT_ROUND=INTERPRET, num_warps=warps,
                                      STAGES=STATS_STAGES if stats is not None else 1,
                                      **reg_cap(STATS_MAXNREG if stats is not None else None))
    return out


class _ResidualAddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b, stats, grad_stats):
        ctx.dtypes, ctx.grad_stats = (x.dtype, b.dtype), grad_stats
        return residual_add_forward(x, b, stats)

    @staticmethod
    def backward(ctx, g):
        dx, db = ctx.dtypes
        target = ctx.grad_stats() if ctx.grad_stats is not None else None
        return g.to(dx), g.to(db) if target is None else branch_grad(g, db, target), None, None


def residual_add(x: torch.Tensor, b: torch.Tensor, stats: ts.Target | None = None,
                 grad_stats: Callable[[], ts.Target | None] | None = None) -> torch.Tensor:
    """x + b, differentiable, in one pass; with ``stats`` b's statistics row (see the module docstring);
    ``grad_stats``, called in the backward, gives the target of the row of b's gradient (None: none)."""
    return _ResidualAddFn.apply(x, b, stats, grad_stats)


def residual_add_ref(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x + b
