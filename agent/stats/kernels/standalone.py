"""The standalone statistics kernel (``stats_kernel``): a program per chunk of each tensor of a table, one
read per chunk, the last program of each tensor (or a later merge launch) writes its row."""

import triton
import triton.language as tl

from .consts import (
    _CTRW,
    _JOINT,
    _PW,
    _ROW_UNDER,
    _T_ADDR,
    _T_AHM,
    _T_AHM_ADDR,
    _T_AMAX_OUT,
    _T_CENTER_ADDR,
    _T_CHUNK,
    _T_CODE,
    _T_DST,
    _T_FIRST,
    _T_FMT,
    _T_K,
    _T_MEAN,
    _T_MERGE,
    _T_NUMEL,
    _T_NWORK,
    _T_SCALE,
    _T_SCALE_ADDR,
    _T_SMODE,
    _T_STD,
    _TABW,
    _WIDTH,
    P_AHM,
    SCALE_CAST_C,
    SMEM_HIST,
)
from .hist import _erows
from .merge import _done, _store_partial
from .tile import (
    _inv_binade,
    _stamp,
    _thresholds,
    careful_result,
    fast_result,
    outlier_bounds,
    tile_careful,
    tile_fast,
    tile_sum,
)
from .words import packed_fold, packed_setup, tile_bf16x2

# ---- one chunk: fast path, careful path ----------------------------------------------------------


@triton.jit
def _count_sum_max_count(n1, s1, m1, k1, n2, s2, m2, k2):
    return n1 + n2, s1 + s2, tl.maximum(m1, m2), k1 + k2


@triton.jit
def _shift_of2(x, mask):
    """``shift_of`` of a 2-D first tile (its four reductions as one, per axis)."""
    a = tl.abs(x)
    fin = a < float("inf")
    v = mask & fin
    if _JOINT:
        cnt, sm, am, bad = tl.reduce((v.to(tl.int32), tl.where(v, x, 0.0), tl.where(v, a, 0.0),
                                      (mask & ~fin).to(tl.int32)), 1, _count_sum_max_count)
        cnt, sm, am, bad = tl.reduce((cnt, sm, am, bad), 0, _count_sum_max_count)
    else:
        cnt = tl.sum(tl.sum(v.to(tl.int32), 1), 0)
        sm = tl.sum(tl.sum(tl.where(v, x, 0.0), 1), 0)
        am = tl.max(tl.max(tl.where(v, a, 0.0), 1), 0)
        bad = tl.sum(tl.sum((mask & ~fin).to(tl.int32), 1), 0)
    c = sm / tl.maximum(cnt, 1).to(tl.float32)
    p, e = _inv_binade(am)
    ok = (bad == 0) & (c == c) & (tl.abs(c) < float("inf"))
    return c, p, ok


@triton.jit
def _words(w, wb, woffs, nfull, TILE: tl.constexpr, p, ncp, ku, lo2, hi2, acc, ht, HTF: tl.constexpr,
           UCOUNT: tl.constexpr):
    """The word loop over ``nfull`` full tiles, the first (``w``) loaded: ``tile_bf16x2``'s accumulators ``acc``
    with every tile's added."""
    s1, s2, s3, s4, amw, pu, pnz, pout = acc
    # two tiles per iteration, each loaded into the registers the other is not using: carrying one tile from an
    # iteration to the next cost a register move per word
    for k in range(0, nfull // 2):
        wn = tl.load(wb + (2 * k + 1) * (TILE // 2) + woffs)
        s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                          pout, ht, HTF, UCOUNT)
        w = tl.load(wb + tl.minimum(2 * k + 2, nfull - 1) * (TILE // 2) + woffs)
        s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(wn, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                          pout, ht, HTF, UCOUNT)
    if nfull % 2 == 1:  # w: the last full tile
        s1, s2, s3, s4, amw, pu, pnz, pout = tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                          pout, ht, HTF, UCOUNT)
    return s1, s2, s3, s4, amw, pu, pnz, pout


@triton.jit
def _chunk(base, n, s, smode, uthr, othr, lo, hi, tr, HIST: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
           TRACE: tl.constexpr, PACKED: tl.constexpr = False, ht=None, HTF: tl.constexpr = False):
    """Statistics of the ``n`` elements at ``base`` (16-byte aligned). Tiles are [R, V]: a thread holds whole
    rows of V contiguous elements (one 16-byte load), so the per-row sums inside the loop are a thread's own
    adds and the accumulators are [R] (no cross-thread work in the hot loop). The first tiles' loads are
    issued before the scalar set-up (threshold bisections, the shift's reductions), which runs while they
    are in flight; the loop keeps the next tile's loads in flight while it works on one (a deeper prefetch
    gains nothing)."""
    TILE: tl.constexpr = R * V
    offs = tl.arange(0, R)[:, None] * V + tl.arange(0, V)[None, :]
    m0 = offs < n
    x0 = tl.load(base + offs, mask=m0, other=0.0)
    if PACKED:  # the first tile again as words, in flight with x0 (the shift below comes from x0)
        W: tl.constexpr = V // 2
        wb = base.to(tl.pointer_type(tl.int32), bitcast=True)
        woffs = tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
        w = tl.load(wb + woffs, mask=woffs < n // 2, other=0)
    tu, to = _thresholds(s, smode, uthr, othr)
    x0 = x0.to(tl.float32)
    c, p, ok = _shift_of2(x0, m0)
    _stamp(tr, 1, TRACE)
    ncp = -(c * p)
    zf = tl.zeros([R], tl.float32)
    zi = tl.zeros([R], tl.int32)
    mean = tl.zeros([], tl.float64)
    m2 = tl.zeros([], tl.float64)
    m3 = tl.zeros([], tl.float64)
    m4 = tl.zeros([], tl.float64)
    amax = tl.zeros([], tl.float32)
    zeros = tl.zeros([], tl.int32)
    under = tl.zeros([], tl.int32)
    over = tl.zeros([], tl.int32)
    outl = tl.zeros([], tl.int32)
    nonfin = tl.zeros([], tl.int32)
    nfin = n
    hist = tl.zeros([64], tl.int32)
    ntiles = tl.cdiv(n, TILE)
    if ok:
        s1, s2, s3, s4, am, cu, co, cout, cz, h = zf, zf, zf, zf, zf, zi, zi, zi, zi, tl.zeros([64], tl.int32)
        nfull = n // TILE
        # Software prefetch: tile k+1 is loaded before tile k is processed, so loads are in flight during
        # the arithmetic (without it each warp waits out the full memory latency once per tile). The first
        # tile is x0, already loaded; the last iterations re-load the last full tile (an unmasked, uniform
        # load instead of a per-element mask; read from L2).
        if PACKED:  # bf16 words, two elements each; overflow counted lazily (below)
            ku, lo2, hi2, amw, pu, pnz, pout = packed_setup(tu, lo, hi, R)
            acc = (s1, s2, s3, s4, amw, pu, pnz, pout)
            if tu < 0:  # no scale before the read: a loop that counts nothing against a threshold
                acc = _words(w, wb, woffs, nfull, TILE, p, ncp, ku, lo2, hi2, acc, ht, HTF, False)
            else:
                acc = _words(w, wb, woffs, nfull, TILE, p, ncp, ku, lo2, hi2, acc, ht, HTF, True)
            s1, s2, s3, s4, amw, pu, pnz, pout = acc
            am, cu, cz, cout = packed_fold(nfull * V, amw, pu, pnz, pout, am, cu, cz, cout)
        else:
            x = x0
            for k in range(0, nfull):
                xn = tl.load(base + tl.minimum(k + 1, nfull - 1) * TILE + offs)
                s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(
                    x, m0, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, False, True, ht,
                    HTF)
                x = xn.to(tl.float32)
        _stamp(tr, 2, TRACE)
        if nfull < ntiles:
            mt = nfull * TILE + offs < n
            x = tl.load(base + nfull * TILE + offs, mask=mt, other=0.0).to(tl.float32)
            s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(
                x, mt, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, True, True, ht, HTF)
        ok, mean, m2, m3, m4, amax, zeros, under, over, outl, hist = fast_result(
            n, c, p, tu, to, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, ht, HTF)
        if PACKED:  # an element above the overflow threshold: the careful path counts them
            ok = ok & ((to < 0) | (amax.to(tl.int32, bitcast=True) <= to))
    if not ok:  # NaN/Inf, fp32 overflow of the power sums or a poor shift: two exact fp64 passes
        acc = tl.zeros([R], tl.float64)
        cnt = zi
        for k in range(0, ntiles):
            mt = k * TILE + offs < n
            x = tl.load(base + k * TILE + offs, mask=mt, other=0.0).to(tl.float32)
            acc, cnt = tile_sum(x, mt, acc, cnt, True)
        nfin = tl.sum(cnt, 0)
        mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
        zd = tl.zeros([R], tl.float64)
        t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, zf, zi, zi, zi, zi, zi, \
            tl.zeros([64], tl.int32)
        for k in range(0, ntiles):
            mt = k * TILE + offs < n
            x = tl.load(base + k * TILE + offs, mask=mt, other=0.0).to(tl.float32)
            t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = tile_careful(
                x, mt, mean0, tu, to, lo, hi, t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h, HIST, True)
        mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin = careful_result(
            nfin, mean0, t1, t2, t3, t4, am, cu, co, cout, cz, cnf)
        hist = h
    return nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist


@triton.jit
def _f64(bits):
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def _chunks(addr, start, code, n, s, smode, uthr, othr, lo, hi, tr, HIST: tl.constexpr, R: tl.constexpr,
            TRACE: tl.constexpr, ht=None, HTF: tl.constexpr = False):
    """``_chunk`` of the tensor's dtype (``code``). bf16 goes through its words unless the histogram needs
    ``tl.histogram`` (no table ``ht``). ``HTF``: ``ht`` is the exponent-row table."""
    if code == 0:
        res = _chunk(tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)) + start, 16), n, s, smode, uthr, othr,
                     lo, hi, tr, HIST, R, 8, TRACE, not HIST or ht is not None, ht, HTF)
    elif code == 1:
        res = _chunk(tl.multiple_of(addr.to(tl.pointer_type(tl.float32)) + start, 16), n, s, smode, uthr, othr,
                     lo, hi, tr, HIST, R, 4, TRACE, False, ht, HTF)
    else:
        res = _chunk(tl.multiple_of(addr.to(tl.pointer_type(tl.float16)) + start, 16), n, s, smode, uthr, othr,
                     lo, hi, tr, HIST, R, 8, TRACE, False, ht, HTF)
    return res


@triton.jit
def stats_kernel(tab_ptr, ntab, part_ptr, ctr_ptr, dst_ptr, trace_ptr, HIST: tl.constexpr, R: tl.constexpr,
                  TRACE: tl.constexpr, NARROW: tl.constexpr, LATER: tl.constexpr = False):
    w = tl.program_id(0)
    tr = trace_ptr + w * 16
    _stamp(tr, 0, TRACE)
    # this program's tensor: the last table row whose first chunk is <= w (bisection over the rows)
    lo = tl.zeros([], tl.int32)
    hi = ntab + tl.zeros([], tl.int32)  # a tensor even where Triton specialises ntab == 1 to a constant
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_up = tl.load(tab_ptr + mid.to(tl.int64) * _TABW + _T_FIRST) <= w
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid)
    t = lo.to(tl.int64)
    row = tab_ptr + t * _TABW
    chunk = tl.load(row + _T_CHUNK)
    start = (w - tl.load(row + _T_FIRST)) * chunk
    addr = tl.load(row + _T_ADDR)
    numel = tl.load(row + _T_NUMEL)
    code = tl.load(row + _T_CODE)
    end = tl.minimum(start + chunk, numel)
    smode = tl.load(row + _T_SMODE)
    fmt = tl.load(row + _T_FMT)
    uthr = tl.where(fmt == 1, 2.0 ** -10, 2.0 ** -17).to(tl.float32)
    othr = tl.where(fmt == 1, 464.0, 61440.0 - 2.0 ** -8).to(tl.float32)
    fmax = tl.where(fmt == 1, 448.0, 57344.0)
    s_addr = tl.load(row + _T_SCALE_ADDR)
    s = _f64(tl.load(row + _T_SCALE)).to(tl.float32)
    if s_addr != 0:
        s = tl.load(s_addr.to(tl.pointer_type(tl.float32)))
    c_addr = tl.load(row + _T_CENTER_ADDR)
    cmean = _f64(tl.load(row + _T_MEAN))
    cstd = _f64(tl.load(row + _T_STD))
    if c_addr != 0:
        cp = c_addr.to(tl.pointer_type(tl.float64))
        cmean = tl.load(cp)
        cstd = tl.load(cp + 1)
    lo, hi = outlier_bounds(cmean, cstd, _f64(tl.load(row + _T_K)))
    epoch_ptr = tl.load(row + _T_AMAX_OUT).to(tl.pointer_type(tl.int64))
    epoch = tl.zeros([], tl.int64)
    if LATER:
        if smode == SCALE_CAST_C:  # loaded now: its latency passes under the read
            epoch = tl.load(epoch_ptr + 1)
    n = (end - start).to(tl.int32)  # <= the chunk; the launcher makes every address 16-byte aligned
    if HIST and SMEM_HIST:  # the standalone kernel's table: a row per fp32 exponent, no clamp per element
        res = _chunks(addr, start, code, n, s, smode, uthr, othr, lo, hi, tr, HIST, R, TRACE, _erows(), True)
    else:
        res = _chunks(addr, start, code, n, s, smode, uthr, othr, lo, hi, tr, HIST, R, TRACE, None, False)
    nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = res
    _store_partial(part_ptr + w, tl.num_programs(0), end - start, nfin, nonfin, zeros, outl, under, over,
                   amax, mean, m2, m3, m4)
    _stamp(tr, 3, TRACE)
    ahm_addr = tl.load(row + _T_AHM_ADDR)
    ahm = _f64(tl.load(row + _T_AHM))
    if ahm_addr != 0:
        ahm = tl.load(ahm_addr.to(tl.pointer_type(tl.float32))).to(tl.float64)
    first = tl.load(row + _T_FIRST)
    nwork = tl.load(row + _T_NWORK)
    dst = dst_ptr + tl.load(row + _T_DST) * _WIDTH
    if LATER:  # the rows are merged by a later launch (``merge_kernel``): no counter, no last program here
        if smode == SCALE_CAST_C:  # the amax to the cast, through the epoch words (``epoch_words``)
            tl.atomic_max(epoch_ptr, ((epoch + 1) << 32) | amax.to(tl.int32, bitcast=True).to(tl.int64),
                          sem="relaxed", scope="gpu")
        if HIST:
            tl.store(part_ptr + w + (_PW + tl.arange(0, 64)) * tl.num_programs(0), hist.to(tl.float64))
        if w == first:
            tl.store(part_ptr + w + P_AHM * tl.num_programs(0), ahm)
            if smode == SCALE_CAST_C:  # the cast adds its underflow to a row that starts at 0 (or merges)
                merge = tl.load(row + _T_MERGE)
                if merge == 0:
                    tl.store(dst + _ROW_UNDER, 0.0)
                elif tl.load(dst) == 0:
                    tl.store(dst + _ROW_UNDER, 0.0)
    else:
        _done(part_ptr + first, tl.num_programs(0), ctr_ptr + t * _CTRW, nwork, dst, tl.load(row + _T_MERGE),
              smode, s, fmax, uthr, ahm, hist, HIST, tr, TRACE, NARROW, tl.load(row + _T_AMAX_OUT))
    _stamp(tr, 4, TRACE)
