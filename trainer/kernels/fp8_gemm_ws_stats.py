"""The statistics row of the warp-specialized FP8 GEMM's output (``fp8_gemm_ws``), for its statistics worker.

Gluon cannot call ``triton.jit`` functions, so this is ``agent.triton_stats``' register-tile row state (``rows_zero``,
``rows_add``, ``rows_partial``) written again in Gluon: one bucket per tile row (row r of every chunk of rows the worker
reads), each chunk row taken in two passes over the registers (its mean, then the sums of (x - mean)^k), shifted into
its bucket's fp64 power sums. At the end the worker reduces its buckets to one partial and stores it, field-major as
``triton_stats._store_partial`` does, at column pid: ``triton_stats.merge_later`` merges the grid's partials into the
row (the launcher queues that merge with ``triton_stats.epilogue_args(later=True)``). No histogram: a step that wants
one takes the row apart (``fp8_gemm``). Semantics are ``rows_add``'s: the fast path (a full chunk whose row sums are
finite) has no masks; edges, NaN / Inf or sums past fp32 take the masked path.
"""

from __future__ import annotations

from agent import triton_stats as ts

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    AVAILABLE = hasattr(gl, "warp_specialize")
except Exception:  # pragma: no cover - Triton without Gluon
    AVAILABLE = False

if AVAILABLE:
    _P_N = gl.constexpr(ts._P_N)
    _P_NUMEL = gl.constexpr(ts._P_NUMEL)
    _P_NONFIN = gl.constexpr(ts._P_NONFIN)
    _P_ZEROS = gl.constexpr(ts._P_ZEROS)
    _P_OUTL = gl.constexpr(ts._P_OUTL)
    _P_UNDER = gl.constexpr(ts._P_UNDER)
    _P_OVER = gl.constexpr(ts._P_OVER)
    _P_AMAX = gl.constexpr(ts._P_AMAX)
    _P_MEAN = gl.constexpr(ts._P_MEAN)
    _P_M2 = gl.constexpr(ts._P_M2)
    _P_M3 = gl.constexpr(ts._P_M3)
    _P_M4 = gl.constexpr(ts._P_M4)
    _P_AHM = gl.constexpr(ts._P_AHM)

    @gluon.jit
    def _round_down32(v):
        """Largest fp32 <= v (fp64); NaN stays NaN."""
        h = v.to(gl.float32)
        hb = h.to(gl.int32, bitcast=True)
        down = gl.where(h > 0, hb - 1, gl.where(h < 0, hb + 1, -2147483647)).to(gl.float32, bitcast=True)
        return gl.where(h.to(gl.float64) > v, down, h)

    @gluon.jit
    def _round_up32(v):
        """Smallest fp32 >= v (fp64); NaN stays NaN."""
        h = v.to(gl.float32)
        hb = h.to(gl.int32, bitcast=True)
        up = gl.where(h > 0, hb + 1, gl.where(h < 0, hb - 1, 1)).to(gl.float32, bitcast=True)
        return gl.where(h.to(gl.float64) < v, up, h)

    @gluon.jit
    def bounds(cen_ptr, c_mean, c_std, k, C_PTR: gl.constexpr):
        """(lo, hi) fp32: x is an outlier iff x < lo or x > hi, i.e. |x - mean| > k std (``fused_bounds``)."""
        cm = c_mean.to(gl.float64)
        cs = c_std.to(gl.float64)
        if C_PTR:
            cm = gl.load(cen_ptr)
            cs = gl.load(cen_ptr + 1)
        lim = cs * k.to(gl.float64)
        return _round_up32(cm - lim), _round_down32(cm + lim)

    @gluon.jit
    def rows_zero(R: gl.constexpr, G: gl.constexpr, layout: gl.constexpr):
        """The empty state of R x G buckets in ``layout`` (one per thread: a [R, G, V] tile layout's
        ``SliceLayout(2, ...)``): (n, c, A1, A2, A3, A4, amax, zeros, outliers, nonfinite)."""
        zi = gl.zeros([R, G], gl.int32, layout)
        zd = gl.zeros([R, G], gl.float64, layout)
        return zi, zd, zd, zd, zd, zd, gl.zeros([R, G], gl.float32, layout), zi, zi, zi

    @gluon.jit
    def _inv_binade(am):
        """(p, e): p = 2**-e (fp32) for ``am`` in [2**e, 2**e+1), e clamped to [-100, 100] (``triton_stats``)."""
        e = (am.to(gl.int32, bitcast=True) >> 23) - 127
        e = gl.minimum(gl.maximum(e, -100), 100)
        return ((127 - e) << 23).to(gl.float32, bitcast=True), e

    @gluon.jit
    def _pow2_f64(e):
        """2**e as fp64, from its bits (|e| <= 1022)."""
        return ((e.to(gl.int64) + 1023) << 52).to(gl.float64, bitcast=True)

    @gluon.jit
    def rows_add(st, x, mask, lo, hi, CAREFUL: gl.constexpr):
        """The state ``st`` with the [R, G, V] fp32 tile ``x`` added, each thread's V values of a bucket at a time:
        their mean and amax first, then the sums of the deviations scaled by a power of two from that amax (exact: no
        4th power under- or overflows fp32), shifted into the bucket's fp64 sums. Reductions stay inside a thread.
        CAREFUL: lanes outside ``mask`` excluded, NaN / Inf counted and not summed; else every value is inside and
        finite (``all_finite``) and ``mask`` is unused."""
        n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin = st
        if CAREFUL:
            a = gl.abs(x)
            fin = mask & (a < float("inf"))
            nfr = gl.sum((mask & ~(a < float("inf"))).to(gl.int32), 2)
            nr = gl.sum(fin.to(gl.int32), 2)
            zr = gl.sum((mask & (x == 0.0)).to(gl.int32), 2)
            am = gl.max(gl.where(fin, a, 0.0), 2)
            p, e = _inv_binade(am)
            xs = gl.where(fin, x * p[:, :, None], 0.0)
            ms = gl.sum(xs, 2) / gl.maximum(nr, 1).to(gl.float32)
            d = gl.where(fin, xs - ms[:, :, None], 0.0)
            orr = gl.sum((fin & ((x > hi) | (x < lo))).to(gl.int32), 2)
        else:
            nr = gl.full(amax.shape, x.shape[2], gl.int32, amax.type.layout)
            nfr = nr * 0
            zr = gl.sum((x == 0.0).to(gl.int32), 2)
            am = gl.max(gl.abs(x), 2)
            p, e = _inv_binade(am)
            xs = x * p[:, :, None]
            ms = gl.sum(xs, 2) * (1.0 / x.shape[2])  # exact: V is a power of two
            d = xs - ms[:, :, None]
            orr = gl.sum(((x > hi) | (x < lo)).to(gl.int32), 2)
        d2 = d * d
        pd = _pow2_f64(e)  # 1 / p, exactly
        mr = ms.to(gl.float64) * pd
        r1 = gl.sum(d, 2).to(gl.float64) * pd
        q2 = gl.sum(d2, 2).to(gl.float64) * (pd * pd)
        q3 = gl.sum(d2 * d, 2).to(gl.float64) * (pd * pd * pd)
        q4 = gl.sum(d2 * d2, 2).to(gl.float64) * (pd * pd * pd * pd)
        c = gl.where(n == 0, mr, c)  # a bucket's shift: the mean of its first non-empty values
        f = mr - c  # x - c = (x - mr) + f, in fp64
        k = nr.to(gl.float64)
        f2 = f * f
        A4 += q4 + 4.0 * f * q3 + 6.0 * f2 * q2 + 4.0 * f2 * f * r1 + k * f2 * f2
        A3 += q3 + 3.0 * f * q2 + 3.0 * f2 * r1 + k * f2 * f
        A2 += q2 + 2.0 * f * r1 + k * f2
        A1 += r1 + k * f
        return n + nr, c, A1, A2, A3, A4, gl.maximum(amax, am), zeros + zr, outl + orr, nonfin + nfr

    @gluon.jit
    def all_finite(x):
        """Whether every value of the tile ``x`` (all of the calling partition's threads) is finite: x * 0 is 0 for
        finite x and NaN for NaN / Inf, so one sum per thread, then one reduction across the partition."""
        bad = gl.where(gl.sum(x * 0.0, 2) == 0.0, 0, 1)
        return gl.max(gl.max(bad, 1), 0) == 0

    @gluon.jit
    def _total(v):
        return gl.sum(gl.sum(v, 1), 0)

    @gluon.jit
    def store_partial(st, sp_ptr, col, ncols, ahm_val):
        """Reduce the buckets to one partial (their power sums moved to the common mean in fp64) and store it at
        column ``col`` of the field-major partials ``sp_ptr`` (``ncols`` columns); column 0 also holds the history
        max ``ahm_val`` (``triton_stats._merge_kernel`` reads it there)."""
        n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin = st
        k = n.to(gl.float64)
        nf = _total(k)
        mu = _total(k * c + A1) / gl.maximum(nf, 1.0)
        e = c - mu  # x - mu = (x - c) + e
        e2 = e * e
        s1 = _total(A1 + k * e)
        s2 = _total(A2 + 2.0 * e * A1 + k * e2)
        s3 = _total(A3 + 3.0 * e * A2 + 3.0 * e2 * A1 + k * e2 * e)
        s4 = _total(A4 + 4.0 * e * A3 + 6.0 * e2 * A2 + 4.0 * e2 * e * A1 + k * e2 * e2)
        n1 = gl.maximum(nf, 1.0)
        m = s1 / n1  # the central moments from the power sums (``triton_stats._central``)
        m2 = gl.maximum(s2 - m * s1, 0.0)
        m3 = s3 - 3.0 * m * s2 + 2.0 * nf * m * m * m
        m4 = gl.maximum(s4 - 4.0 * m * s3 + 6.0 * m * m * s2 - 3.0 * nf * m * m * m * m, 0.0)
        nfin = _total(n).to(gl.float64)
        nonf = _total(nonfin).to(gl.float64)
        pp = sp_ptr + col
        gl.store(pp + _P_N * ncols, nfin)
        gl.store(pp + _P_NUMEL * ncols, nfin + nonf)
        gl.store(pp + _P_NONFIN * ncols, nonf)
        gl.store(pp + _P_ZEROS * ncols, _total(zeros).to(gl.float64))
        gl.store(pp + _P_OUTL * ncols, _total(outl).to(gl.float64))
        gl.store(pp + _P_UNDER * ncols, nfin * 0.0)
        gl.store(pp + _P_OVER * ncols, nfin * 0.0)
        gl.store(pp + _P_AMAX * ncols, gl.max(gl.max(amax, 1), 0).to(gl.float64))
        gl.store(pp + _P_MEAN * ncols, mu + m)
        gl.store(pp + _P_M2 * ncols, m2)
        gl.store(pp + _P_M3 * ncols, m3)
        gl.store(pp + _P_M4 * ncols, m4)
        if col == 0:
            gl.store(sp_ptr + _P_AHM * ncols, ahm_val.to(gl.float64))
