"""A tensor's per-program partials merged into its row in fp64 (Pebay's formulas about the first partial's
mean, shifted to the grand mean): by the last program of a launch (``_done``), or by ``merge_kernel``, a launch
for the rows that launches left to be merged later."""

import triton
import triton.language as tl

from .consts import (
    _JOINT,
    _LO,
    _MTABW,
    _NB,
    _P_AMAX,
    _P_M2,
    _P_M3,
    _P_M4,
    _P_MEAN,
    _P_N,
    _P_NONFIN,
    _P_NUMEL,
    _P_OUTL,
    _P_OVER,
    _P_UNDER,
    _P_ZEROS,
    _PB,
    _PW,
    P_AHM,
    SCALE_CAST_C,
    SCALE_CURRENT_C,
    SCALE_NONE_C,
)
from .tile import _central, _chan, _stamp, _stamp_after, _threshold_bits


@triton.jit
def _store_partial(pp, stride, numel, n, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4):
    """Field f of the partial at ``pp + f * stride``: partials are stored field-major (a field of many
    programs is contiguous), so the merge reads each field of its partials in coalesced loads."""
    tl.store(pp + _P_N * stride, n.to(tl.float64))
    tl.store(pp + _P_NUMEL * stride, numel.to(tl.float64))
    tl.store(pp + _P_NONFIN * stride, nonfin.to(tl.float64))
    tl.store(pp + _P_ZEROS * stride, zeros.to(tl.float64))
    tl.store(pp + _P_OUTL * stride, outl.to(tl.float64))
    tl.store(pp + _P_UNDER * stride, under.to(tl.float64))
    tl.store(pp + _P_OVER * stride, over.to(tl.float64))
    tl.store(pp + _P_AMAX * stride, amax.to(tl.float64))
    tl.store(pp + _P_MEAN * stride, mean)
    tl.store(pp + _P_M2 * stride, m2)
    tl.store(pp + _P_M3 * stride, m3)
    tl.store(pp + _P_M4 * stride, m4)


# ---- the finalize step: last program of a tensor merges its partials into the row ---------------


@triton.jit
def _sums11_max(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, am, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, bm):
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9, a10 + b10,
            tl.maximum(am, bm))


@triton.jit
def _load_moments(part, stride, i, nwork):
    """Partials i's (n, mean, M2, M3, M4); an empty one (n = 0) as zeros."""
    m = i < nwork
    rp = part + i.to(tl.int64)
    n = tl.load(rp + _P_N * stride, mask=m, other=0.0, cache_modifier=".cg")
    has = n > 0
    mean = tl.where(has, tl.load(rp + _P_MEAN * stride, mask=m, other=0.0, cache_modifier=".cg"), 0.0)
    q2 = tl.where(has, tl.load(rp + _P_M2 * stride, mask=m, other=0.0, cache_modifier=".cg"), 0.0)
    q3 = tl.where(has, tl.load(rp + _P_M3 * stride, mask=m, other=0.0, cache_modifier=".cg"), 0.0)
    q4 = tl.where(has, tl.load(rp + _P_M4 * stride, mask=m, other=0.0, cache_modifier=".cg"), 0.0)
    return n, mean, q2, q3, q4


@triton.jit
def _load_counts(part, stride, i, nwork):
    """Partials i's (numel, nonfinite, zeros, outliers, underflow, overflow, amax)."""
    m = i < nwork
    rp = part + i.to(tl.int64)
    return (tl.load(rp + _P_NUMEL * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_NONFIN * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_ZEROS * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_OUTL * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_UNDER * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_OVER * stride, mask=m, other=0.0, cache_modifier=".cg"),
            tl.load(rp + _P_AMAX * stride, mask=m, other=0.0, cache_modifier=".cg"))


@triton.jit
def _about(n, mean, q2, q3, q4, c):
    """A partial's power sums of (x - c), from its n, mean and central moments (Pebay's shift)."""
    d = mean - c
    nd = n * d
    d2 = d * d
    return nd, q2 + nd * d, q3 + 3.0 * d * q2 + nd * d2, q4 + 4.0 * d * q3 + 6.0 * d2 * q2 + nd * d2 * d


@triton.jit
def _merged(part, stride, i, nwork, n0, m0):
    """Partials i's (n, numel, nonfinite, zeros, outliers, underflow, overflow, power sums of x - c0 1-4, amax)
    and c0: partial 0's mean (n0, m0 loaded beforehand), or 0 if it is empty. c0 is taken after the loads
    are issued: a compare on n0 before them made the merge two rounds of loads."""
    n, mean, q2, q3, q4 = _load_moments(part, stride, i, nwork)
    numel, nonfin, zeros, outl, under, over, amax = _load_counts(part, stride, i, nwork)
    c0 = tl.where(n0 > 0, m0, 0.0)
    v1, v2, v3, v4 = _about(n, mean, q2, q3, q4, c0)
    return n, numel, nonfin, zeros, outl, under, over, v1, v2, v3, v4, amax, c0


@triton.jit
def _narrow(n, numel, nonfin, zeros, outl, under, over, amax):
    """The counts as int32 and the amax as fp32, so the reduction moves half the bits for them. Exact when
    the partials hold fewer than 2**31 elements together (the standalone kernel's launcher checks that its chunk
    times P_BLOCK is); the amax is an fp32 value."""
    return (n.to(tl.int32), numel.to(tl.int32), nonfin.to(tl.int32), zeros.to(tl.int32), outl.to(tl.int32),
            under.to(tl.int32), over.to(tl.int32), amax.to(tl.float32))


@triton.jit
def _reduce12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, am):
    if _JOINT:
        return tl.reduce((a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, am), 0, _sums11_max)
    else:
        return (tl.sum(a0, 0), tl.sum(a1, 0), tl.sum(a2, 0), tl.sum(a3, 0), tl.sum(a4, 0), tl.sum(a5, 0),
                tl.sum(a6, 0), tl.sum(a7, 0), tl.sum(a8, 0), tl.sum(a9, 0), tl.sum(a10, 0), tl.max(am, 0))


@triton.jit
def _sums_about(part, stride, nwork, c, PB: tl.constexpr):
    """Power sums 1-4 of (x - c) over all partials (blocks of PB)."""
    i0 = tl.arange(0, PB)
    zb = tl.zeros([PB], tl.float64)
    t1, t2, t3, t4 = zb, zb, zb, zb
    for b0 in range(0, nwork, PB):
        n, mean, q2, q3, q4 = _load_moments(part, stride, b0 + i0, nwork)
        u1, u2, u3, u4 = _about(n, mean, q2, q3, q4, c)
        t1 += u1
        t2 += u2
        t3 += u3
        t4 += u4
    return tl.sum(t1, 0), tl.sum(t2, 0), tl.sum(t3, 0), tl.sum(t4, 0)


@triton.jit
def _finalize(part, stride, nwork, ctr, dst, merge, smode, s_given, fmax, uthr, ahm, HIST: tl.constexpr,
              PB: tl.constexpr, tr, TRACE: tl.constexpr, NARROW: tl.constexpr, aout=None, hist_in=None,
              LATER: tl.constexpr = False):
    # The moments merge as Pebay's formulas do, all at once about one center c0: each partial's central
    # moments become power sums of (x - c0), which add, and the sums give the central moments about the grand
    # mean (``_central``); no division per partial. c0 is the first partial's mean, loaded with the rest, so
    # the merge is one round of loads and one reduction. (A tree of pairwise Chan/Pebay merges, fp64
    # divisions at every level, makes this serial tail, run by one program while the GPU idles, a large part of
    # the kernel; about the grand mean, which needs a reduction first, it takes two rounds.)
    # c0 is near the grand mean c: a chunk of n_i of N elements has n_i (mean_i - c)^2 <= N var, so
    # |c0 - c| <= std sqrt(N / n_0), and the shift back to c costs at most a few of fp64's 16 digits, the
    # partials holding fp32 sums. Up to PB partials (the usual case: a launch is about a wave of programs)
    # are read once into registers; more go in blocks (lane j: partials j, j + PB, ...).
    # The histogram is not in the partials: each program added it to the tensor's accumulator (``_done``);
    # this reads and clears it. ``LATER`` (``merge_kernel``, after the read's launch and the cast that followed
    # it): the caller summed the histogram (``hist_in``), and a cast (SCALE_CAST) has added its underflow to the
    # row already, so the row's count stays as it is.
    n0 = tl.load(part + _P_N * stride, cache_modifier=".cg")
    m0 = tl.load(part + _P_MEAN * stride, cache_modifier=".cg")
    i0 = tl.arange(0, PB)
    if nwork <= PB:
        vn, vnumel, vnonfin, vzeros, voutl, vunder, vover, t1, t2, t3, t4, vamax, c0 = _merged(
            part, stride, i0, nwork, n0, m0)
        _stamp_after(tr, 8, t4 + vamax, TRACE)
        if NARROW:
            kn, knumel, knonfin, kzeros, koutl, kunder, kover, kamax = _narrow(vn, vnumel, vnonfin, vzeros,
                                                                               voutl, vunder, vover, vamax)
            an, numel, nonfin, zeros, outl, under, over, v1, v2, v3, v4, amax = _reduce12(
                kn, knumel, knonfin, kzeros, koutl, kunder, kover, t1, t2, t3, t4, kamax)
            an, numel, nonfin, zeros = (an.to(tl.float64), numel.to(tl.float64), nonfin.to(tl.float64),
                                        zeros.to(tl.float64))
            outl, under, over, amax = outl.to(tl.float64), under.to(tl.float64), over.to(tl.float64), \
                amax.to(tl.float64)
        else:
            an, numel, nonfin, zeros, outl, under, over, v1, v2, v3, v4, amax = _reduce12(
                vn, vnumel, vnonfin, vzeros, voutl, vunder, vover, t1, t2, t3, t4, vamax)
    else:
        zb = tl.zeros([PB], tl.float64)
        vn, vnumel, vnonfin, vzeros, voutl, vunder, vover, t1, t2, t3, t4, vamax = \
            zb, zb, zb, zb, zb, zb, zb, zb, zb, zb, zb, zb
        c0 = tl.zeros([], tl.float64)
        for b0 in range(0, nwork, PB):
            cn, cnumel, cnonfin, czeros, coutl, cunder, cover, u1, u2, u3, u4, camax, c0 = _merged(
                part, stride, b0 + i0, nwork, n0, m0)
            vn += cn
            vnumel += cnumel
            vnonfin += cnonfin
            vzeros += czeros
            voutl += coutl
            vunder += cunder
            vover += cover
            t1 += u1
            t2 += u2
            t3 += u3
            t4 += u4
            vamax = tl.maximum(vamax, camax)
        an, numel, nonfin, zeros, outl, under, over, v1, v2, v3, v4, amax = _reduce12(
            vn, vnumel, vnonfin, vzeros, voutl, vunder, vover, t1, t2, t3, t4, vamax)
    _stamp(tr, 5, TRACE)
    md, a2, a3, a4 = _central(an, v1, v2, v3, v4)
    if md * md > 256.0 * a2 / tl.maximum(an, 1.0):
        # c0 more than 16 std from the grand mean (partial 0 empty or mostly NaN/Inf, or, among more than 256
        # partials, unlike all the others): the shift would cost more digits than the bound above allows;
        # again, about the grand mean
        c0 += md
        v1, v2, v3, v4 = _sums_about(part, stride, nwork, c0, PB)
        md, a2, a3, a4 = _central(an, v1, v2, v3, v4)
    _stamp(tr, 6, TRACE)
    am = c0 + md
    hist = tl.zeros([64], tl.float64)
    if LATER:
        hist = hist_in
    elif HIST:
        hist = tl.atomic_xchg(ctr + 1 + tl.arange(0, 64), tl.zeros([64], tl.int64), sem="relaxed",
                              scope="gpu").to(tl.float64)
    bins = tl.arange(0, 64)
    if HIST:
        nonzero = tl.sum(tl.where(bins < _NB, hist, 0.0), 0)
    else:
        nonzero = an - zeros
    # the scale and what depends on it
    nan = float("nan")
    cur = (fmax / tl.where((amax > 0) & (amax < float("inf")), amax, fmax)).to(tl.float32)
    scale = s_given
    if smode == SCALE_CURRENT_C:
        scale = cur
        over = tl.zeros([], tl.float64)  # s = max/amax saturates nothing (see the module docstring)
        if cur == float("inf"):  # amax so small that max/amax overflows fp32: every nonzero saturates
            over = nonzero
            under = tl.zeros([], tl.float64)
        elif HIST:
            tb = _threshold_bits(cur, uthr)
            bt = (tb >> 23) - 127 - _LO
            tf = tb.to(tl.float32, bitcast=True).to(tl.float64)
            frac = tl.where(bt < 0, tf * 2.0 ** (-_LO - 1), (tb & 0x7FFFFF).to(tl.float64) * 2.0 ** -23)
            full = tl.sum(tl.where(bins < bt, hist, 0.0), 0)
            part_bin = tl.sum(tl.where(bins == tl.maximum(bt, 0), hist, 0.0), 0)
            under = full + tl.floor(part_bin * frac + 0.5)
            under = tl.where(bt >= _NB, nonzero, under)
            under = tl.where(tb < 0, 0.0, under)
        else:
            under = tl.full([], nan, tl.float64)
    if smode == SCALE_CAST_C:
        # the cast that follows reads this amax (``aout``), scales exactly as quantize's _scale_from_amax does
        # (so nothing overflows) and adds the underflow it counts at that scale to this row
        amax32 = amax.to(tl.float32)
        if aout is not None:
            if aout != 0:
                tl.store(aout.to(tl.pointer_type(tl.float32)), amax32)
        sc = tl.math.div_rn(1.0, tl.where(amax32 > 0, amax32, 1.0)) * fmax.to(tl.float32)
        scale = tl.where((amax32 > 0) & (sc < float("inf")), sc, 1.0)
        under = tl.zeros([], tl.float64)
        over = tl.zeros([], tl.float64)
    if smode == SCALE_NONE_C:
        scale = tl.full([], nan, tl.float32)
        under = tl.full([], nan, tl.float64)
        over = tl.full([], nan, tl.float64)
    scale64 = scale.to(tl.float64)
    if not HIST:
        hist = tl.full([64], nan, tl.float64)
    # into the destination row: overwrite, or merge as torch_path.merge(old, new) does
    parts = tl.full([], 1.0, tl.float64)
    write_all = tl.full([], 1, tl.int32)
    if merge != 0:
        o_parts = tl.load(dst + 0)
        o_numel = tl.load(dst + 1)
        if o_parts != 0:
            parts = o_parts + 1.0
            if o_numel != 0:
                if numel == 0:  # an empty tensor: the row stays, only parts add up
                    write_all = 0
                else:
                    an, am, a2, a3, a4 = _chan(tl.load(dst + 2), tl.load(dst + 10), tl.load(dst + 11),
                                               tl.load(dst + 12), tl.load(dst + 13), an, am, a2, a3, a4)
                    numel += o_numel
                    nonfin += tl.load(dst + 3)
                    zeros += tl.load(dst + 4)
                    nonzero += tl.load(dst + 5)
                    outl += tl.load(dst + 6)
                    under += tl.load(dst + 7)
                    over += tl.load(dst + 8)
                    amax = tl.maximum(amax, tl.load(dst + 9))
                    os_ = tl.load(dst + 14)
                    scale64 = tl.where((scale64 != scale64) | (os_ != os_), nan, tl.minimum(scale64, os_))
                    oh = tl.load(dst + 15)
                    ahm = tl.where(ahm != ahm, oh, tl.where(oh != oh, ahm, tl.maximum(ahm, oh)))
                    hist += tl.load(dst + 16 + bins, mask=bins < _NB, other=0.0)
    tl.store(dst + 0, parts)
    if write_all != 0:
        tl.store(dst + 1, numel)
        tl.store(dst + 2, an)
        tl.store(dst + 3, nonfin)
        tl.store(dst + 4, zeros)
        tl.store(dst + 5, nonzero)
        tl.store(dst + 6, outl)
        if not LATER:
            tl.store(dst + 7, under)
        elif smode != SCALE_CAST_C:
            tl.store(dst + 7, under)
        tl.store(dst + 8, over)
        tl.store(dst + 9, amax)
        tl.store(dst + 10, am)
        tl.store(dst + 11, a2)
        tl.store(dst + 12, a3)
        tl.store(dst + 13, a4)
        tl.store(dst + 14, scale64)
        tl.store(dst + 15, ahm)
        tl.store(dst + 16 + bins, hist, mask=bins < _NB)


@triton.jit
def _done(part_base, stride, ctr, nwork, dst, merge, smode, s, fmax, uthr, ahm, hist, HIST: tl.constexpr, tr=None,
          TRACE: tl.constexpr = False, NARROW: tl.constexpr = False, aout=None):
    """Add this program's histogram to the tensor's (``ctr[1:65]``) and count the program in (``ctr[0]``);
    the last one of its tensor writes the row and resets both. ``NARROW``: the caller knows that up to
    P_BLOCK partials hold fewer than 2**31 elements (``_narrow``)."""
    if HIST:
        tl.atomic_add(ctr + 1 + tl.arange(0, 64), hist.to(tl.int64), sem="relaxed", scope="gpu")
    tl.debug_barrier()
    prev = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
    if prev == nwork - 1:
        _stamp(tr, 7, TRACE)
        _finalize(part_base, stride, nwork, ctr, dst, merge, smode, s, fmax, uthr, ahm, HIST, _PB, tr, TRACE,
                  NARROW, aout)
        tl.atomic_xchg(ctr, 0, sem="relaxed", scope="gpu")


@triton.jit
def merge_kernel(mtab_ptr, trace_ptr, HIST: tl.constexpr, PB: tl.constexpr):
    """One program per row of the table: the partials a ``LATER`` launch of ``stats_kernel`` left for a tensor,
    merged into its row (``_finalize``), with the histograms the programs stored beside them."""
    row = mtab_ptr + tl.program_id(0).to(tl.int64) * _MTABW
    stride = tl.load(row + 1)
    part = tl.load(row + 0).to(tl.pointer_type(tl.float64)) + tl.load(row + 2)
    nwork = tl.load(row + 3)
    dst = tl.load(row + 4).to(tl.pointer_type(tl.float64))
    smode = tl.load(row + 6)
    fmt = tl.load(row + 7)
    uthr = tl.where(fmt == 1, 2.0 ** -10, 2.0 ** -17).to(tl.float32)
    fmax = tl.where(fmt == 1, 448.0, 57344.0)
    hist = tl.zeros([64], tl.float64)
    if HIST:
        HB: tl.constexpr = 16
        acc = tl.zeros([HB, 64], tl.float64)
        i = tl.arange(0, HB)[:, None]
        bins = tl.arange(0, 64)[None, :]
        for b0 in range(0, nwork, HB):
            acc += tl.load(part + (_PW + bins) * stride + b0 + i, mask=b0 + i < nwork, other=0.0)
        hist = tl.sum(acc, 0)
    _finalize(part, stride, nwork, mtab_ptr, dst, tl.load(row + 5), smode, tl.full([], float("nan"), tl.float32),
              fmax, uthr, tl.load(part + P_AHM * stride), HIST, PB, trace_ptr, False, False, None, hist, True)
