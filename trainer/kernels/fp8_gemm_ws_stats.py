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
    def rows_zero(ROWS: gl.constexpr, layout: gl.constexpr):
        """The empty state of ROWS buckets in ``layout`` (a tile layout's ``SliceLayout(1, ...)``): (n, c, A1, A2,
        A3, A4, amax, zeros, outliers, nonfinite)."""
        zi = gl.zeros([ROWS], gl.int32, layout)
        zd = gl.zeros([ROWS], gl.float64, layout)
        return zi, zd, zd, zd, zd, zd, gl.zeros([ROWS], gl.float32, layout), zi, zi, zi

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
    def rows_add(st, x, mask, full, lo, hi):
        """The state ``st`` with the [ROWS, W] fp32 tile ``x`` added (lanes outside ``mask`` excluded; ``full``: a
        scalar, True when every lane is inside)."""
        n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin = st
        a = gl.abs(x)
        rs = gl.sum(x, 1)
        ra = gl.max(a, 1)
        if full & (gl.max(gl.where(gl.abs(rs) < float("inf"), 0, 1), 0) == 0):
            p, e = _inv_binade(ra)
            nr = gl.zeros_like(e) + x.shape[1]
            ms = (rs / x.shape[1]) * p  # the row mean, scaled (exactly) as the deviations are
            d = x * p[:, None] - ms[:, None]
            am = ra
            zr = gl.sum((x == 0.0).to(gl.int32), 1)
            orr = gl.sum(((x > hi) | (x < lo)).to(gl.int32), 1)
            nfr = gl.zeros_like(zr)
        else:
            fin = mask & (a < float("inf"))
            am = gl.max(gl.where(fin, a, 0.0), 1)
            p, e = _inv_binade(am)
            xs = gl.where(fin, x * p[:, None], 0.0)  # |xs| < 2: no sum overflows
            nr = gl.sum(fin.to(gl.int32), 1)
            ms = gl.sum(xs, 1) / gl.maximum(nr, 1).to(gl.float32)
            d = gl.where(fin, xs - ms[:, None], 0.0)
            zr = gl.sum((mask & (x == 0.0)).to(gl.int32), 1)
            orr = gl.sum((fin & ((x > hi) | (x < lo))).to(gl.int32), 1)
            nfr = gl.sum((mask & ~fin).to(gl.int32), 1)
        d2 = d * d
        pd = _pow2_f64(e)  # 1 / p, exactly
        mr = ms.to(gl.float64) * pd
        r1 = gl.sum(d, 1).to(gl.float64) * pd
        q2 = gl.sum(d2, 1).to(gl.float64) * (pd * pd)
        q3 = gl.sum(d2 * d, 1).to(gl.float64) * (pd * pd * pd)
        q4 = gl.sum(d2 * d2, 1).to(gl.float64) * (pd * pd * pd * pd)
        c = gl.where(n == 0, mr, c)  # a bucket's shift: the mean of its first non-empty row
        f = mr - c  # x - c = (x - mr) + f, in fp64
        k = nr.to(gl.float64)
        f2 = f * f
        A4 += q4 + 4.0 * f * q3 + 6.0 * f2 * q2 + 4.0 * f2 * f * r1 + k * f2 * f2
        A3 += q3 + 3.0 * f * q2 + 3.0 * f2 * r1 + k * f2 * f
        A2 += q2 + 2.0 * f * r1 + k * f2
        A1 += r1 + k * f
        return n + nr, c, A1, A2, A3, A4, gl.maximum(amax, am), zeros + zr, outl + orr, nonfin + nfr

    @gluon.jit
    def store_partial(st, sp_ptr, col, ncols, ahm_val):
        """Reduce the buckets to one partial (their power sums moved to the common mean in fp64) and store it at
        column ``col`` of the field-major partials ``sp_ptr`` (``ncols`` columns); column 0 also holds the history
        max ``ahm_val`` (``triton_stats._merge_kernel`` reads it there)."""
        n, c, A1, A2, A3, A4, amax, zeros, outl, nonfin = st
        k = n.to(gl.float64)
        nf = gl.sum(k, 0)
        mu = gl.sum(k * c + A1, 0) / gl.maximum(nf, 1.0)
        e = c - mu  # x - mu = (x - c) + e
        e2 = e * e
        s1 = gl.sum(A1 + k * e, 0)
        s2 = gl.sum(A2 + 2.0 * e * A1 + k * e2, 0)
        s3 = gl.sum(A3 + 3.0 * e * A2 + 3.0 * e2 * A1 + k * e2 * e, 0)
        s4 = gl.sum(A4 + 4.0 * e * A3 + 6.0 * e2 * A2 + 4.0 * e2 * e * A1 + k * e2 * e2, 0)
        n1 = gl.maximum(nf, 1.0)
        m = s1 / n1  # the central moments from the power sums (``triton_stats._central``)
        m2 = gl.maximum(s2 - m * s1, 0.0)
        m3 = s3 - 3.0 * m * s2 + 2.0 * nf * m * m * m
        m4 = gl.maximum(s4 - 4.0 * m * s3 + 6.0 * m * m * s2 - 3.0 * nf * m * m * m * m, 0.0)
        nfin = gl.sum(n, 0).to(gl.float64)
        nonf = gl.sum(nonfin, 0).to(gl.float64)
        pp = sp_ptr + col
        gl.store(pp + _P_N * ncols, nfin)
        gl.store(pp + _P_NUMEL * ncols, nfin + nonf)
        gl.store(pp + _P_NONFIN * ncols, nonf)
        gl.store(pp + _P_ZEROS * ncols, gl.sum(zeros, 0).to(gl.float64))
        gl.store(pp + _P_OUTL * ncols, gl.sum(outl, 0).to(gl.float64))
        gl.store(pp + _P_UNDER * ncols, nfin * 0.0)
        gl.store(pp + _P_OVER * ncols, nfin * 0.0)
        gl.store(pp + _P_AMAX * ncols, gl.max(amax, 0).to(gl.float64))
        gl.store(pp + _P_MEAN * ncols, mu + m)
        gl.store(pp + _P_M2 * ncols, m2)
        gl.store(pp + _P_M3 * ncols, m3)
        gl.store(pp + _P_M4 * ncols, m4)
        if col == 0:
            gl.store(sp_ptr + _P_AHM * ncols, ahm_val.to(gl.float64))
