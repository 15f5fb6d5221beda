"""SwiGLU's elementwise part, h = silu(gate) * up of y = [gate | up] (the fused fc1's output), forward and backward,
in one pass each; the forward can also take the statistics rows of y and of h for the agent from what it reads and
writes anyway.

y (M, 2H) in, h (M, H) out, rounded as torch rounds ``F.silu(gate) * up`` in y's dtype: silu in fp32, rounded to the
dtype, times up in fp32, rounded (the exponential and the reciprocal are approximations that may differ from torch's
in the last fp32 bits, so h may differ by one unit in the last place of the dtype, rarely). The backward gives
dy = [d_gate | d_up] as torch's autograd of that expression does: d_up = dh * silu(gate) and
d_gate = (dh * up) * sig (1 + gate (1 - sig)), each product rounded to the dtype. Reference beside them:
``swiglu_ref``.

``stats=`` (an ``agent.stats.launch.Target``): y's SPEC section-4 row, as the agent's hooks emulate it for a GEMM
output (``stats.launch.nofmt_consts``), accumulated from the tiles the forward loads as the standalone kernel
accumulates (``tile_fast``; the kernel's docstring; where that does not hold, ``stats.device.careful_tiles``) and
merged by the next ``stats.launch.merge_later`` (``flush_deferred``); ``h_stats=``
likewise h's, from the tiles it stores. For bf16 y of even width the forward takes y's row through y's 32-bit words
(fewer instructions an element), and h's through the words of h it stores (with the histogram, deferred to the next
statistics launch). The backward's ``dy_stats`` gives dy's row from the tiles it stores, for bf16 through dy's words.
They are the rows of fc1's ``output``, fc2's ``input`` and fc1's ``grad_output`` (``trainer.fused.SwiGLUAct``; the
last two for plain linears, an FP8 linear's casts take them): without them a statistics kernel reads y once more
(with an FP8 fc1, the deferred output read; y is the largest tensor of a Llama block), and with plain linears, h and
dy too.

Persistent programs (a few per SM) loop over (BM, BN) tiles of h, so the statistics have a few hundred partials
to merge, not one per tile.
"""

from __future__ import annotations

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
    shift_of,
    stream_add,
    stream_partial,
    stream_zero,
    words_add,
    words_fold,
    words_zero,
)

from .. import torch_ops
from .fp8_gemm import _to_out
from .quantize import INTERPRET, cdiv, persistent_programs, reg_cap
from .words import pack, unpack

BM, BN = 32, 128
PROGRAMS_PER_SM = 4
WARPS = 8
# The kernels with a row take tiles of STATS_BM rows in programs of STATS_WARPS warps, STATS_PROGRAMS_PER_SM per SM: at
# the register cap (128 a thread) 16 warps fill an SM's registers either as two programs of 8 warps or as four of 4;
# the 8-warp programs stalled on fixed latencies, the shared-memory queue and the pipeline's barrier, the 4-warp ones
# less (the plain kernels, streaming at copy speed, keep 8 warps). More programs queue a second wave.
STATS_BM = 16
STATS_WARPS = 4
STATS_PROGRAMS_PER_SM = 4
# a statistics row is a thread's 16-byte load of y: at 16, each row spanned two threads, one shuffle per sum per row
_V = tl.constexpr(8)
# On the words path (bf16 y of even width) h's row without the histogram comes from the words of h the kernel stores
# rather than from a statistics launch reading h again. Uncapped registers: at the 128 cap its loop spilled; uncapped,
# two programs of 4 warps fit an SM.
WORDS_H_MAXNREG: int | None = None
WORDS_H_PROGRAMS_PER_SM = 2
# Software-pipelining depth of the tile loops of the kernels with a row (``tl.range``'s num_stages: from 2 on, Triton
# issues the next tiles' loads into shared memory ahead of this tile's arithmetic, which the rows make long); the best
# depths found for the forward and the backward. Without a row the kernels stream at copy speed and take 1.
STATS_STAGES = 3
BWD_STATS_STAGES = 2
_SOFT_ROUND = tl.constexpr(INTERPRET)  # for the careful path's loaders of h and dy (the kernels take it as an argument)
# Register cap of the forward with y's row only, and of the backward with dy's (ptxas; None: uncapped): at this cap
# neither spills in its tile loop and more programs fit an SM; the forward with h's row too spilled at it, so it runs
# uncapped.
STATS_MAXNREG: int | None = 128


@triton.jit
def _sigmoid(g, SOFT_ROUND: tl.constexpr):
    """1 / (1 + exp(-g)), fp32. On hardware as two flush-to-zero approximations: Triton's exp and division
    (ex2.approx.f32, div.full.f32) guard against subnormal results with compares and scalings, a large share of the
    forward's instructions outside its row. A subnormal e is lost in 1 + e anyway; a subnormal reciprocal (e above
    2^126: gate below -87.3) becomes 0, so silu gives -0 where torch gives about -5e-37. The interpreter
    (SOFT_ROUND) has no PTX: Triton's exp and division there."""
    if not SOFT_ROUND:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _silu_rounded(g, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """silu(g) in fp32 (g fp32), rounded to DTYPE and back, as ``F.silu`` returns it; and sigmoid(g)."""
    sig = _sigmoid(g, SOFT_ROUND)
    return _to_out(g * sig, DTYPE, SOFT_ROUND).to(tl.float32), sig


@triton.jit
def _tile(y_ptr, t, n_tn, M, H, stride_y, BM: tl.constexpr, BN: tl.constexpr):
    """Tile t of the (M, H) output: gate and up (fp32), its mask, rows and columns."""
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cols = (t % n_tn) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    gp = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gp + H, mask=mask, other=0.0).to(tl.float32)
    return g, u, mask, rows, cols


@triton.jit
def _tile_extent(t, n_tn, M, H, BM: tl.constexpr, BN: tl.constexpr):
    """How many elements of h tile t holds (fewer at the last rows and columns), and whether it is full."""
    tm = tl.minimum(M - (t // n_tn) * BM, BM)
    tn = tl.minimum(H - (t % n_tn) * BN, BN)
    return tm * tn, (tm == BM) & (tn == BN)


@triton.jit
def _h_of(g, u, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    s, _ = _silu_rounded(g, DTYPE, SOFT_ROUND)
    return _to_out(s * u, DTYPE, SOFT_ROUND)


@triton.jit
def _y_shift(g0, u0, m1):
    """y's shift c, scale p, whether they hold, and -c*p, from a program's first tile of gate and up (``m1``: its mask,
    flat): the mean of the two halves' shifts, the larger amax's power of two."""
    cg, pg, okg = shift_of(tl.reshape(g0, [g0.numel]), m1)
    cu, pu, oku = shift_of(tl.reshape(u0, [u0.numel]), m1)
    c = (cg + cu) * 0.5
    p = tl.minimum(pg, pu)
    return c, p, okg & oku, -(c * p)


@triton.jit
def _y_part(src, t, part, BM: tl.constexpr, BN: tl.constexpr):
    """The careful path's loader (``stats.device.careful_tiles``): y's gate (part 0) or up (1) half of tile t, fp32,
    as the statistics' [R, V] view, with its mask."""
    y_ptr, M, H, stride_y = src
    n_tn = tl.cdiv(H, BN)
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cols = (t % n_tn) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    x = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :] + part * H, mask=mask, other=0.0)
    return tl.reshape(x.to(tl.float32), [BM * BN // _V, _V]), tl.reshape(mask, [BM * BN // _V, _V])


@triton.jit
def _h_part(src, t, part, BM: tl.constexpr, BN: tl.constexpr):
    """The same for h, recomputed from tile t of y (one part)."""
    y_ptr, M, H, stride_y = src
    g, u, mask, _, _ = _tile(y_ptr, t, tl.cdiv(H, BN), M, H, stride_y, BM, BN)
    h = _h_of(g, u, y_ptr.dtype.element_ty, _SOFT_ROUND).to(tl.float32)
    return tl.reshape(h, [BM * BN // _V, _V]), tl.reshape(mask, [BM * BN // _V, _V])


@triton.jit
def _row_of(acc, n, c, p, ok, y_ptr, M, H, stride_y, lo, hi, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr,
            ahm_val, HIST: tl.constexpr, AHM_PTR: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
            SMODE: tl.constexpr, OF_H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ht=None):
    """This program's partial of ``acc`` (n elements summed about c, scaled by p), or of the careful path where the
    fast one does not hold, for the target row (``fused_epilogue``: merged later, or by the last program)."""
    tiles = tl.cdiv(M, BM) * tl.cdiv(H, BN)
    R: tl.constexpr = BM * BN // _V
    if OF_H:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, n, c, p, ok, _h_part, (y_ptr, M, H, stride_y), tiles, 1, lo, hi, HIST, R, BM, BN, ht)
    else:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, n, c, p, ok, _y_part, (y_ptr, M, H, stride_y), tiles, 2, lo, hi, HIST, R, BM, BN, ht)
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros, outl,
                   under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


@triton.jit(do_not_specialize=["dst_index", "merge", "dst_index_h", "merge_h"])
def _swiglu_fwd_kernel(y_ptr, h_ptr, M, H, stride_y, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean,
                       c_std, k, ahm_ptr, ahm_val, sp_ptr_h, ctr_ptr_h, dst_ptr_h, dst_index_h, merge_h, cen_ptr_h,
                       c_mean_h, c_std_h, k_h, ahm_ptr_h, ahm_val_h, STATS: tl.constexpr, C_PTR: tl.constexpr,
                       AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                       SMODE: tl.constexpr, STATS_H: tl.constexpr, C_PTR_H: tl.constexpr, AHM_PTR_H: tl.constexpr,
                       HIST_H: tl.constexpr, FMAX_H: tl.constexpr, UTHR_H: tl.constexpr, SMODE_H: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """h of y, persistent over (BM, BN) tiles of h; with STATS y's row, with STATS_H h's row (the *_h arguments: a
    second target). The rows are taken as the standalone kernel takes them (``stats.device.tile_fast``: a thread sums
    its own rows of V elements in fp32, about a shift from the program's first tile; y's shift is the mean of its two
    halves' shifts), with its careful path (exact fp64 passes re-reading y) where that does not hold. y's histogram
    counts in the shared-memory table on hardware; h's, with ``tl.histogram`` (a kernel has one table)."""
    dtype = h_ptr.dtype.element_ty
    V: tl.constexpr = _V
    R: tl.constexpr = BM * BN // V
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    pid = tl.program_id(0)
    if STATS or STATS_H:
        g0, u0, m0, _, _ = _tile(y_ptr, pid, n_tn, M, H, stride_y, BM, BN)
        m1 = tl.reshape(m0, [BM * BN])
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        c, p, ok, ncp = _y_shift(g0, u0, m1)
        acc = stream_zero(R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
    if STATS_H:
        lo_h, hi_h = fused_bounds(cen_ptr_h, c_mean_h, c_std_h, k_h, C_PTR_H)
        c_h, p_h, ok_h = shift_of(tl.reshape(_h_of(g0, u0, dtype, SOFT_ROUND).to(tl.float32), [BM * BN]), m1)
        ncp_h = -(c_h * p_h)
        acc_h = stream_zero(R)
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        g, u, mask, rows, cols = _tile(y_ptr, t, n_tn, M, H, stride_y, BM, BN)
        h = _h_of(g, u, dtype, SOFT_ROUND)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], h, mask=mask)
        elems, full = _tile_extent(t, n_tn, M, H, BM, BN)
        if STATS:  # both halves are elements of y
            acc = stream_add(acc, g, mask, full, p, ncp, lo, hi, HIST, R, V, ht)
            acc = stream_add(acc, u, mask, full, p, ncp, lo, hi, HIST, R, V, ht)
        if STATS_H:
            acc_h = stream_add(acc_h, h.to(tl.float32), mask, full, p_h, ncp_h, lo_h, hi_h, HIST_H, R, V)
        ce += elems
    if STATS:
        _row_of(acc, 2 * ce, c, p, ok, y_ptr, M, H, stride_y, lo, hi, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge,
                ahm_ptr, ahm_val, HIST, AHM_PTR, FMAX, UTHR, SMODE, False, BM, BN, ht)
    if STATS_H:
        _row_of(acc_h, ce, c_h, p_h, ok_h, y_ptr, M, H, stride_y, lo_h, hi_h, sp_ptr_h, ctr_ptr_h, dst_ptr_h,
                dst_index_h, merge_h, ahm_ptr_h, ahm_val_h, HIST_H, AHM_PTR_H, FMAX_H, UTHR_H, SMODE_H, True, BM, BN)


@triton.jit
def _word_tile(yw_ptr, t, n_tn, M, hw, sw, BM: tl.constexpr, BW: tl.constexpr):
    """Tile t of h as 32-bit words (BW a row, ``hw`` in all): its rows, word columns and mask, and the addresses of its
    gate words in y (``sw`` words a row; the up words lie ``hw`` further)."""
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cw = (t % n_tn) * BW + tl.arange(0, BW)
    mw = (rows[:, None] < M) & (cw[None, :] < hw)
    return rows, cw, mw, yw_ptr + rows[:, None].to(tl.int64) * sw + cw[None, :]


@triton.jit(do_not_specialize=["dst_index", "merge", "dst_index_h", "merge_h"])
def _swiglu_fwd_words_kernel(y_ptr, h_ptr, M, H, stride_y, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean,
                             c_std, k, ahm_ptr, ahm_val, sp_ptr_h, ctr_ptr_h, dst_ptr_h, dst_index_h, merge_h,
                             cen_ptr_h, c_mean_h, c_std_h, k_h, ahm_ptr_h, ahm_val_h, STATS: tl.constexpr,
                             C_PTR: tl.constexpr, AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr,
                             UTHR: tl.constexpr, SMODE: tl.constexpr, STATS_H: tl.constexpr, C_PTR_H: tl.constexpr,
                             AHM_PTR_H: tl.constexpr, HIST_H: tl.constexpr, FMAX_H: tl.constexpr,
                             UTHR_H: tl.constexpr, SMODE_H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """The forward with y's row, for bf16 y of even H, through y's and h's 32-bit words: on a full tile the two
    elements of a word share the counts' and the amax's integer and bf16x2 operations (``stats.device.tile_bf16x2``,
    the standalone kernel's bf16 path); a partial tile takes the fp32 path (``stream_add``). The histogram needs the
    shared-memory table (the launcher checks). With STATS_H h's row too, the same way from the words
    of h it stores, without a histogram (the kernel has one table, y's; the launcher checks)."""
    dtype = h_ptr.dtype.element_ty
    BW: tl.constexpr = BN // 2
    R: tl.constexpr = BM * BW // 4
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    hw = H // 2
    sw = stride_y // 2
    yw_ptr = y_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    hw_ptr = h_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pid = tl.program_id(0)
    g0, u0, m0, _, _ = _tile(y_ptr, pid, n_tn, M, H, stride_y, BM, BN)
    m1 = tl.reshape(m0, [BM * BN])
    lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
    c, p, ok, ncp = _y_shift(g0, u0, m1)
    wacc = words_zero(lo, hi, R)
    if STATS_H:
        lo_h, hi_h = fused_bounds(cen_ptr_h, c_mean_h, c_std_h, k_h, C_PTR_H)
        c_h, p_h, ok_h = shift_of(tl.reshape(_h_of(g0, u0, dtype, SOFT_ROUND).to(tl.float32), [BM * BN]), m1)
        ncp_h = -(c_h * p_h)
        wacc_h = words_zero(lo_h, hi_h, R)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        rows, cw, mw, src = _word_tile(yw_ptr, t, n_tn, M, hw, sw, BM, BW)
        gw = tl.load(src, mask=mw, other=0)
        uw = tl.load(src + hw, mask=mw, other=0)
        g_lo, g_hi = unpack(gw)
        u_lo, u_hi = unpack(uw)
        h = pack(_silu_rounded(g_lo, dtype, SOFT_ROUND)[0] * u_lo, _silu_rounded(g_hi, dtype, SOFT_ROUND)[0] * u_hi,
                  SOFT_ROUND)
        tl.store(hw_ptr + rows[:, None].to(tl.int64) * hw + cw[None, :], h, mask=mw)
        elems, full = _tile_extent(t, n_tn, M, H, BM, BN)
        wacc = words_add(wacc, gw, uw, full, mw, p, ncp, lo, hi, HIST, R, ht)
        if STATS_H:
            wacc_h = words_add(wacc_h, h, None, full, mw, p_h, ncp_h, lo_h, hi_h, False, R)
        ce += elems
    _row_of(words_fold(wacc), 2 * ce, c, p, ok, y_ptr, M, H, stride_y, lo, hi, sp_ptr, ctr_ptr, dst_ptr, dst_index,
            merge, ahm_ptr, ahm_val, HIST, AHM_PTR, FMAX, UTHR, SMODE, False, BM, BN, ht)
    if STATS_H:
        _row_of(words_fold(wacc_h), ce, c_h, p_h, ok_h, y_ptr, M, H, stride_y, lo_h, hi_h, sp_ptr_h, ctr_ptr_h,
                dst_ptr_h, dst_index_h, merge_h, ahm_ptr_h, ahm_val_h, False, AHM_PTR_H, FMAX_H, UTHR_H, SMODE_H, True,
                BM, BN)


@triton.jit
def _dy_unrounded(g, u, dh, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """d_gate and d_up of gate, up and dh (fp32) in fp32, each the product torch's autograd then rounds to DTYPE."""
    s, sig = _silu_rounded(g, DTYPE, SOFT_ROUND)
    d_silu = _to_out(dh * u, DTYPE, SOFT_ROUND).to(tl.float32)
    return d_silu * sig * (1.0 + g * (1.0 - sig)), dh * s


@triton.jit
def _dy_of(g, u, dh, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """d_gate and d_up (DTYPE) of gate, up and dh (fp32), as torch's autograd rounds them."""
    d_gate, d_up = _dy_unrounded(g, u, dh, DTYPE, SOFT_ROUND)
    return _to_out(d_gate, DTYPE, SOFT_ROUND), _to_out(d_up, DTYPE, SOFT_ROUND)


@triton.jit
def _dy_tile(y_ptr, dh_ptr, t, n_tn, M, H, stride_y, BM: tl.constexpr, BN: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Tile t of dy's two halves (y's dtype), its mask, rows and columns."""
    g, u, mask, rows, cols = _tile(y_ptr, t, n_tn, M, H, stride_y, BM, BN)
    dh = tl.load(dh_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    d_gate, d_up = _dy_of(g, u, dh, y_ptr.dtype.element_ty, SOFT_ROUND)
    return d_gate, d_up, mask, rows, cols


@triton.jit
def _dy_part(src, t, part, BM: tl.constexpr, BN: tl.constexpr):
    """The careful path's loader for dy's row: its d_gate (part 0) or d_up (1) half of tile t, recomputed from y and
    dh (not re-read: other threads of the program stored it), fp32, as the statistics' [R, V] view, with its mask."""
    y_ptr, dh_ptr, M, H, stride_y = src
    d_gate, d_up, mask, _, _ = _dy_tile(y_ptr, dh_ptr, t, tl.cdiv(H, BN), M, H, stride_y, BM, BN, _SOFT_ROUND)
    x = d_up
    if part == 0:
        x = d_gate
    return tl.reshape(x.to(tl.float32), [BM * BN // _V, _V]), tl.reshape(mask, [BM * BN // _V, _V])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _swiglu_bwd_kernel(y_ptr, dh_ptr, dy_ptr, M, H, stride_y, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr,
                       c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr,
                       AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                       SMODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SOFT_ROUND: tl.constexpr,
                       STAGES: tl.constexpr):
    """dy of y and dh, persistent over (BM, BN) tiles of h; with STATS dy's row (fc1's ``grad_output``), from the
    tiles it stores, taken as the forward takes y's (shift from the program's first tile of dy)."""
    V: tl.constexpr = _V
    R: tl.constexpr = BM * BN // V
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    pid = tl.program_id(0)
    if STATS:
        dg0, du0, m0, _, _ = _dy_tile(y_ptr, dh_ptr, pid, n_tn, M, H, stride_y, BM, BN, SOFT_ROUND)
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        c, p, ok, ncp = _y_shift(dg0.to(tl.float32), du0.to(tl.float32), tl.reshape(m0, [BM * BN]))
        acc = stream_zero(R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        d_gate, d_up, mask, rows, cols = _dy_tile(y_ptr, dh_ptr, t, n_tn, M, H, stride_y, BM, BN, SOFT_ROUND)
        dp = dy_ptr + rows[:, None].to(tl.int64) * (2 * H) + cols[None, :]
        tl.store(dp, d_gate, mask=mask)
        tl.store(dp + H, d_up, mask=mask)
        if STATS:
            elems, full = _tile_extent(t, n_tn, M, H, BM, BN)
            acc = stream_add(acc, d_gate.to(tl.float32), mask, full, p, ncp, lo, hi, HIST, R, V, ht)
            acc = stream_add(acc, d_up.to(tl.float32), mask, full, p, ncp, lo, hi, HIST, R, V, ht)
            ce += elems
    if STATS:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, 2 * ce, c, p, ok, _dy_part, (y_ptr, dh_ptr, M, H, stride_y), tiles, 2, lo, hi, HIST, R, BM, BN, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _swiglu_bwd_words_kernel(y_ptr, dh_ptr, dy_ptr, M, H, stride_y, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr,
                             c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr,
                             AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                             SMODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SOFT_ROUND: tl.constexpr,
                             STAGES: tl.constexpr):
    """The backward with dy's row, for bf16 y of even H, through 32-bit words: y's and dh's words
    unpacked, each half's d_gate and d_up packed into dy's words (one rounding each, as ``_dy_of``'s), and the row
    taken from those words as the forward's words kernel takes y's (``stats.device.words_add``). The histogram needs
    the shared-memory table (the launcher checks)."""
    dtype = dy_ptr.dtype.element_ty
    BW: tl.constexpr = BN // 2
    R: tl.constexpr = BM * BW // 4
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    hw = H // 2
    sw = stride_y // 2
    word: tl.constexpr = tl.pointer_type(tl.int32)
    yw_ptr = y_ptr.to(word, bitcast=True)
    dhw_ptr = dh_ptr.to(word, bitcast=True)
    dyw_ptr = dy_ptr.to(word, bitcast=True)
    pid = tl.program_id(0)
    dg0, du0, m0, _, _ = _dy_tile(y_ptr, dh_ptr, pid, n_tn, M, H, stride_y, BM, BN, SOFT_ROUND)
    lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
    c, p, ok, ncp = _y_shift(dg0.to(tl.float32), du0.to(tl.float32), tl.reshape(m0, [BM * BN]))
    wacc = words_zero(lo, hi, R)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        rows, cw, mw, src = _word_tile(yw_ptr, t, n_tn, M, hw, sw, BM, BW)
        g_lo, g_hi = unpack(tl.load(src, mask=mw, other=0))
        u_lo, u_hi = unpack(tl.load(src + hw, mask=mw, other=0))
        dh_lo, dh_hi = unpack(tl.load(dhw_ptr + rows[:, None].to(tl.int64) * hw + cw[None, :], mask=mw, other=0))
        dg_lo, du_lo = _dy_unrounded(g_lo, u_lo, dh_lo, dtype, SOFT_ROUND)
        dg_hi, du_hi = _dy_unrounded(g_hi, u_hi, dh_hi, dtype, SOFT_ROUND)
        dgw = pack(dg_lo, dg_hi, SOFT_ROUND)
        duw = pack(du_lo, du_hi, SOFT_ROUND)
        dst = dyw_ptr + rows[:, None].to(tl.int64) * H + cw[None, :]  # dy's rows: 2H elements, H words
        tl.store(dst, dgw, mask=mw)
        tl.store(dst + hw, duw, mask=mw)
        elems, full = _tile_extent(t, n_tn, M, H, BM, BN)
        wacc = words_add(wacc, dgw, duw, full, mw, p, ncp, lo, hi, HIST, R, ht)
        ce += elems
    n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
        words_fold(wacc), 2 * ce, c, p, ok, _dy_part, (y_ptr, dh_ptr, M, H, stride_y), tiles, 2, lo, hi, HIST, R, BM,
        BN, ht)
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros, outl,
                   under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


def _launch_shape(M: int, H: int, device: torch.device, rows: bool) -> tuple[int, int, int]:
    """(programs, tile rows, warps) of a launch over h (M, H), with a statistics row or without."""
    bm, warps, per_sm = (STATS_BM, STATS_WARPS, STATS_PROGRAMS_PER_SM) if rows else (BM, WARPS, PROGRAMS_PER_SM)
    return persistent_programs(cdiv(M, bm) * cdiv(H, BN), per_sm, device), bm, warps


def swiglu_forward(y: torch.Tensor, stats: ts.Target | None = None,
                   h_stats: ts.Target | None = None) -> torch.Tensor:
    """h = silu(gate) * up of y = [gate | up] along the last dimension (even), in y's dtype; with ``stats``, y's row
    into that target, with ``h_stats`` h's row (on the words path with the histogram, deferred:
    ``stats.launch.defer``)."""
    two_h = y.shape[-1]
    if two_h % 2:
        raise ValueError(f"swiglu: the last dimension ({two_h}) must be even: [gate | up]")
    y2 = y.reshape(-1, two_h)
    if y2.stride(1) != 1:
        y2 = y2.contiguous()
    M, H = y2.shape[0], two_h // 2
    h = torch.empty((M, H), dtype=y.dtype, device=y.device)
    programs, bm, warps = _launch_shape(M, H, y.device, stats is not None or h_stats is not None)
    if (stats is not None and y.dtype == torch.bfloat16 and H % 2 == 0 and y2.stride(0) % 2 == 0
            and y2.data_ptr() % 4 == 0 and (not stats.hist or ts.SMEM_HIST)):
        # h's row in this kernel without a histogram, else by the next statistics launch
        h_here = h_stats if h_stats is not None and not h_stats.hist else None
        if h_here is not None:
            programs = persistent_programs(cdiv(M, bm) * cdiv(H, BN), WORDS_H_PROGRAMS_PER_SM, y.device)
        _swiglu_fwd_words_kernel[(programs,)](y2, h, M, H, y2.stride(0),
                                              **ts.epilogue_args(stats, programs, h, later=True),
                                              **ts.epilogue_args(h_here, programs, h, "_h", counter_row=1), BM=bm,
                                              BN=BN, SOFT_ROUND=INTERPRET, num_warps=warps, STAGES=STATS_STAGES,
                                              **reg_cap(STATS_MAXNREG if h_here is None else WORDS_H_MAXNREG))
        if h_stats is not None and h_here is None:
            ts.defer(h, h_stats)
        return h.reshape(*y.shape[:-1], H)
    _swiglu_fwd_kernel[(programs,)](y2, h, M, H, y2.stride(0), **ts.epilogue_args(stats, programs, h, later=True),
                                    **ts.epilogue_args(h_stats, programs, h, "_h", counter_row=1), BM=bm, BN=BN,
                                    SOFT_ROUND=INTERPRET, num_warps=warps,
                                    STAGES=STATS_STAGES if stats is not None or h_stats is not None else 1,
                                    **reg_cap(STATS_MAXNREG if stats is not None and h_stats is None else None))
    return h.reshape(*y.shape[:-1], H)


def _bwd_stages(stats: ts.Target | None, dtype: torch.dtype) -> int:
    """The backward's pipelining depth. An fp32 tile's pipelined buffers can land just under the 48 KiB a launch gets
    without opting in (Triton opts in only above it), and the histogram's static table on top then fails the launch
    ("invalid argument"): fp32 with the histogram keeps no pipelining, safe for any tile size."""
    if stats is None or (stats.hist and dtype == torch.float32):
        return 1
    return BWD_STATS_STAGES


def swiglu_backward(y: torch.Tensor, dh: torch.Tensor, stats: ts.Target | None = None) -> torch.Tensor:
    """dy = [d_gate | d_up] of h = silu(gate) * up, from y and dh (h's gradient), in y's dtype; with ``stats``, dy's
    row into that target."""
    two_h = y.shape[-1]
    y2 = y.reshape(-1, two_h)
    if y2.stride(1) != 1:
        y2 = y2.contiguous()
    M, H = y2.shape[0], two_h // 2
    dh2 = dh.reshape(M, H).to(y.dtype).contiguous()
    dy = torch.empty((M, two_h), dtype=y.dtype, device=y.device)
    programs, bm, warps = _launch_shape(M, H, y.device, stats is not None)
    if (stats is not None and y.dtype == torch.bfloat16 and H % 2 == 0 and y2.stride(0) % 2 == 0
            and y2.data_ptr() % 4 == 0 and dh2.data_ptr() % 4 == 0 and (not stats.hist or ts.SMEM_HIST)):
        _swiglu_bwd_words_kernel[(programs,)](y2, dh2, dy, M, H, y2.stride(0),
                                              **ts.epilogue_args(stats, programs, dy, later=True), BM=bm, BN=BN,
                                              SOFT_ROUND=INTERPRET, num_warps=warps,
                                              STAGES=_bwd_stages(stats, y.dtype), **reg_cap(STATS_MAXNREG))
        return dy.reshape(y.shape)
    _swiglu_bwd_kernel[(programs,)](y2, dh2, dy, M, H, y2.stride(0),
                                    **ts.epilogue_args(stats, programs, dy, later=True), BM=bm, BN=BN,
                                    SOFT_ROUND=INTERPRET, num_warps=warps,
                                    STAGES=_bwd_stages(stats, y.dtype),
                                    **reg_cap(STATS_MAXNREG if stats is not None else None))
    return dy.reshape(y.shape)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, stats, h_stats, dy_stats):
        ctx.save_for_backward(y)
        ctx.dy_stats = dy_stats
        return swiglu_forward(y, stats, h_stats)

    @staticmethod
    def backward(ctx, dh):
        (y,) = ctx.saved_tensors
        return swiglu_backward(y, dh, ctx.dy_stats() if ctx.dy_stats is not None else None), None, None, None


def swiglu(y: torch.Tensor, stats: ts.Target | None = None, h_stats: ts.Target | None = None,
           dy_stats: Callable[[], ts.Target | None] | None = None) -> torch.Tensor:
    """silu(gate) * up of y = [gate | up], differentiable, in one pass each way (see the module docstring); with
    ``stats`` y's statistics row, with ``h_stats`` h's; ``dy_stats``, called in the backward right before its kernel,
    gives the target of dy's row (None: none)."""
    return _SwiGLUFn.apply(y, stats, h_stats, dy_stats)


swiglu_ref = torch_ops.swiglu  # the reference, beside the kernels
