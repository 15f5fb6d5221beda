"""RMSNorm over the last dimension, y = x / sqrt(mean(x^2) + eps) * w, forward and backward as one Triton kernel
each, the forward optionally taking y's statistics row for the agent from the registers it stores y from: the row of
the ``input`` of the linear that y feeds (llama's pre-norms feed qkv and fc1), which that linear then leaves to the
norm (``trainer.fused.RMSNorm``) instead of a statistics kernel reading y once more. With a row, a width that is not
a power of two is taken as chunks of its largest power-of-two divisor (no padded lanes, full tiles).

y has x's dtype, as ``trainer.torch_ops.rms_norm`` (the reference; under autocast the next linear casts y). Its
values are that computation's in fp32 with the sum of squares in another order: a few units in the last place apart.
The backward, with n = x * rstd: dx = rstd * (g * w - n * mean(g * w * n)) in x's dtype, and dw = the sum over rows of
g * n, per-program partials in fp32 that torch sums.
"""

from __future__ import annotations

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
)

from ..torch_ops import rms_norm as rms_norm_ref  # noqa: F401  (the reference, beside the kernels)
from .fp8_gemm import _to_out
from .quantize import INTERPRET, cdiv, next_power_of_2, persistent_programs, reg_cap
from .residual import PROGRAMS_PER_SM, STATS_MAXNREG, STATS_PROGRAMS_PER_SM, WARPS

TILE = 4096  # elements of a tile: rows of the next power of two of the width, as many as fit
MAX_WIDTH = 16384  # wider rows: torch's ops (a tile holds one whole row)
# With a row the tile loop is software-pipelined (the next tiles' loads issued into shared memory ahead of this one's
# arithmetic) three deep, which hides the row's arithmetic between the loads best. A tile's stages plus the
# histogram's table must stay within the shared memory a launch gets (tests/trainer/test_launch_shared_memory.py checks
# the widths near a limit): a tile of more than STAGE3_BYTES takes two stages, as three of a 16384-wide fp32 row pass
# what a block may opt in to. Programs and the register cap are the residual kernels'.
STATS_STAGES = 3
STAGE3_BYTES = 32 * 1024
# Tile elements and warps of the forward with a row: four programs of 4 warps per SM (the residual kernels'
# STATS_PROGRAMS_PER_SM) spend less time than two of 8 with larger tiles. Rows wider than STATS_TILE take the plain
# forward's warps, in as many fewer programs.
STATS_TILE = 2048
STATS_WARPS = 4
# With a row, a width that is not a power of two is cut into chunks of its largest power-of-two divisor (768: three of
# 256) where that makes at most MAX_CHUNKS: a tile then holds no padding and, with all its rows inside, takes the
# statistics' unmasked path (``stream_add``'s ``full``). Else (and for powers of two) a tile row is the next power of
# two of the width, its padding masked.
MAX_CHUNKS = 8
# The statistics see a tile as [elements / V, V], summing each row of V in a thread. V = 4, the fp32 elements of a
# thread's 16-byte load: with 8 (the residual kernels' choice for a flat block) the view crossed the tile's layout,
# adding shuffles to the tile loop, and spilled with the histogram.
_V = tl.constexpr(4)
_SOFT_ROUND = tl.constexpr(INTERPRET)  # for the careful path's loader (kernels take it as an argument)


@triton.jit
def _tile(x_ptr, M, D, eps, tile, ROWS: tl.constexpr, DW: tl.constexpr):
    """Rows ``tile * ROWS ...`` of x as NC chunks of CW = DW & -DW columns (fp32, a tuple), their rows and mask, and
    1 / rms. DW: D itself, NC = D / CW chunks; or the next power of two of D, one chunk whose padding the mask leaves
    out."""
    CW: tl.constexpr = DW & -DW
    NC: tl.constexpr = DW // CW
    rows = (tile + tl.zeros([], tl.int64)) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, CW)
    if NC == 1:
        mask = (rows < M)[:, None] & (cols < D)[None, :]
    else:
        mask = tl.broadcast_to((rows < M)[:, None], [ROWS, CW])
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = (x,)
    sq = x * x
    for c in tl.static_range(1, NC):  # the chunks' squares summed in place: one reduction over the threads, not NC
        x = tl.load(x_ptr + rows[:, None] * D + (c * CW + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
        sq = tl.fma(x, x, sq)
        xs = xs + (x,)
    return xs, rows, mask, 1.0 / tl.sqrt_rn(tl.sum(sq, 1) / D + eps)


@triton.jit
def _weights(w_ptr, D, DW: tl.constexpr):
    """w as the tiles' NC chunks (fp32, a tuple)."""
    CW: tl.constexpr = DW & -DW
    NC: tl.constexpr = DW // CW
    cols = tl.arange(0, CW)
    if NC == 1:
        return (tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32),)
    ws = ()
    for c in tl.static_range(NC):
        ws = ws + (tl.load(w_ptr + c * CW + cols).to(tl.float32),)
    return ws


@triton.jit
def _y(x, w, rstd):
    """y = x * rstd * w of a chunk (fp32)."""
    return (x * rstd[:, None]) * w[None, :]


@triton.jit
def _y_part(src, tile, part: tl.constexpr, ROWS: tl.constexpr, DW: tl.constexpr):
    """The careful path's loader (``stats.device.careful_tiles``, a chunk a part): chunk ``part`` of tile ``tile`` of y
    recomputed from x (not re-read: other threads of the program stored it), as stored, in fp32, as the statistics'
    [R, V] view, with its mask."""
    x_ptr, w_ptr, y_ptr, M, D, eps = src
    xs, _, mask, rstd = _tile(x_ptr, M, D, eps, tile, ROWS, DW)
    y = _to_out(_y(xs[part], _weights(w_ptr, D, DW)[part], rstd), y_ptr.dtype.element_ty,
                _SOFT_ROUND).to(tl.float32)
    R: tl.constexpr = y.numel // _V
    return tl.reshape(y, [R, _V]), tl.reshape(mask, [R, _V])


@triton.jit
def _first_shift(src, tile, ROWS: tl.constexpr, DW: tl.constexpr):
    """(c, p, ok) of ``stats.device.shift_of`` over a program's first tile of y: the chunks' mean shift (they hold as
    many elements) and smallest scale."""
    CW: tl.constexpr = DW & -DW
    NC: tl.constexpr = DW // CW
    x_ptr, w_ptr, y_ptr, M, D, eps = src
    xs, _, mask, rstd = _tile(x_ptr, M, D, eps, tile, ROWS, DW)
    ws = _weights(w_ptr, D, DW)
    m1 = tl.reshape(mask, [mask.numel])
    c, p, ok = shift_of(tl.reshape(_to_out(_y(xs[0], ws[0], rstd), y_ptr.dtype.element_ty,
                                            _SOFT_ROUND).to(tl.float32), [m1.numel]), m1)
    for part in tl.static_range(1, NC):
        y = _to_out(_y(xs[part], ws[part], rstd), y_ptr.dtype.element_ty, _SOFT_ROUND).to(tl.float32)
        ci, pi, oki = shift_of(tl.reshape(y, [m1.numel]), m1)
        c, p, ok = c + ci, tl.minimum(p, pi), ok & oki
    return c / NC, p, ok


@triton.jit
def _store_tile(x_ptr, w_ptr, y_ptr, rstd_ptr, M, D, eps, tile, ROWS: tl.constexpr, DW: tl.constexpr,
                SOFT_ROUND: tl.constexpr):
    """Normalizes a tile into y and 1 / rms into rstd; returns its chunks of y as stored (fp32, a tuple) and their
    mask."""
    CW: tl.constexpr = DW & -DW
    NC: tl.constexpr = DW // CW
    xs, rows, mask, rstd = _tile(x_ptr, M, D, eps, tile, ROWS, DW)
    ws = _weights(w_ptr, D, DW)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    ys = ()
    cols = tl.arange(0, CW)
    for c in tl.static_range(NC):
        yq = _to_out(_y(xs[c], ws[c], rstd), y_ptr.dtype.element_ty, SOFT_ROUND)
        tl.store(y_ptr + rows[:, None] * D + (c * CW + cols)[None, :], yq, mask=mask)
        ys = ys + (yq.to(tl.float32),)
    return ys, mask


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, D, eps, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr,
                         c_mean, c_std, k, ahm_ptr, ahm_val, STATS: tl.constexpr, C_PTR: tl.constexpr,
                         AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                         SMODE: tl.constexpr, ROWS: tl.constexpr, DW: tl.constexpr, SOFT_ROUND: tl.constexpr,
                         STAGES: tl.constexpr):
    """Persistent programs over tiles of ROWS rows, each NC chunks of CW = DW & -DW columns (``_tile``). With STATS,
    y's statistics as the standalone kernel takes them (``stats.device.stream_add``, about a shift from the program's
    first tile), and its careful path (two exact fp64 passes over y recomputed, a chunk a part) where the shift was poor
    or y holds NaN/Inf."""
    CW: tl.constexpr = DW & -DW
    NC: tl.constexpr = DW // CW
    pid = tl.program_id(0)
    tiles = tl.cdiv(M, ROWS)
    if not STATS:
        for tile in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
            _store_tile(x_ptr, w_ptr, y_ptr, rstd_ptr, M, D, eps, tile, ROWS, DW, SOFT_ROUND)
    else:
        V: tl.constexpr = _V
        R: tl.constexpr = ROWS * CW // V
        src = (x_ptr, w_ptr, y_ptr, M, D, eps)
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        c, p, ok = _first_shift(src, pid, ROWS, DW)
        ncp = -(c * p)
        st = stream_zero(R)
        ht = None
        if HIST and SMEM_HIST:
            ht = htab()
        ce = tl.zeros([], tl.int32)
        for tile in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
            ys, mask = _store_tile(x_ptr, w_ptr, y_ptr, rstd_ptr, M, D, eps, tile, ROWS, DW, SOFT_ROUND)
            inside = (tl.minimum(M - (tile + tl.zeros([], tl.int64)) * ROWS, ROWS) * D).to(tl.int32)
            full = inside == ROWS * DW
            for part in tl.static_range(NC):
                st = stream_add(st, ys[part], mask, full, p, ncp, lo, hi, HIST, R, V, ht)
            ce += inside
        ce, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
            st, ce, c, p, ok, _y_part, src, tiles, NC, lo, hi, HIST, R, ROWS, DW, ht)
        fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, ce, nfin, nonfin, zeros,
                       outl, under, over, amax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST, SMODE)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_ptr, M, D, HAS_DW: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Persistent programs over tiles of ROWS rows: dx, and the program's partial of dw into row ``pid`` of dw."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], tl.float32)
    for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = (tile + tl.zeros([], tl.int64)) * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        n = x * rstd[:, None]
        dn = g * w[None, :]
        dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        tl.store(dx_ptr + offs, _to_out(dx, dx_ptr.dtype.element_ty, SOFT_ROUND), mask=mask)
        if HAS_DW:
            dw += tl.sum(g * n, 0)
    if HAS_DW:
        tl.store(dw_ptr + pid * D + cols, dw, mask=cols < D)


def _shape(d: int, tile: int = TILE) -> tuple[int, int]:
    """(ROWS, BLOCK_D) of a tile of about ``tile`` elements of rows ``d`` wide."""
    block_d = next_power_of_2(d)
    return max(1, tile // block_d), block_d


def _stats_shape(d: int, element_size: int, warps: int) -> tuple[int, int]:
    """(ROWS, DW) of the forward with a row (``_tile``): D itself where it cuts into at most MAX_CHUNKS chunks,
    with rows enough that a chunk gives each thread a 16-byte load of x (the statistics' view takes whole loads: a view
    across threads converts the layout through shared memory); else ``_shape``'s."""
    rows, block_d = _shape(d, STATS_TILE)
    cw = d & -d
    if d == cw or d // cw > MAX_CHUNKS:
        return rows, block_d
    return max(rows, 16 // element_size * 32 * warps // cw), d


def _stages(stats: ts.Target | None, tile_bytes: int) -> int:
    """The forward's pipelining depth: none without a row, else ``STATS_STAGES``, at most two above STAGE3_BYTES."""
    if stats is None:
        return 1
    return STATS_STAGES if tile_bytes <= STAGE3_BYTES else min(STATS_STAGES, 2)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels take x (contiguous, float, rows of at most MAX_WIDTH) and weight (its row's width)."""
    return (x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() > 0
            and x.shape[-1] <= MAX_WIDTH and weight.shape == (x.shape[-1],))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     stats: ts.Target | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, 1 / rms of each row, fp32); with ``stats`` y's row into the target (merged later: ``launch.merge_later``)."""
    d = x.shape[-1]
    m = x.numel() // d
    y = torch.empty_like(x)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if stats is None:
        (rows, dw), warps, per_sm = _shape(d), WARPS, PROGRAMS_PER_SM
    else:
        warps = STATS_WARPS if next_power_of_2(d) <= STATS_TILE else WARPS
        per_sm = max(1, STATS_PROGRAMS_PER_SM * STATS_WARPS // warps)  # the same registers per SM
        rows, dw = _stats_shape(d, x.element_size(), warps)
    programs = persistent_programs(cdiv(m, rows), per_sm, x.device)
    _rms_norm_fwd_kernel[(programs,)](x, weight, y, rstd, m, d, float(eps),
                                      **ts.epilogue_args(stats, programs, y, later=True), ROWS=rows, DW=dw,
                                      SOFT_ROUND=INTERPRET, STAGES=_stages(stats, rows * dw * x.element_size()),
                                      num_warps=warps,
                                      **reg_cap(STATS_MAXNREG if stats is not None else None))
    return y, rstd


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dw in weight's dtype or None without ``weight_grad``) of y's gradient g."""
    d = x.shape[-1]
    m = x.numel() // d
    gc = g.contiguous()
    dx = torch.empty_like(x)
    rows, block_d = _shape(d)
    programs = persistent_programs(cdiv(m, rows), PROGRAMS_PER_SM, x.device)
    dw = torch.empty(programs, d, dtype=torch.float32, device=x.device) if weight_grad else rstd
    _rms_norm_bwd_kernel[(programs,)](x, weight, gc, rstd, dx, dw, m, d, HAS_DW=weight_grad, ROWS=rows,
                                      BLOCK_D=block_d, SOFT_ROUND=INTERPRET, num_warps=WARPS)
    return dx, dw.sum(0).to(weight.dtype) if weight_grad else None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, stats):
        y, rstd = rms_norm_forward(x, weight, eps, stats)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(g, x, weight, rstd, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None, None


@torch.compiler.disable  # as Fp8Linear's: torch.compile cannot trace the launchers' host work (the row's tables)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, stats: ts.Target | None = None) -> torch.Tensor:
    """RMSNorm of x's rows (``supports``), differentiable in x and weight; with ``stats`` y's statistics row (see the
    module docstring)."""
    if not supports(x, weight):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()}) and weight "
                         f"{tuple(weight.shape)}: needs contiguous float rows, at least one, of 1..{MAX_WIDTH}, and "
                         f"a weight as wide")
    return _RMSNormFn.apply(x, weight, eps, stats)
