"""Per-tile statistics (the hot loop of every statistics kernel) and the per-program results: the fast path
(fp32 power sums about a shift), the careful path (two exact fp64 passes), the shift and the thresholds."""

import triton
import triton.language as tl

from .consts import _BIN_DUMP, _BIN_NONFIN, _BIN_ZERO, _INF_BITS, _JOINT, _LO, _NAN_BITS, _NB, SCALE_GIVEN_C
from .hist import _erow_add, _erow_bins, _htab_add, _htab_bins, _htab_dump

# ---- scalar helpers ---------------------------------------------------------------------------


@triton.jit
def _threshold_bits(s, thr):
    """Largest fp32 a >= 0 (its bits, int32) with fl32(a * s) <= thr; -1 when none. fl32(a * s) is
    monotone in a, so bisection over the bit patterns finds it exactly. The answer lies within a few units
    in the last place of thr / s (every a <= thr / s qualifies, and none above (thr / s)(1 + 2**-24)): the
    bisection starts from that bracket of 8 when both its ends check out (3 steps), else from [0, inf)
    (31 steps: s zero, infinite, NaN or so extreme that thr / s leaves the normal range)."""
    qb = (thr / s).to(tl.int32, bitcast=True)
    lo0 = qb - 4
    hi0 = qb + 4
    good = (s > 0) & (lo0 >= 0) & (hi0 <= 0x7F800000)
    good = good & ((lo0.to(tl.float32, bitcast=True) * s) <= thr) & \
        ((hi0.to(tl.float32, bitcast=True) * s) > thr)
    lo = tl.where(good, lo0, -1)  # f(lo) holds (-1: virtually)
    hi = tl.where(good, hi0, 0x7F800000)  # f(hi) fails (f(inf) fails for any s > 0)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = (mid.to(tl.float32, bitcast=True) * s) <= thr
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _round_down32(v):
    """Largest fp32 <= v (fp64); NaN stays NaN."""
    h = v.to(tl.float32)
    hb = h.to(tl.int32, bitcast=True)
    down = tl.where(h > 0, hb - 1, tl.where(h < 0, hb + 1, -2147483647)).to(tl.float32, bitcast=True)
    return tl.where(h.to(tl.float64) > v, down, h)


@triton.jit
def _round_up32(v):
    """Smallest fp32 >= v (fp64); NaN stays NaN."""
    h = v.to(tl.float32)
    hb = h.to(tl.int32, bitcast=True)
    up = tl.where(h > 0, hb + 1, tl.where(h < 0, hb - 1, 1)).to(tl.float32, bitcast=True)
    return tl.where(h.to(tl.float64) < v, up, h)


@triton.jit
def outlier_bounds(mean, std, k):
    """(lo, hi) fp32: x is an outlier iff x < lo or x > hi, i.e. |x - mean| > k * std exactly."""
    lim = std * k
    return _round_up32(mean - lim), _round_down32(mean + lim)


@triton.jit
def _bins(bits):
    """Histogram bin of |x| from its fp32 bits: binades LO..HI-1 (clamped), 56 zero, 57 NaN/Inf."""
    e = bits >> 23
    b = tl.minimum(tl.maximum(e - (127 + _LO), 0), _NB - 1)
    b = tl.where(bits == 0, _BIN_ZERO, b)
    return tl.where(e >= 255, _BIN_NONFIN, b)


@triton.jit
def _chan(na, ma, a2, a3, a4, nb, mb, b2, b3, b4):
    """Chan/Pebay merge of (n, mean, M2, M3, M4) pairs (fp64); an empty side is the identity."""
    n = na + nb
    n1 = tl.where(n > 0, n, 1.0)
    d = mb - ma
    mean = ma + d * nb / n1
    m2 = a2 + b2 + d * d * na * nb / n1
    m3 = a3 + b3 + d * d * d * na * nb * (na - nb) / (n1 * n1) + 3.0 * d * (na * b2 - nb * a2) / n1
    m4 = (a4 + b4 + d * d * d * d * na * nb * (na * na - na * nb + nb * nb) / (n1 * n1 * n1)
          + 6.0 * d * d * (na * na * b2 + nb * nb * a2) / (n1 * n1) + 4.0 * d * (na * b3 - nb * a3) / n1)
    a_only = nb == 0
    b_only = na == 0
    mean = tl.where(a_only, ma, tl.where(b_only, mb, mean))
    m2 = tl.where(a_only, a2, tl.where(b_only, b2, m2))
    m3 = tl.where(a_only, a3, tl.where(b_only, b3, m3))
    m4 = tl.where(a_only, a4, tl.where(b_only, b4, m4))
    return n, mean, m2, m3, m4


@triton.jit
def _central(n, s1, s2, s3, s4):
    """Central moments (mean offset, M2, M3, M4) from power sums of values shifted near their mean."""
    n1 = tl.where(n > 0, n, 1.0)
    m = s1 / n1
    m2 = s2 - m * s1
    m3 = s3 - 3.0 * m * s2 + 2.0 * n * m * m * m
    m4 = s4 - 4.0 * m * s3 + 6.0 * m * m * s2 - 3.0 * n * m * m * m * m
    return m, tl.maximum(m2, 0.0), m3, tl.maximum(m4, 0.0)


# ---- per-tile updates -------------------------------------------------------------------------
# RED: the tile is 2-D and the accumulators 1-D (the tile summed over axis 1 first): keeps the
# register footprint of large 2-D tiles (quantize_transpose) small.


@triton.jit
def _red(v, RED: tl.constexpr):
    if RED:
        return tl.sum(v, 1)
    else:
        return v


@triton.jit
def _redmax(v, RED: tl.constexpr):
    if RED:
        return tl.max(v, 1)
    else:
        return v


@triton.jit
def _hist(bins, RED: tl.constexpr):
    if RED:  # order is irrelevant to a histogram: no layout shuffle needed
        return tl.histogram(tl.reshape(bins, [bins.numel], can_reorder=True), 64)
    else:
        return tl.histogram(bins, 64)


@triton.jit
def tile_fast(x, mask, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, amax, cu, co, cout, cz, hist,
               HIST: tl.constexpr, HAS_MASK: tl.constexpr, RED: tl.constexpr = False, ht=None,
               HTF: tl.constexpr = False):
    """Fast path (no NaN/Inf expected): fp32 power sums of the scaled shifted values per lane, counts
    as integer compares of |x|'s bits. ``cu``, ``co`` and ``cz`` hold *minus* the counts of |x| above the
    underflow threshold, above the overflow threshold and of zeros (``fast_result`` turns them into
    counts): ``(t - bits) >> 31`` is -1 exactly when bits > t (bits >= 0, t >= -1: no wrap-around), two
    instructions where a compare-and-count took three (ptxas made it a conditional increment). Only a
    partial tile (``HAS_MASK``) pays for masks; its masked lanes are loaded as 0, which exceeds a threshold
    only when that is -1 (no scale, or an infinite one: ``fast_result`` handles both), so only the zero and
    outlier counts mask them. ``HTF``: ``ht`` is the exponent-row table (``_erows``)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    d = tl.fma(x, p, ncp)
    amax = tl.maximum(amax, _redmax(a, RED))
    cu += _red((tu - bits) >> 31, RED)
    co += _red((to - bits) >> 31, RED)
    if HAS_MASK:
        d = tl.where(mask, d, 0.0)
        cout += _red((((x > hi) | (x < lo)) & mask).to(tl.int32), RED)
        if HIST and ht is None:
            hist += _hist(tl.where(mask, _bins(bits), _BIN_DUMP), RED)
        else:
            cz -= _red(((bits == 0) & mask).to(tl.int32), RED)
            if HIST and HTF:
                _erow_add(ht, tl.where(mask, (bits >> 16) & 0x7F80, 255 * 128))
            elif HIST:
                _htab_dump(ht, mask, (bits >> 16) & 0x7F80)
    else:
        cout += _red(((x > hi) | (x < lo)).to(tl.int32), RED)
        if HIST and ht is None:
            hist += _hist(_bins(bits), RED)
        else:
            cz += _red((bits - 1) >> 31, RED)
            if HIST and HTF:
                _erow_add(ht, (bits >> 16) & 0x7F80)
            elif HIST:
                _htab_add(ht, (bits >> 16) & 0x7F80)
    d2 = d * d
    s1 += _red(d, RED)
    s2 += _red(d2, RED)
    s3 += _red(d2 * d, RED)
    s4 += _red(d2 * d2, RED)
    return s1, s2, s3, s4, amax, cu, co, cout, cz, hist


@triton.jit
def tile_sum(x, mask, acc, cnt, RED: tl.constexpr = False):
    """Careful pass 1: fp64 sum and count of the finite elements."""
    v = mask & (tl.abs(x) < float("inf"))
    return acc + _red(tl.where(v, x, 0.0).to(tl.float64), RED), cnt + _red(v.to(tl.int32), RED)


@triton.jit
def tile_careful(x, mask, mean0, tu, to, lo, hi, t1, t2, t3, t4, amax, cu, co, cout, cz, cnf, hist,
                  HIST: tl.constexpr, RED: tl.constexpr = False):
    """Careful pass 2: everything masked, moments in fp64 about the chunk's fp64 mean."""
    a = tl.abs(x)
    bits = tl.where(mask, a.to(tl.int32, bitcast=True), _NAN_BITS)
    fin = bits < _INF_BITS
    d = tl.where(fin, x.to(tl.float64) - mean0, 0.0)
    d2 = d * d
    t1 += _red(d, RED)
    t2 += _red(d2, RED)
    t3 += _red(d2 * d, RED)
    t4 += _red(d2 * d2, RED)
    amax = tl.maximum(amax, _redmax(tl.where(fin, a, 0.0), RED))
    cu += _red(((bits <= tu) & (bits != 0)).to(tl.int32), RED)
    co += _red(((bits > to) & fin).to(tl.int32), RED)
    cout += _red((((x > hi) | (x < lo)) & fin).to(tl.int32), RED)
    cz += _red((bits == 0).to(tl.int32), RED)
    cnf += _red((mask & ~fin).to(tl.int32), RED)
    if HIST:
        hist += _hist(tl.where(mask, _bins(bits), _BIN_DUMP), RED)
    return t1, t2, t3, t4, amax, cu, co, cout, cz, cnf, hist


@triton.jit
def _inv_binade(am):
    """(p, e): p = 2**-e (fp32) for ``am`` in [2**e, 2**e+1), e clamped to [-100, 100] (am = 0 gives 2**100):
    x * p is exact and |x| <= am scales to below 2, so 4th powers neither under- nor overflow fp32."""
    e = (am.to(tl.int32, bitcast=True) >> 23) - 127
    e = tl.minimum(tl.maximum(e, -100), 100)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), e


@triton.jit
def shift_of(x, mask):
    """(c, p, ok) from a first tile: c its finite mean (fp32), p = 2**-e for its amax in [2**e, 2**e+1),
    ok False when it holds NaN/Inf (then the careful path runs)."""
    a = tl.abs(x)
    fin = a < float("inf")
    v = mask & fin
    cnt = tl.sum(v.to(tl.int32), 0)
    c = tl.sum(tl.where(v, x, 0.0), 0) / tl.maximum(cnt, 1).to(tl.float32)
    am = tl.max(tl.where(v, a, 0.0), 0)
    p, e = _inv_binade(am)
    ok = (tl.sum((mask & ~fin).to(tl.int32), 0) == 0) & (c == c) & (tl.abs(c) < float("inf"))
    return c, p, ok


# ---- per-program results ----------------------------------------------------------------------


@triton.jit
def _sums_max(a1, a2, a3, a4, am, i1, i2, i3, i4, b1, b2, b3, b4, bm, j1, j2, j3, j4):
    return a1 + b1, a2 + b2, a3 + b3, a4 + b4, tl.maximum(am, bm), i1 + j1, i2 + j2, i3 + j3, i4 + j4


@triton.jit
def fast_result(n, c, p, tu, to, s1, s2, s3, s4, amax, cu, co, cout, cz, hist, HIST: tl.constexpr, ht=None,
                 HTF: tl.constexpr = False):
    """Per-program partial of the fast path, and whether it is valid (else: careful path). One reduction of
    all nine accumulators (one round through shared memory, not nine)."""
    if _JOINT:
        S1, S2, S3, S4, am, cu, co, cout, cz = tl.reduce(
            (s1.to(tl.float64), s2.to(tl.float64), s3.to(tl.float64), s4.to(tl.float64), amax, cu, co, cout, cz),
            0, _sums_max)
    else:
        S1, S2 = tl.sum(s1.to(tl.float64), 0), tl.sum(s2.to(tl.float64), 0)
        S3, S4 = tl.sum(s3.to(tl.float64), 0), tl.sum(s4.to(tl.float64), 0)
        am, cu, co, cout, cz = tl.max(amax, 0), tl.sum(cu, 0), tl.sum(co, 0), tl.sum(cout, 0), tl.sum(cz, 0)
    if HIST and HTF:
        hist = _erow_bins(ht, -cz)
    elif HIST and ht is not None:
        hist = _htab_bins(ht, -cz)
    nf = n.to(tl.float64)
    finite = (tl.abs(S1) < float("inf")) & (S2 < float("inf")) & (tl.abs(S3) < float("inf")) & \
        (S4 < float("inf")) & (am < float("inf"))
    ok = finite & (17.0 * S1 * S1 <= nf * S2)  # |mean - c| <= std / 4: no cancellation to speak of
    if HIST:
        ok = ok & (tl.sum(tl.where(tl.arange(0, 64) == _BIN_NONFIN, hist, 0), 0) == 0)
    md, m2, m3, m4 = _central(nf, S1, S2, S3, S4)
    ip = 1.0 / p.to(tl.float64)  # exact (p is a power of two): one division, not four
    ip2 = ip * ip
    mean = c.to(tl.float64) + md * ip
    m2 = m2 * ip2
    m3 = m3 * (ip2 * ip)
    m4 = m4 * (ip2 * ip2)
    if HIST and ht is None:
        zeros = tl.sum(tl.where(tl.arange(0, 64) == _BIN_ZERO, hist, 0), 0)
    else:
        zeros = -cz
    under = tl.where(tu >= 0, n + cu - zeros, 0)  # |x| <= threshold: all but those above it
    over = tl.where(to >= 0, -co, n)  # to = -1: even 0 overflows (0 * inf), as every lane counted
    outl = cout
    return ok, mean, m2, m3, m4, am, zeros, under, over, outl, hist


@triton.jit
def careful_result(n, mean0, t1, t2, t3, t4, amax, cu, co, cout, cz, cnf):
    nf = n.to(tl.float64)
    md, m2, m3, m4 = _central(nf, tl.sum(t1, 0), tl.sum(t2, 0), tl.sum(t3, 0), tl.sum(t4, 0))
    return (mean0 + md, m2, m3, m4, tl.max(amax, 0), tl.sum(cz, 0), tl.sum(cu, 0), tl.sum(co, 0),
            tl.sum(cout, 0), tl.sum(cnf, 0))


# ---- launch-wide helpers ------------------------------------------------------------------


@triton.jit
def _stamp(tr, slot, TRACE: tl.constexpr):
    """TRACE only (benches): the low 32 bits of the GPU's nanosecond timer into ``tr[slot]``."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
        tl.store(tr + slot, t)


@triton.jit
def _stamp_after(tr, slot, v, TRACE: tl.constexpr):
    """``_stamp`` once the values of ``v`` (a loaded vector) have arrived: the timer read takes them as an
    operand, so it cannot issue before their loads complete."""
    if TRACE:
        t = tl.inline_asm_elementwise("{.reg .b32 d; mov.u32 d, $1; mov.u32 $0, %globaltimer_lo;}", "=r,r",
                                      [(v != 0).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(tr + slot, tl.max(t, 0))


@triton.jit
def _thresholds(s, smode, uthr, othr):
    """(tu, to) under scale ``s``: the largest |x| bits that underflow, and the largest that do not overflow
    (see the module docstring); with no scale given, -1 (every |x| is above it) and 0x7FFFFFFF (none is)."""
    if smode == SCALE_GIVEN_C:
        tu = _threshold_bits(s, uthr)
        to = _threshold_bits(s, othr)
        to = tl.where(s == s, to, 0x7FFFFFFF)
    else:
        tu = tl.full([], -1, tl.int32)
        to = tl.full([], 0x7FFFFFFF, tl.int32)
    return tu, to
