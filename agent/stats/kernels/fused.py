"""Device helpers of the fused kernels (trainer/kernels): statistics of the tiles a kernel already holds, a
program's partial and the epilogue that writes it. The documented entry points are re-exported by
``fp8mon.agent.stats.device``."""

import triton
import triton.language as tl

from .consts import _BIN_DUMP, _PW, _WIDTH, P_AHM, SCALE_GIVEN_C
from .merge import _done, _store_partial
from .tile import (
    _bins,
    _central,
    _inv_binade,
    _thresholds,
    careful_result,
    fast_result,
    outlier_bounds,
    shift_of,
    tile_careful,
    tile_fast,
    tile_sum,
)
from .words import packed_fold, packed_setup, tile_bf16x2


@triton.jit
def fused_bounds(c_ptr, c_mean, c_std, k, C_PTR: tl.constexpr):
    """(lo, hi): the outlier bounds of a fused kernel's center."""
    cm = c_mean + tl.zeros([], tl.float64)
    cs = c_std + tl.zeros([], tl.float64)
    if C_PTR:
        cm = tl.load(c_ptr)
        cs = tl.load(c_ptr + 1)
    return outlier_bounds(cm, cs, k + tl.zeros([], tl.float64))


@triton.jit
def fused_prologue(s, c_ptr, c_mean, c_std, k, UTHR: tl.constexpr, OTHR: tl.constexpr, C_PTR: tl.constexpr):
    """(tu, to, lo, hi) of a fused kernel: threshold bits of its scale, outlier bounds of its center."""
    lo, hi = fused_bounds(c_ptr, c_mean, c_std, k, C_PTR)
    tu, to = _thresholds(s, SCALE_GIVEN_C, UTHR, OTHR)
    return tu, to, lo, hi


@triton.jit
def fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, s, nelem, nfin, nonfin, zeros,
                   outl, under, over, amax, mean, m2, m3, m4, hist, FMAX: tl.constexpr, UTHR: tl.constexpr,
                   AHM_PTR: tl.constexpr, HIST: tl.constexpr, SMODE: tl.constexpr = 1):
    """Store this program's partial; the last program merges all into the target row. ``SMODE``: the
    scale ``s`` given (1), none (0: scale, underflow and overflow NaN) or current scaling (2: s from the
    merged amax, see the module docstring). ``merge``: bit 0, merge into the row rather than overwrite it; bit
    1, leave the merge to ``merge_later`` (``epilogue_args``' ``later``): the programs store their partials
    (and histograms beside them) and stop, with no counter and no last program."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    nprog = tl.num_programs(0) * tl.num_programs(1)
    _store_partial(sp_ptr + pid, nprog, nelem, nfin, nonfin, zeros, outl, under, over, amax, mean,
                   m2, m3, m4)
    ahm = ahm_val + tl.zeros([], tl.float64)  # (float arguments may arrive as Python floats)
    if AHM_PTR:
        ahm = tl.load(ahm_ptr).to(tl.float64)
    if merge >= 2:
        if HIST:
            tl.store(sp_ptr + pid + (_PW + tl.arange(0, 64)) * nprog, hist.to(tl.float64))
        if pid == 0:
            tl.store(sp_ptr + P_AHM * nprog, ahm)
    else:
        _done(sp_ptr, nprog, ctr_ptr, nprog, dst_ptr + dst_index * _WIDTH, merge, SMODE, s, FMAX, UTHR, ahm,
              hist, HIST)


# ---- statistics of the tiles a consumer kernel streams through (trainer/kernels/swiglu.py, residual.py, rope.py,
# rmsnorm.py)
# As the standalone kernel takes them: a thread sums its own rows of V elements (``tile_fast``) about a shift from
# the program's first tile; no scale is known before the read (the epilogue derives underflow and overflow).


@triton.jit
def stream_start(x0, m0, R: tl.constexpr):
    """A persistent program's statistics set-up from its first tile ``x0`` (fp32, mask ``m0``, any shape): the shift
    c, scale p and whether they hold (``shift_of``), -c*p and empty ``stream_add`` accumulators of R rows. (The
    histogram's shared-memory table stays the caller's: Triton 3.6 cannot return None in a tuple.)"""
    c, p, ok = shift_of(tl.reshape(x0, [x0.numel]), tl.reshape(m0, [m0.numel]))
    return c, p, ok, -(c * p), stream_zero(R)


@triton.jit
def stream_zero(R: tl.constexpr):
    """Empty ``tile_fast`` accumulators of R rows: s1-s4, amax, cu, co, outliers, cz, histogram."""
    zf = tl.zeros([R], tl.float32)
    zi = tl.zeros([R], tl.int32)
    return zf, zf, zf, zf, zf, zi, zi, zi, zi, tl.zeros([64], tl.int32)


@triton.jit
def stream_add(acc, x, mask, full, p, ncp, lo, hi, HIST: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
               ht=None):
    """``acc`` with the fp32 tile x (any shape of R * V elements) added, seen as [R, V]; ``full``: every lane is
    inside (then no masks are paid for)."""
    s1, s2, s3, s4, am, cu, co, cout, cz, h = acc
    tu = tl.full([], -1, tl.int32)
    to = tl.full([], 0x7FFFFFFF, tl.int32)
    xv = tl.reshape(x, [R, V])
    mv = tl.reshape(mask, [R, V])
    if full:
        s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu,
                                                             co, cout, cz, h, HIST, False, True, ht)
    else:
        s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu,
                                                             co, cout, cz, h, HIST, True, True, ht)
    return s1, s2, s3, s4, am, cu, co, cout, cz, h


# ---- the same through bf16 words (trainer/kernels/swiglu.py) -------------------------------------------------
# A consumer kernel that holds its bf16 tensor as 32-bit words (it loads or packs them anyway) takes the row a word
# at a time on its full tiles (``tile_bf16x2``: the counts and the amax of both halves at once) and through
# ``stream_add``'s fp32 path on the partial ones.


@triton.jit
def bf16_halves(w):
    """The two bf16 of each 32-bit word, as fp32: the low half (the element at the lower address), then the high."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def words_zero(lo, hi, R: tl.constexpr):
    """Empty ``words_add`` accumulators of R rows: ``stream_zero``'s, the word loop's (``packed_setup`` with no
    underflow threshold) and the elements a row took a word at a time."""
    return stream_zero(R), packed_setup(tl.full([], -1, tl.int32), lo, hi, R), tl.zeros([], tl.int32)


@triton.jit
def words_add(wacc, wa, wb, full, mask, p, ncp, lo, hi, HIST: tl.constexpr, R: tl.constexpr, ht=None):
    """``wacc`` (``words_zero``) with two tiles of words ``wa`` and ``wb`` added (R x 4 words each, any shape;
    ``mask`` theirs; ``wb`` None: ``wa`` alone): where ``full`` a word at a time (no underflow count: the row has
    no scale), else their fp32 halves through ``stream_add``."""
    acc, packed, nw = wacc
    s1, s2, s3, s4, am, cu, co, cout, cz, hist = acc
    ku, lo2, hi2, amw, pu, pnz, pout = packed
    if full:
        s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(tl.reshape(wa, [R, 4]), p, ncp, ku, lo2, hi2, s1, s2, s3,
                                                          s4, amw, pu, pnz, pout, ht, UCOUNT=False)
        nw += 8  # 4 words of 2 elements a row
        if wb is not None:
            s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(tl.reshape(wb, [R, 4]), p, ncp, ku, lo2, hi2, s1, s2,
                                                              s3, s4, amw, pu, pnz, pout, ht, UCOUNT=False)
            nw += 8
    else:
        a_lo, a_hi = bf16_halves(wa)
        acc = s1, s2, s3, s4, am, cu, co, cout, cz, hist
        acc = stream_add(acc, a_lo, mask, False, p, ncp, lo, hi, HIST, R, 4, ht)
        acc = stream_add(acc, a_hi, mask, False, p, ncp, lo, hi, HIST, R, 4, ht)
        if wb is not None:
            b_lo, b_hi = bf16_halves(wb)
            acc = stream_add(acc, b_lo, mask, False, p, ncp, lo, hi, HIST, R, 4, ht)
            acc = stream_add(acc, b_hi, mask, False, p, ncp, lo, hi, HIST, R, 4, ht)
        s1, s2, s3, s4, am, cu, co, cout, cz, hist = acc
    return (s1, s2, s3, s4, am, cu, co, cout, cz, hist), (ku, lo2, hi2, amw, pu, pnz, pout), nw


@triton.jit
def words_fold(wacc):
    """``words_add``'s accumulators as ``stream_add``'s (for ``stream_partial``): the word loop's counts and amax
    folded in."""
    acc, packed, nw = wacc
    s1, s2, s3, s4, am, cu, co, cout, cz, hist = acc
    ku, lo2, hi2, amw, pu, pnz, pout = packed
    am, cu, cz, cout = packed_fold(nw, amw, pu, pnz, pout, am, cu, cz, cout)
    return s1, s2, s3, s4, am, cu, co, cout, cz, hist


@triton.jit
def careful_tiles(LOAD: tl.constexpr, src, tiles, PARTS: tl.constexpr, lo, hi, HIST: tl.constexpr,
                  R: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    """The standalone kernel's careful path over a persistent program's tiles (t = pid, pid + programs, ... <
    tiles): two exact fp64 passes over the fp32 [R, V] views and masks that ``LOAD(src, t, part, C1, C2)``
    returns, part < PARTS (the tensors, or pieces, a tile reads apart; ``src`` a tuple of its runtime arguments,
    C1 and C2 its constexprs, which a tuple does not carry). No scale: nothing under- or overflows. Returns the
    partial (nfin, mean, M2-M4, amax, zeros, under, over, outliers, nonfinite, hist)."""
    tu = tl.full([], -1, tl.int32)
    to = tl.full([], 0x7FFFFFFF, tl.int32)
    acc = tl.zeros([R], tl.float64)
    cnt = tl.zeros([R], tl.int32)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        for part in tl.static_range(PARTS):
            x, m = LOAD(src, t, part, C1, C2)
            acc, cnt = tile_sum(x, m, acc, cnt, True)
    nfin = tl.sum(cnt, 0)
    mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
    zd = tl.zeros([R], tl.float64)
    zi = tl.zeros([R], tl.int32)
    t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, tl.zeros([R], tl.float32), zi, zi, zi, zi, zi, \
        tl.zeros([64], tl.int32)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        for part in tl.static_range(PARTS):
            x, m = LOAD(src, t, part, C1, C2)
            t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = tile_careful(
                x, m, mean0, tu, to, lo, hi, t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h, HIST, True)
    mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin = careful_result(
        nfin, mean0, t1, t2, t3, t4, am, cu, co, cout, cz, cnf)
    return nfin, mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin, h


@triton.jit
def stream_partial(acc, n, c, p, ok, LOAD: tl.constexpr, src, tiles, PARTS: tl.constexpr, lo, hi,
                   HIST: tl.constexpr, R: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, ht=None):
    """A persistent program's partial of its ``stream_add`` accumulators ``acc`` (``n`` elements about the shift
    ``c``, scaled by ``p``; ``ok``: the shift was taken from finite values), or ``careful_tiles``'s (same
    arguments) where that does not hold (NaN/Inf, fp32 overflow of the power sums, a poor shift). Returns
    (nelem, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist), ``fused_epilogue``'s order."""
    s1, s2, s3, s4, am, cu, co, cout, cz, h = acc
    tu = tl.full([], -1, tl.int32)
    to = tl.full([], 0x7FFFFFFF, tl.int32)
    ok2, mean, m2, m3, m4, amax, zeros, under, over, outl, hist = fast_result(
        n, c, p, tu, to, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, ht)
    nfin = n
    nonfin = tl.zeros([], tl.int32)
    if not (ok & ok2):
        nfin, mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin, hist = careful_tiles(
            LOAD, src, tiles, PARTS, lo, hi, HIST, R, C1, C2)
    return n, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist


# ---- fused statistics of register tiles (the GEMM epilogues, trainer/kernels/fp8_gemm.py) ----------
# A partial is the tuple (nelem, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist).
# A program accumulates its tiles row by row: the state is one bucket per tile row (row r of every tile the
# program sees) with (count, shift c_r, fp64 power sums of x - c_r, amax, counts), plus one histogram. Per tile
# the row sums are a thread's adds and a shuffle within the row's lanes, and one flag (is the tile full and
# finite) crosses the CTA; ``rows_partial`` reduces over the rows once per program. Each row of a tile is taken
# in two passes over the registers (its mean, then sums of (x - mean)^k, where nothing cancels), then shifted
# into its bucket's fp64 sums. (A partial per tile, every statistic reduced across the CTA and merged Chan/Pebay
# per tile, spills registers badly on large tiles and slows the GEMM several times over.)


@triton.jit
def rows_zero(BM: tl.constexpr):
    """The empty row state of ``BM`` buckets: (n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin, hist)."""
    zi = tl.zeros([BM], tl.int32)
    zd = tl.zeros([BM], tl.float64)
    return zi, zd, zd, zd, zd, zd, tl.zeros([BM], tl.float32), zi, zi, zi, tl.zeros([64], tl.int32)


@triton.jit
def _pow2_f64(e):
    """2**e as fp64, from its bits (|e| <= 1022)."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _rows_shift(acc, nr, mr, r1, q2, q3, q4, am, zr, orr, nfr):
    """``acc`` with a tile's rows added: their counts ``nr``, means ``mr`` and fp64 sums of (x - mr)^k."""
    n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin, hist = acc
    c = tl.where(n == 0, mr, c)  # a bucket's shift: the mean of its first non-empty row
    e = mr - c  # x - c = (x - mr) + e, in fp64
    k = nr.to(tl.float64)
    e2 = e * e
    A4 += q4 + 4.0 * e * q3 + 6.0 * e2 * q2 + 4.0 * e2 * e * r1 + k * e2 * e2
    A3 += q3 + 3.0 * e * q2 + 3.0 * e2 * r1 + k * e2 * e
    A2 += q2 + 2.0 * e * r1 + k * e2
    A1 += r1 + k * e
    return n + nr, c, A1, A2, A3, A4, tl.maximum(amax, am), zeros + zr, outl + orr, nonfin + nfr, hist


@triton.jit
def rows_add(acc, x, mask, full, lo, hi, HIST: tl.constexpr):
    """The row state ``acc`` with the [BM, BW] fp32 register tile ``x`` added (lanes outside ``mask`` excluded;
    ``full``: a scalar, True when every lane is inside). Fast path (a full tile whose row sums are finite):
    no masks. Else (edges, NaN / Inf, sums past fp32): masked. Either way the row's values are scaled by a
    power of two from its (finite) amax before the deviations' sums (``_inv_binade``)."""
    a = tl.abs(x)
    rs = tl.sum(x, 1)
    ra = tl.max(a, 1)
    if full & (tl.max(tl.where(tl.abs(rs) < float("inf"), 0, 1), 0) == 0):
        p, e = _inv_binade(ra)
        nr = tl.zeros_like(e) + x.shape[1]
        ms = (rs / x.shape[1]) * p  # the row mean, scaled (exactly) as the deviations are
        d = x * p[:, None] - ms[:, None]
        am = ra
        zr = tl.sum((x == 0.0).to(tl.int32), 1)
        orr = tl.sum(((x > hi) | (x < lo)).to(tl.int32), 1)
        nfr = tl.zeros_like(zr)
    else:
        fin = mask & (a < float("inf"))
        am = tl.max(tl.where(fin, a, 0.0), 1)
        p, e = _inv_binade(am)
        xs = tl.where(fin, x * p[:, None], 0.0)  # |xs| < 2 (amax within 2**+-100): no sum overflows
        nr = tl.sum(fin.to(tl.int32), 1)
        ms = tl.sum(xs, 1) / tl.maximum(nr, 1).to(tl.float32)
        d = tl.where(fin, xs - ms[:, None], 0.0)
        zr = tl.sum((mask & (x == 0.0)).to(tl.int32), 1)
        orr = tl.sum((fin & ((x > hi) | (x < lo))).to(tl.int32), 1)
        nfr = tl.sum((mask & ~fin).to(tl.int32), 1)
    d2 = d * d
    pd = _pow2_f64(e)  # 1 / p, exactly (a division would be a call per row)
    mr = ms.to(tl.float64) * pd
    r1 = tl.sum(d, 1).to(tl.float64) * pd
    q2 = tl.sum(d2, 1).to(tl.float64) * (pd * pd)
    q3 = tl.sum(d2 * d, 1).to(tl.float64) * (pd * pd * pd)
    q4 = tl.sum(d2 * d2, 1).to(tl.float64) * (pd * pd * pd * pd)
    acc = _rows_shift(acc, nr, mr, r1, q2, q3, q4, am, zr, orr, nfr)
    if HIST:
        n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin, hist = acc
        bins = tl.where(mask, _bins(a.to(tl.int32, bitcast=True)), _BIN_DUMP)
        hist += tl.histogram(tl.reshape(bins, [x.numel], can_reorder=True), 64)
        acc = n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin, hist
    return acc


@triton.jit
def rows_partial(acc):
    """The program's partial of its row state: the buckets' power sums moved to the common mean in fp64."""
    n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin, hist = acc
    k = n.to(tl.float64)
    nf = tl.sum(k, 0)
    mu = tl.sum(k * c + A1, 0) / tl.maximum(nf, 1.0)
    e = c - mu  # x - mu = (x - c) + e
    e2 = e * e
    B1 = tl.sum(A1 + k * e, 0)
    B2 = tl.sum(A2 + 2.0 * e * A1 + k * e2, 0)
    B3 = tl.sum(A3 + 3.0 * e * A2 + 3.0 * e2 * A1 + k * e2 * e, 0)
    B4 = tl.sum(A4 + 4.0 * e * A3 + 6.0 * e2 * A2 + 4.0 * e2 * e * A1 + k * e2 * e2, 0)
    md, m2, m3, m4 = _central(nf, B1, B2, B3, B4)
    nfin = tl.sum(n, 0)
    nonf = tl.sum(nonfin, 0)
    zi = tl.zeros([], tl.int32)
    return (nfin + nonf, nfin, nonf, tl.sum(zeros, 0), tl.sum(outl, 0), zi, zi, tl.max(amax, 0), mu + md, m2,
            m3, m4, hist)


@triton.jit
def nofmt_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, part, AHM_PTR: tl.constexpr,
                   HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr, SMODE: tl.constexpr):
    """``fused_epilogue`` of a program's partial of a tensor with no scale known before the read (SMODE 0
    or 2, see ``fused_epilogue``; counts were taken without thresholds)."""
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, 1.0, part[0], part[1],
                   part[2], part[3], part[4], part[5], part[6], part[7], part[8], part[9], part[10], part[11],
                   part[12], FMAX, UTHR, AHM_PTR, HIST, SMODE)
