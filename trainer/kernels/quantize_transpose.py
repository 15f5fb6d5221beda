"""Quantize a 2-D tensor to FP8 and write it *and* its transpose in one pass over the input.

The backward GEMMs need K-major operands that the forward layout does not give: wgrad dW = Gᵀ X needs
Gᵀ (N, M) and Xᵀ (K, M) contiguous, dgrad dX = G W needs Wᵀ (K, N) contiguous. Each (BM, BN) tile of x
is read once, scaled, clamped and cast, then stored row-major into ``q`` and, transposed, into ``q_t``
(``TRANS_MODE``: bf16 tiles are transposed in registers, which Triton stages through shared memory;
fp32 tiles are re-read transposed, from L1/L2, because Triton's register transpose of them came out
wrong on Hopper). Scaling is as in ``quantize.py`` (current: amax
partials pass first; delayed: scale from history, amax accumulated atomically, then
``delayed_update``). Reference beside it: ``quantize_transpose_ref``.

``stats=`` (an ``agent.stats.launch.Target``): x's SPEC section-4 row, with the scale it is cast with, into the
target; reference ``quantize.stats_ref``. Under delayed scaling a persistent variant of the cast (grid-stride over
the tiles) accumulates them from the tiles it has loaded (see ``quantize.py``). Under current scaling the standalone
statistics kernel takes the place of the amax pass, which reads x once anyway (``stats.launch.cast_row``): its
merged amax is the cast's, and the plain cast adds the one statistic that needs the scale first, the underflow
count (``COUNT``); that costs less than the cast's statistics variant after an amax pass. The row is then complete
after ``stats.launch.flush_deferred`` (the agent calls it before it takes a step's rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8mon.agent.formats import Fp8Format, by_name
from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.device import (
    SMEM_HIST,
    Const,
    careful_result,
    fast_result,
    fused_epilogue,
    fused_prologue,
    htab,
    packed_fold,
    packed_setup,
    shift_of,
    tile_bf16x2,
    tile_careful,
    tile_fast,
    tile_sum,
)

from .quantize import (
    Quantized,
    _cast_fp8,
    _consts,
    _current_scale_from_partials,
    _finite_abs,
    _scale_from_amax,
    amax_partials,
    cdiv,
    next_power_of_2,
    quantize_ref,
    reg_cap,
    stats_consts,
    stats_programs,
)

# How the transposed tile is produced, per input dtype (see the kernel): 0 = tl.trans of the fp8 tile, 2 = re-read the
# tile transposed (no tl.trans). Triton's register transpose wrote a wrong qT for fp32 inputs whose row count is a
# multiple of 16 on Hopper, while the re-read was bit-exact; for bf16 inputs the transpose was bit-exact. Each dtype
# uses the mode verified for it.
TRANS_MODE = {torch.float32: 2}
TRANS_MODE_DEFAULT = 0
# Register cap of the statistics variant (uncapped, ptxas gives it enough registers for only one 8-warp program per
# SM, as for the standalone statistics kernel, whose cold code inflates the count).
STATS_MAXNREG: int | None = 128
# Software-pipeline depth of the statistics variant's persistent tile loop (``tl.range(num_stages=...)``): with
# STAGES > 1 Triton prefetches the next tiles into shared memory while the current one is reduced. Since the cast lost
# its clamps and the statistics their masks on interior tiles, depth 1 is the fastest, with and without the histogram.
STATS_STAGES = 1
# Elements of x per row of the statistics' [BM * BN / V, V] view of a tile: 16 is what a thread holds contiguously
# in the layout Triton picks for the tile (no layout conversion for the view, bf16 or fp32), and it halves the per-row
# accumulators of V = 8, which spilled more at the register cap.
_STATS_V = 16
# the row layout (stats.layout), for the counts the cast adds
ROW_WIDTH = Const(ds.WIDTH)
ROW_UNDER = Const(ds.UNDERFLOW)


@triton.jit(do_not_specialize=["dst_index"])
def _quantize_transpose_kernel(x_ptr, q_ptr, qt_ptr, part_ptr, n_part, scale_ptr, accum_ptr, meta_ptr,
                               M, N, stride_xm, dst_ptr, dst_index,
                               FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                               OUT_DTYPE: tl.constexpr, CURRENT: tl.constexpr,
                               WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                               SOFT_ROUND: tl.constexpr, P_BLOCK: tl.constexpr, TRANS_MODE: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, COUNT: tl.constexpr = False,
                               UTHR: tl.constexpr = 0.0, EPOCH: tl.constexpr = False):
    """One (BM, BN) tile per program. ``COUNT`` (current scaling, the cast that follows ``stats.launch.cast_row``):
    also count the tile's nonzero elements that cast to zero (fl32(|x| s) <= UTHR, as stats.torch_path.partials counts
    them) and add them to the row ``dst_ptr[dst_index]``'s underflow. Its overflow stays 0, exactly: with s = max /
    amax no |x| <= amax casts past the overflow threshold, and where s falls back to 1, amax is 0 or below 1e-36.
    ``EPOCH``: the amax is in ``stats.launch.cast_row``'s epoch words at ``part_ptr`` (int64: the epoch in the high
    half, the amax's bits in the low one); program (0, 0) records the epoch it read, so the next statistics launch
    outbids it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if EPOCH:
        word = tl.load(part_ptr)
        amax = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        s = _scale_from_amax(amax, FMAX)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(part_ptr + 1, word >> 32)
    elif CURRENT:
        amax, s = _current_scale_from_partials(part_ptr, n_part, FMAX, P_BLOCK)
    else:
        s = tl.load(scale_ptr)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    y = x * s
    if WRITE_Q:
        q = _cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
    if WRITE_QT:
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        if TRANS_MODE == 0:  # transpose the fp8 tile (wrong for fp32 inputs on Hopper, fine for bf16)
            q_t = tl.trans(_cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND))
        else:  # re-read the tile transposed (from L1/L2), no register transpose at all
            x_t = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + cols[:, None], mask=mask_t, other=0.0)
            q_t = _cast_fp8(x_t.to(tl.float32) * s, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], q_t, mask=mask_t)
    if not CURRENT:
        tl.atomic_max(accum_ptr, tl.max(tl.max(_finite_abs(x), 1), 0))
    if COUNT:  # masked-out elements are 0: not counted
        under = tl.sum(tl.sum(((tl.abs(y) <= UTHR) & (x != 0)).to(tl.int32), 1), 0)
        if under > 0:
            tl.atomic_add(dst_ptr + dst_index.to(tl.int64) * ROW_WIDTH + ROW_UNDER, under.to(tl.float64),
                          sem="relaxed")
    if (pid_m == 0) & (pid_n == 0):
        if CURRENT:
            tl.store(meta_ptr, amax)
        tl.store(meta_ptr + 1, s)
        tl.store(meta_ptr + 2, tl.math.div_rn(1.0, s))


@triton.jit
def _load_raw(x_ptr, t, n_tn, M, N, stride_xm, BM: tl.constexpr, BN: tl.constexpr):
    """Tile t of x (tiles of a row of tiles are consecutive), in x's dtype, with its mask, rows and columns."""
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cols = (t % n_tn) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    return x, mask, rows, cols


@triton.jit
def _load_tile(x_ptr, t, n_tn, M, N, stride_xm, BM: tl.constexpr, BN: tl.constexpr):
    x, mask, rows, cols = _load_raw(x_ptr, t, n_tn, M, N, stride_xm, BM, BN)
    return x.to(tl.float32), mask, rows, cols


@triton.jit
def _bf16_words(xr, R: tl.constexpr, V: tl.constexpr):
    """A [BM, BN] bf16 tile as two [R, 4] tiles of 32-bit words (the standalone kernel's layout: element 2k in the
    low half, 2k + 1 in the high half), R = BM * BN / V: each row of the statistics' [R, V] view of the tile, in
    even and odd words (the order does not matter to sums and counts)."""
    tl.static_assert(V == 16, "the word loop takes rows of 4 words: V = 16")
    b = tl.reshape(xr.to(tl.int16, bitcast=True), [R, V // 2, 2])
    lo, hi = tl.split(b)
    w = (hi.to(tl.int32) << 16) | (lo.to(tl.int32) & 0xFFFF)
    return tl.split(tl.reshape(w, [R, V // 4, 2]))


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _quantize_transpose_stats_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, accum_ptr, meta_ptr, M, N, stride_xm,
                                     sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, c_ptr, c_mean, c_std, k,
                                     ahm_ptr, ahm_val,
                                     FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                                     OUT_DTYPE: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                                     SOFT_ROUND: tl.constexpr, TRANS_MODE: tl.constexpr, UTHR: tl.constexpr,
                                     OTHR: tl.constexpr, C_PTR: tl.constexpr,
                                     AHM_PTR: tl.constexpr, HIST: tl.constexpr, V: tl.constexpr,
                                     BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr = 1,
                                     PACKED: tl.constexpr = False):
    """``_quantize_transpose_kernel`` under delayed scaling, persistent, with the statistics of x from the loaded
    tiles (current scaling takes its row from ``stats.launch.cast_row`` in place of its amax pass).

    The statistics see each tile as [BM * BN / V, V], V the elements one thread holds contiguously, so that the
    per-tile sums along the last axis are a thread's own adds: no cross-thread reduction in the loop (reducing
    the [BM, BN] tile along its rows cost shuffles for every statistic).

    ``PACKED`` (bf16 x; with the histogram, only where the table counts it): full tiles take the standalone kernel's
    word loop (``tile_bf16x2``: two elements per 32-bit word, counts and amax without unpacking them); the overflow
    count is then checked lazily, as there: an amax past the overflow threshold sends the program to the careful
    path."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s = tl.load(scale_ptr)
    tu, to, lo, hi = fused_prologue(s, c_ptr, c_mean, c_std, k, UTHR, OTHR, C_PTR)
    n_tn = tl.cdiv(N, BN)
    ntiles = tl.cdiv(M, BM) * n_tn
    x0, m0, _, _ = _load_tile(x_ptr, pid, n_tn, M, N, stride_xm, BM, BN)
    c, p, ok = shift_of(tl.reshape(x0, [BM * BN], can_reorder=True), tl.reshape(m0, [BM * BN], can_reorder=True))
    ncp = -(c * p)
    R: tl.constexpr = BM * BN // V
    zf = tl.zeros([R], tl.float32)
    zi = tl.zeros([R], tl.int32)
    s1, s2, s3, s4, am, cu, co, cout, cz, h = zf, zf, zf, zf, zf, zi, zi, zi, zi, tl.zeros([64], tl.int32)
    ce = tl.zeros([], tl.int32)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    if PACKED:
        ku, lo2, hi2, amw, pu, pnz, pout = packed_setup(tu, lo, hi, R)
        cw = tl.zeros([], tl.int32)  # full tiles the word loop took
    for t in tl.range(pid, ntiles, nprog, num_stages=STAGES):
        xr, mask, rows, cols = _load_raw(x_ptr, t, n_tn, M, N, stride_xm, BM, BN)
        x = xr.to(tl.float32)
        y = x * s
        if WRITE_Q:
            q = _cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
            tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
        if WRITE_QT:
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            if TRANS_MODE == 0:
                q_t = tl.trans(_cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND))
            else:
                x_t = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + cols[:, None], mask=mask_t, other=0.0)
                q_t = _cast_fp8(x_t.to(tl.float32) * s, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], q_t, mask=mask_t)
        xv = tl.reshape(x, [R, V])
        mv = tl.reshape(mask, [R, V])
        tm = tl.minimum(M - (t // n_tn) * BM, BM)
        tn = tl.minimum(N - (t % n_tn) * BN, BN)
        if (tm == BM) & (tn == BN):  # interior tiles (nearly all) pay for no masks
            if PACKED:
                we, wo = _bf16_words(xr, R, V)
                s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(we, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu,
                                                                  pnz, pout, ht)
                s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(wo, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu,
                                                                  pnz, pout, ht)
                cw += 1
            else:
                s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(
                    xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, False, True, ht)
        else:
            s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(
                xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, True, True, ht)
        ce += tm * tn  # elements in the tile
    if pid == 0:
        tl.store(meta_ptr + 1, s)
        tl.store(meta_ptr + 2, tl.math.div_rn(1.0, s))
    nelem = ce
    if PACKED:
        am, cu, cz, cout = packed_fold(cw * V, amw, pu, pnz, pout, am, cu, cz, cout)
    ok2, mean, m2, m3, m4, samax, zeros, under, over, outl, hist = fast_result(
        nelem, c, p, tu, to, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, ht)
    if PACKED:  # the word loop counted no overflow: any element past the threshold takes the careful path
        ok2 = ok2 & ((to < 0) | (samax.to(tl.int32, bitcast=True) <= to))
    nfin = nelem
    nonfin = tl.zeros([], tl.int32)
    if not (ok & ok2):  # NaN/Inf or a poor shift: re-read this program's tiles, carefully
        acc = tl.zeros([R], tl.float64)
        cnt = zi
        for t in range(pid, ntiles, nprog):
            x, mask, rows, cols = _load_tile(x_ptr, t, n_tn, M, N, stride_xm, BM, BN)
            acc, cnt = tile_sum(tl.reshape(x, [R, V]), tl.reshape(mask, [R, V]), acc, cnt, True)
        nfin = tl.sum(cnt, 0)
        mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
        zd = tl.zeros([R], tl.float64)
        t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, zf, zi, zi, zi, zi, zi, \
            tl.zeros([64], tl.int32)
        for t in range(pid, ntiles, nprog):
            x, mask, rows, cols = _load_tile(x_ptr, t, n_tn, M, N, stride_xm, BM, BN)
            t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = tile_careful(
                tl.reshape(x, [R, V]), tl.reshape(mask, [R, V]), mean0, tu, to, lo, hi, t1, t2, t3, t4, am, cu, co,
                cout, cz, cnf, h, HIST, True)
        mean, m2, m3, m4, samax, zeros, under, over, outl, nonfin = careful_result(
            nfin, mean0, t1, t2, t3, t4, am, cu, co, cout, cz, cnf)
        hist = h
    tl.atomic_max(accum_ptr, samax)  # the finite amax, from either path (no per-element max of its own in the loop)
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, s, nelem, nfin, nonfin, zeros,
                   outl, under, over, samax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST)


def _packed(x: torch.Tensor, stats: ts.Target) -> bool:
    """Whether the statistics variant takes x's full tiles with the bf16 word loop (``PACKED``)."""
    return x.dtype == torch.bfloat16 and (not stats.hist or ts.SMEM_HIST) and _STATS_V == 16


def quantize_transpose(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None,
                       accum: torch.Tensor | None = None, write_q: bool = True, write_qt: bool = True,
                       bm: int = 64, bn: int = 128, num_warps: int = 8, trans_mode: int | None = None,
                       stats: ts.Target | None = None, amax_ready: torch.Tensor | None = None) -> Quantized:
    """Quantize 2-D x (M, N) to ``fmt``: ``data`` (M, N) and ``data_t`` (N, M), both contiguous.

    ``scale``/``accum`` as in ``quantize.quantize`` (None: current scaling). ``write_q``/``write_qt``
    drop an output that is not needed (then that field is None). ``trans_mode`` overrides ``TRANS_MODE``.
    ``stats``: also write x's statistics row (with the scale used) into the target, from the same read.
    ``amax_ready`` (current scaling with ``stats``): a float32 tensor of 3 whose first
    element already holds x's amax, written with the row by an earlier ``stats.launch.cast_rows`` launch; the cast
    reads it, adds its underflow count to the row and returns it as its ``meta``."""
    assert x.dim() == 2, "quantize_transpose takes a 2-D tensor"
    fmt = by_name(fmt)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape
    dev = x.device
    q = torch.empty((M, N), dtype=fmt.dtype, device=dev) if write_q else None
    qt = torch.empty((N, M), dtype=fmt.dtype, device=dev) if write_qt else None
    meta = torch.empty(3, dtype=torch.float32, device=dev)
    grid = (max(1, cdiv(M, bm)), max(1, cdiv(N, bn)))
    common = dict(WRITE_Q=write_q, WRITE_QT=write_qt, BM=bm, BN=bn, num_warps=num_warps,
                  TRANS_MODE=TRANS_MODE.get(x.dtype, TRANS_MODE_DEFAULT) if trans_mode is None else trans_mode,
                  **_consts(fmt))
    q_arg = q if write_q else meta
    qt_arg = qt if write_qt else meta
    if amax_ready is not None and (stats is None or scale is not None):
        raise ValueError("amax_ready needs current scaling and a statistics target")
    if stats is not None and scale is None:
        amax_in = meta
        if amax_ready is None:
            # x's amax into the epoch words; the row is merged later
            amax_in = ts.cast_row(x, fmt, stats)
        else:
            meta = amax_in = amax_ready
        # (program (0, 0) stores meta[0] = amax, maybe again while the others read it: the same bits)
        _quantize_transpose_kernel[grid](x, q_arg, qt_arg, amax_in, 1, meta, meta, meta, M, N, x.stride(0),
                                         stats.rows, int(stats.index), CURRENT=True, P_BLOCK=1, COUNT=True,
                                         UTHR=float(fmt.underflow_threshold), EPOCH=amax_in.dtype == torch.int64,
                                         **common)
        return Quantized(q, qt, meta)
    if stats is not None:  # delayed scaling
        programs = stats_programs(grid[0] * grid[1], dev)
        assert accum is not None, "delayed scaling needs an amax accumulator"
        _quantize_transpose_stats_kernel[(programs,)](x, q_arg, qt_arg, scale, accum, meta, M, N, x.stride(0),
                                                      **ts.fused_args(stats, programs, dev), V=_STATS_V,
                                                      STAGES=STATS_STAGES, PACKED=_packed(x, stats),
                                                      **common, **stats_consts(fmt), **reg_cap(STATS_MAXNREG))
        return Quantized(q, qt, meta)
    if scale is None:
        part = amax_partials(x if x.is_contiguous() else x.contiguous())
        _quantize_transpose_kernel[grid](x, q_arg, qt_arg, part, part.numel(), meta, meta, meta, M, N,
                                         x.stride(0), meta, 0, CURRENT=True,
                                         P_BLOCK=next_power_of_2(part.numel()), **common)
    else:
        assert accum is not None, "delayed scaling needs an amax accumulator"
        _quantize_transpose_kernel[grid](x, q_arg, qt_arg, meta, 0, scale, accum, meta, M, N, x.stride(0),
                                         meta, 0, CURRENT=False, P_BLOCK=1, **common)
    return Quantized(q, qt, meta)


def quantize_transpose_ref(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None) -> Quantized:
    """Torch reference: the same values, ``data_t`` materialised contiguous."""
    r = quantize_ref(x, fmt, scale)
    return Quantized(r.data, r.data.t().contiguous(), r.meta)
