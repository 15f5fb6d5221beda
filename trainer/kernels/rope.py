"""RoPE on the attention's fused qkv output, forward and backward in one pass each; each can also take the
statistics row of what it reads or writes anyway (the qkv linear's ``output``, and its ``grad_output``) for the agent.

qkv (B, T, 3 * NH * HD) in, as [q | k | v] with NH heads of HD channels (``trainer.layers.Attention``); q and k
rotated (rotate-half layout, ``trainer.layers.Rotary``: channel i pairs with i + HD/2 and turns by the angle of its
position) and v, each (B, NH, T, HD) and contiguous, out. The rotation is computed in fp32 as ``Rotary.forward``
computes it (each product rounded, then their sum; no FMA) and rounded to qkv's dtype once: the values are torch's.
The backward gives qkv's gradient, (B, T, 3 * NH * HD), from those of q, k and v: the rotation's transpose on dq and
dk, dv copied. Reference beside them: ``rope_qkv_ref``.

``stats=`` (an ``agent.stats.launch.Target``): the qkv output's SPEC section-4 row, accumulated as
``trainer.kernels.swiglu`` accumulates y's (``stats.device.stream_add``), with the careful path of
``stats.device.careful_tiles``. Without it a statistics kernel reads the qkv output once more (under CUDA graphs the
FP8 linear's deferred output read). (A path through qkv's 32-bit words, as ``swiglu``'s, issued fewer instructions
but ran slower, so there is none.) The backward's ``grad_stats`` likewise gives the row of qkv's gradient (a plain qkv linear's
``grad_output``; an FP8 linear's backward cast takes its own) from the halves it stores.

Persistent programs (a few per SM) loop over tiles of BT positions of one batch row and head.
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
    stream_add,
    stream_partial,
    stream_start,
)

from .fp8_gemm import _to_out
from .quantize import INTERPRET, cdiv, persistent_programs, reg_cap

BT = 32  # positions per tile
# positions per tile of the kernels with a row (their warps follow: ``_launch_shape``);
# ``trainer.kernels.swiglu.STATS_WARPS`` says why smaller programs can be faster
STATS_BT = 32
PROGRAMS_PER_SM = 4
# Persistent programs per SM of the kernels with a row, and their register cap (ptxas). Uncapped the forward fits one
# program of 8 warps per SM; at 80 registers three fit, and the latency the extra warps hide outweighs the few spills
# in the forward's tile loop.
STATS_PROGRAMS_PER_SM = 3
STATS_MAXNREG = 80
# Software-pipelining depth of the tile loops with a row (``tl.range``'s num_stages). Deeper spilled at the register
# cap and was slower.
STATS_STAGES = 1
_SOFT_ROUND = tl.constexpr(INTERPRET)  # for the careful path's loader of the gradient (kernels take it as an argument)


def supported(head_dim: int) -> bool:
    """Whether the kernels take this head size: a power of two from 16 (half a head is a tile's row, 8 elements a
    thread's statistics row)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@triton.jit
def _where(t, T, NH, BT: tl.constexpr):
    """Tile t's batch row, head, positions and their mask."""
    ntb = tl.cdiv(T, BT)
    bh = t // ntb
    pos = (t % ntb) * BT + tl.arange(0, BT)
    return bh // NH, bh % NH, pos, pos < T


@triton.jit
def _in_ptrs(base, b, h, pos, slot, T, NH, HD2: tl.constexpr):
    """The first halves of head h's ``slot`` (0 q, 1 k, 2 v) at positions ``pos`` of a (B, T, 3, NH, HD) tensor."""
    row = ((b.to(tl.int64) * T + pos) * 3 + slot) * NH + h
    return base + row[:, None] * (2 * HD2) + tl.arange(0, HD2)[None, :]


@triton.jit
def _out_ptrs(base, b, h, pos, T, NH, HD2: tl.constexpr):
    """The first halves of head h at positions ``pos`` of a (B, NH, T, HD) tensor."""
    row = (b.to(tl.int64) * NH + h) * T + pos
    return base + row[:, None] * (2 * HD2) + tl.arange(0, HD2)[None, :]


@triton.jit
def _tile_trig(t, T, NH, cos_ptr, sin_ptr, BT: tl.constexpr, HD2: tl.constexpr):
    """Tile t's batch row, head, positions and their mask, the tile's [BT, HD2] mask, and cos and sin there."""
    b, h, pos, pm = _where(t, T, NH, BT)
    cols = tl.arange(0, HD2)
    m = pm[:, None] & (cols[None, :] < HD2)
    trig = pos[:, None] * HD2 + cols[None, :]
    return b, h, pos, pm, m, tl.load(cos_ptr + trig, mask=m, other=0.0), tl.load(sin_ptr + trig, mask=m, other=0.0)


@triton.jit
def _head_ptrs(slot: tl.constexpr, q_ptr, k_ptr, v_ptr, b, h, pos, T, NH, HD2: tl.constexpr):
    """``_out_ptrs`` of q, k or v by ``slot``."""
    if slot == 0:
        ptrs = _out_ptrs(q_ptr, b, h, pos, T, NH, HD2)
    elif slot == 1:
        ptrs = _out_ptrs(k_ptr, b, h, pos, T, NH, HD2)
    else:
        ptrs = _out_ptrs(v_ptr, b, h, pos, T, NH, HD2)
    return ptrs


@triton.jit
def _mul(a, b, INTERPRETED: tl.constexpr):
    """a * b in fp32, rounded on its own as torch's separate multiply rounds it: ``mul.rn`` is never contracted into
    an FMA with the add that follows (contracted, a cancelling x1*cos - x2*sin lands many bf16 units off torch's).
    The interpreter contracts nothing."""
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _part(src, t, part, BT: tl.constexpr, HD2: tl.constexpr):
    """The careful path's loader (``stats.device.careful_tiles``): half ``part % 2`` of slot ``part // 2`` of tile t
    of the qkv output, fp32, as the statistics' [R, 8] view, with its mask."""
    qkv_ptr, T, NH = src
    b, h, pos, pm = _where(t, T, NH, BT)
    m = pm[:, None] & (tl.arange(0, HD2)[None, :] < HD2)
    x = tl.load(_in_ptrs(qkv_ptr, b, h, pos, part // 2, T, NH, HD2) + (part % 2) * HD2, mask=m, other=0.0)
    R: tl.constexpr = BT * HD2 // 8
    return tl.reshape(x.to(tl.float32), [R, 8]), tl.reshape(m, [R, 8])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _rope_fwd_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, T, NH, tiles, sp_ptr, ctr_ptr, dst_ptr,
                     dst_index, merge, cen_ptr, c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr,
                     C_PTR: tl.constexpr, AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr,
                     UTHR: tl.constexpr, SMODE: tl.constexpr, BT: tl.constexpr, HD2: tl.constexpr,
                     SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """q, k rotated and v, persistent over tiles; with STATS the qkv output's row, its six half-heads per tile read
    as a thread's rows of 8 (the shift from q's first half in the program's first tile)."""
    dtype = q_ptr.dtype.element_ty
    R: tl.constexpr = BT * HD2 // 8
    cols = tl.arange(0, HD2)
    pid = tl.program_id(0)
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        b0, h0, pos0, pm0 = _where(pid, T, NH, BT)
        m0 = pm0[:, None] & (cols[None, :] < HD2)
        x0 = tl.load(_in_ptrs(qkv_ptr, b0, h0, pos0, 0, T, NH, HD2), mask=m0, other=0.0).to(tl.float32)
        c, p, ok, ncp, acc = stream_start(x0, m0, R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        b, h, pos, pm, m, cos, sin = _tile_trig(t, T, NH, cos_ptr, sin_ptr, BT, HD2)
        inside = tl.sum(pm.to(tl.int32), 0)
        for slot in tl.static_range(3):
            src = _in_ptrs(qkv_ptr, b, h, pos, slot, T, NH, HD2)
            r1 = tl.load(src, mask=m, other=0.0)
            r2 = tl.load(src + HD2, mask=m, other=0.0)
            x1 = r1.to(tl.float32)
            x2 = r2.to(tl.float32)
            dst = _head_ptrs(slot, q_ptr, k_ptr, v_ptr, b, h, pos, T, NH, HD2)
            if slot < 2:
                y1 = _mul(x1, cos, SOFT_ROUND) - _mul(x2, sin, SOFT_ROUND)
                y2 = _mul(x1, sin, SOFT_ROUND) + _mul(x2, cos, SOFT_ROUND)
                tl.store(dst, _to_out(y1, dtype, SOFT_ROUND), mask=m)
                tl.store(dst + HD2, _to_out(y2, dtype, SOFT_ROUND), mask=m)
            else:
                tl.store(dst, r1, mask=m)
                tl.store(dst + HD2, r2, mask=m)
            if STATS:
                acc = stream_add(acc, x1, m, inside == BT, p, ncp, lo, hi, HIST, R, 8, ht)
                acc = stream_add(acc, x2, m, inside == BT, p, ncp, lo, hi, HIST, R, 8, ht)
        ce += inside * (6 * HD2)
    if STATS:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, ce, c, p, ok, _part, (qkv_ptr, T, NH), tiles, 6, lo, hi, HIST, R, BT, HD2, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


@triton.jit
def _grad_halves(slot: tl.constexpr, dq_ptr, dk_ptr, dv_ptr, b, h, pos, m, cos, sin, T, NH, HD2: tl.constexpr,
                 DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """The two halves of head h's ``slot`` of qkv's gradient at ``pos``, in DTYPE: dq and dk rotated back
    (dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin), dv as it is."""
    src = _head_ptrs(slot, dq_ptr, dk_ptr, dv_ptr, b, h, pos, T, NH, HD2)
    r1 = tl.load(src, mask=m, other=0.0)
    r2 = tl.load(src + HD2, mask=m, other=0.0)
    if slot < 2:
        g1 = r1.to(tl.float32)
        g2 = r2.to(tl.float32)
        d1 = _to_out(_mul(g1, cos, SOFT_ROUND) + _mul(g2, sin, SOFT_ROUND), DTYPE, SOFT_ROUND)
        d2 = _to_out(_mul(g2, cos, SOFT_ROUND) - _mul(g1, sin, SOFT_ROUND), DTYPE, SOFT_ROUND)
    else:
        d1 = r1.to(DTYPE)
        d2 = r2.to(DTYPE)
    return d1, d2


@triton.jit
def _grad_part(src, t, part, BT: tl.constexpr, HD2: tl.constexpr):
    """The careful path's loader of the backward's row: half ``part % 2`` of slot ``part // 2`` of tile t of qkv's
    gradient, recomputed from dq, dk, dv (not re-read: other threads of the program stored it), fp32, as the
    statistics' [R, 8] view, with its mask."""
    dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, T, NH = src
    b, h, pos, _, m, cos, sin = _tile_trig(t, T, NH, cos_ptr, sin_ptr, BT, HD2)
    d1, d2 = _grad_halves(part // 2, dq_ptr, dk_ptr, dv_ptr, b, h, pos, m, cos, sin, T, NH, HD2,
                          dqkv_ptr.dtype.element_ty, _SOFT_ROUND)
    x = d2
    if part % 2 == 0:
        x = d1
    R: tl.constexpr = BT * HD2 // 8
    return tl.reshape(x.to(tl.float32), [R, 8]), tl.reshape(m, [R, 8])


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _rope_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, T, NH, tiles, sp_ptr, ctr_ptr, dst_ptr,
                     dst_index, merge, cen_ptr, c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr,
                     C_PTR: tl.constexpr, AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr,
                     UTHR: tl.constexpr, SMODE: tl.constexpr, BT: tl.constexpr, HD2: tl.constexpr,
                     SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """dqkv from dq, dk (rotated back) and dv (copied); with STATS its row (the qkv linear's ``grad_output``), taken
    from the halves it stores as the forward takes qkv's (the shift from dq's first half in the program's first
    tile)."""
    dtype = dqkv_ptr.dtype.element_ty
    R: tl.constexpr = BT * HD2 // 8
    pid = tl.program_id(0)
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        b0, h0, pos0, _, m0, cos0, sin0 = _tile_trig(pid, T, NH, cos_ptr, sin_ptr, BT, HD2)
        x0, _ = _grad_halves(0, dq_ptr, dk_ptr, dv_ptr, b0, h0, pos0, m0, cos0, sin0, T, NH, HD2, dtype, SOFT_ROUND)
        c, p, ok, ncp, acc = stream_start(x0.to(tl.float32), m0, R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
    ce = tl.zeros([], tl.int32)
    for t in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        b, h, pos, pm, m, cos, sin = _tile_trig(t, T, NH, cos_ptr, sin_ptr, BT, HD2)
        inside = tl.sum(pm.to(tl.int32), 0)
        for slot in tl.static_range(3):
            d1, d2 = _grad_halves(slot, dq_ptr, dk_ptr, dv_ptr, b, h, pos, m, cos, sin, T, NH, HD2, dtype, SOFT_ROUND)
            dst = _in_ptrs(dqkv_ptr, b, h, pos, slot, T, NH, HD2)
            tl.store(dst, d1, mask=m)
            tl.store(dst + HD2, d2, mask=m)
            if STATS:
                acc = stream_add(acc, d1.to(tl.float32), m, inside == BT, p, ncp, lo, hi, HIST, R, 8, ht)
                acc = stream_add(acc, d2.to(tl.float32), m, inside == BT, p, ncp, lo, hi, HIST, R, 8, ht)
        ce += inside * (6 * HD2)
    if STATS:
        n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            acc, ce, c, p, ok, _grad_part, (dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, T, NH), tiles, 6, lo,
            hi, HIST, R, BT, HD2, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, n, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


def _launch_shape(b: int, t: int, nh: int, hd: int, device: torch.device, rows: bool) -> tuple[int, int, int, int]:
    """(programs, tiles, positions per tile, warps) of a launch over b x nh heads of t positions, with a statistics
    row or without. Warps for a tile of bt x hd / 2: 8 elements a thread (one 16-byte load of bf16, a whole statistics
    row)."""
    bt = STATS_BT if rows else BT
    tiles = cdiv(t, bt) * b * nh
    return (persistent_programs(tiles, STATS_PROGRAMS_PER_SM if rows else PROGRAMS_PER_SM, device), tiles, bt,
            max(1, min(8, bt * (hd // 2) // (8 * 32))))


def _check(qkv: torch.Tensor, cos: torch.Tensor, n_head: int) -> tuple[int, int, int]:
    b, t, width = qkv.shape
    if width % (3 * n_head):
        raise ValueError(f"rope_qkv: the last dimension ({width}) is not 3 x {n_head} heads")
    hd = width // (3 * n_head)
    if not supported(hd):
        raise ValueError(f"rope_qkv: head size {hd} is not a power of two >= 16")
    if cos.shape != (cos.shape[0], hd // 2) or t > cos.shape[0]:
        raise ValueError(f"rope_qkv: {t} positions of head size {hd} against cos/sin of {tuple(cos.shape)}")
    return b, t, hd


def rope_qkv_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int,
                     stats: ts.Target | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), each (B, NH, T, HD), of qkv (B, T, 3 * NH * HD) with positions 0..T-1 of ``cos``/``sin``
    (max_seq_len, HD / 2, fp32); with ``stats`` qkv's row into that target."""
    b, t, hd = _check(qkv, cos, n_head)
    qkv = qkv.contiguous()
    q, k, v = (torch.empty(b, n_head, t, hd, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    programs, tiles, bt, warps = _launch_shape(b, t, n_head, hd, qkv.device, stats is not None)
    _rope_fwd_kernel[(programs,)](qkv, q, k, v, cos.contiguous(), sin.contiguous(), t, n_head, tiles,
                                  **ts.epilogue_args(stats, programs, qkv, later=True), BT=bt, HD2=hd // 2,
                                  SOFT_ROUND=INTERPRET, STAGES=STATS_STAGES if stats is not None else 1,
                                  num_warps=warps, **reg_cap(STATS_MAXNREG if stats is not None else None))
    return q, k, v


def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      dtype: torch.dtype, stats: ts.Target | None = None) -> torch.Tensor:
    """qkv's gradient (B, T, 3 * NH * HD) in ``dtype`` from those of q, k and v (B, NH, T, HD); with ``stats`` its row
    into that target."""
    b, nh, t, hd = dv.shape
    dqkv = torch.empty(b, t, 3 * nh * hd, dtype=dtype, device=dv.device)
    programs, tiles, bt, warps = _launch_shape(b, t, nh, hd, dv.device, stats is not None)
    _rope_bwd_kernel[(programs,)](dq.contiguous(), dk.contiguous(), dv.contiguous(), dqkv, cos.contiguous(),
                                  sin.contiguous(), t, nh, tiles, **ts.epilogue_args(stats, programs, dqkv, later=True),
                                  BT=bt, HD2=hd // 2, SOFT_ROUND=INTERPRET,
                                  STAGES=STATS_STAGES if stats is not None else 1, num_warps=warps,
                                  **reg_cap(STATS_MAXNREG if stats is not None else None))
    return dqkv


class _RopeQKVFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_head, stats, grad_stats):
        ctx.save_for_backward(cos, sin)
        ctx.dtype, ctx.grad_stats = qkv.dtype, grad_stats
        return rope_qkv_forward(qkv, cos, sin, n_head, stats)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        like = next(g for g in (dq, dk, dv) if g is not None)
        dq, dk, dv = (torch.zeros_like(like) if g is None else g for g in (dq, dk, dv))
        stats = ctx.grad_stats() if ctx.grad_stats is not None else None
        return rope_qkv_backward(dq, dk, dv, cos, sin, ctx.dtype, stats), None, None, None, None, None


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, stats: ts.Target | None = None,
             grad_stats: Callable[[], ts.Target | None] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) of the fused qkv output, q and k rotated, differentiable, in one pass each way (see the module
    docstring); with ``stats`` the qkv output's statistics row; ``grad_stats``, called in the backward right before
    its kernel, gives the target of the qkv gradient's row (None: none)."""
    return _RopeQKVFn.apply(qkv, cos, sin, n_head, stats, grad_stats)


def rope_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's: ``Attention.heads`` without QK-norm, ``Rotary.forward`` on q and k."""
    b, t, width = qkv.shape
    q, k, v = qkv.view(b, t, 3, n_head, width // (3 * n_head)).permute(2, 0, 3, 1, 4)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:t], sin[:t]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)

    return rotate(q), rotate(k), v
