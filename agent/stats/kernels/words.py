"""bf16 two elements at a time (the standalone kernel's fast path for bf16, and the fused casts'): counts,
outliers and amax from the 32-bit words without unpacking."""

import triton
import triton.language as tl

from .consts import _JOINT
from .hist import _erow_add, _htab_add

# ---- bf16 two at a time (the standalone kernel's fast path; with the histogram only through ``htab``) ----
# A 32-bit word holds two bf16: the high half is the fp32 of the odd element with its low 16 bits zero, the low
# half shifted up is the even one. Counts of |x| above a threshold t take both halves at once: in a half,
# |x| + (0x7FFF - t) reaches bit 15 exactly when |x| > t, and no carry crosses into the other half. Outliers
# use the sign of a bf16 difference, hi - x or x - lo, which is negative exactly when x is beyond the bound
# (a difference rounds to zero only when it is zero, and keeps its sign when flushed). The amax is a bf16x2
# max. Every count and the amax come out of the words without unpacking them; only the moments unpack.


@triton.jit
def _bf16_down(v):
    """The bits (0..0xFFFF) of the largest bf16 <= v (fp32); +0 for a zero of either sign."""
    b = v.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where(((b & 0xFFFF) != 0) & (b < 0), t + 0x10000, t)  # negative: truncation went up
    t = tl.where(v == 0, 0, t)
    return (t >> 16) & 0xFFFF


@triton.jit
def _bf16_up(v):
    """The bits of the smallest bf16 >= v (fp32); -0 for a zero of either sign."""
    b = v.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where(((b & 0xFFFF) != 0) & (b >= 0), t + 0x10000, t)
    t = tl.where(v == 0, -2147483648, t)
    return (t >> 16) & 0xFFFF


@triton.jit
def _pair(h):
    """A bf16's 16 bits in both halves of a word."""
    return h | (h << 16)


@triton.jit
def _bf16x2_max(a, b):
    if _JOINT:
        return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:  # both non-negative here (|x| bits): the integer order of the halves
        hi = tl.maximum(a & -65536, b & -65536)
        lo = tl.maximum(a & 0xFFFF, b & 0xFFFF)
        return hi | lo


@triton.jit
def _bf16x2_sub(a, b):
    """a - b per bf16 half, rounded to nearest; in the interpreter only each half's sign bit (what the counts
    read) is computed, from an fp32 compare."""
    if _JOINT:
        return tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        ah = (a & -65536).to(tl.float32, bitcast=True)
        al = (a << 16).to(tl.float32, bitcast=True)
        bh = (b & -65536).to(tl.float32, bitcast=True)
        bl = (b << 16).to(tl.float32, bitcast=True)
        return tl.where(ah < bh, -2147483648, 0) | tl.where(al < bl, 0x8000, 0)


@triton.jit
def _count_bit15(acc, a, b):
    """acc plus bit 15 of (a | b) per half, at bits 0 and 16 (one logic op, a shift and an add on hardware)."""
    if _JOINT:
        return tl.inline_asm_elementwise(
            "{.reg .b32 t; lop3.b32 t, $2, $3, 0x80008000, 0xA8; shr.u32 t, t, 15; add.u32 $0, $1, t;}",
            "=r,r,r,r", [acc, a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return acc + _halves((a | b) & -2147450880)


@triton.jit
def _halves(m):
    """Per half, bit 15 of m as 0/1 at bits 0 and 16 (a logical shift: a lane's sum stays per half)."""
    return (m.to(tl.uint32, bitcast=True) >> 15).to(tl.int32, bitcast=True)


@triton.jit
def tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz, pout, ht=None, HTF: tl.constexpr = False,
                 UCOUNT: tl.constexpr = True):
    """One [R, 4] tile of words. ``pu``/``pnz``/``pout``: per-half counts of |x| above the underflow
    threshold, of nonzeros and of outliers; ``amw`` the per-half amax bits (words); with a histogram table
    ``ht`` (the exponent-row table where ``HTF``), both halves' exponents counted in it."""
    if HTF:
        _erow_add(ht, w & 0x7F80)
        _erow_add(ht, (w >> 16) & 0x7F80)
    elif ht is not None:
        _htab_add(ht, w & 0x7F80)
        _htab_add(ht, (w >> 16) & 0x7F80)
    amw = _bf16x2_max(amw, w & 0x7FFF7FFF)
    # a column of words at a time, each sum a chain of adds and FMAs: a tree sum over the row (tl.sum) cost a
    # multiply and an add more per element for M3 and M4
    R: tl.constexpr = w.shape[0]
    we, wo = tl.split(tl.reshape(w, [R, 2, 2]))  # words 0, 2 and 1, 3 of each row
    w0, w2 = tl.split(we)
    w1, w3 = tl.split(wo)
    s1, s2, s3, s4, pu, pnz, pout = _word(w0, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, pu, pnz, pout, UCOUNT)
    s1, s2, s3, s4, pu, pnz, pout = _word(w1, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, pu, pnz, pout, UCOUNT)
    s1, s2, s3, s4, pu, pnz, pout = _word(w2, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, pu, pnz, pout, UCOUNT)
    s1, s2, s3, s4, pu, pnz, pout = _word(w3, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, pu, pnz, pout, UCOUNT)
    return s1, s2, s3, s4, amw, pu, pnz, pout


@triton.jit
def _word(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, pu, pnz, pout, UCOUNT: tl.constexpr = True):
    """Power sums of the shifted, scaled pair of bf16 in each word of ``w`` and its counts, added in order (the
    count above the underflow threshold only where ``UCOUNT``)."""
    v = w & 0x7FFF7FFF
    if UCOUNT:
        pu = _count_bit15(pu, v + ku, 0)
    pnz = _count_bit15(pnz, v + 0x7FFF7FFF, 0)
    pout = _count_bit15(pout, _bf16x2_sub(hi2, w), _bf16x2_sub(w, lo2))
    dl = tl.fma((w << 16).to(tl.float32, bitcast=True), p, ncp)
    dh = tl.fma((w & -65536).to(tl.float32, bitcast=True), p, ncp)
    dl2 = dl * dl
    dh2 = dh * dh
    return (s1 + dl + dh, s2 + dl2 + dh2, tl.fma(dh2, dh, tl.fma(dl2, dl, s3)),
            tl.fma(dh2, dh2, tl.fma(dl2, dl2, s4)), pu, pnz, pout)


@triton.jit
def _halves_sum(c):
    return (c & 0xFFFF) + ((c.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True))


@triton.jit
def packed_setup(tu, lo, hi, R: tl.constexpr):
    """The word loop's constants (``ku``, ``lo2``, ``hi2``: the underflow threshold bits ``tu`` and the outlier
    bounds as bf16x2 words) and its zero accumulators of R rows (``amw``, ``pu``, ``pnz``, ``pout``)."""
    ku = _pair(0x7FFF - tl.minimum(tl.maximum(tu >> 16, -1), 0x7FFF))  # tu < 0: every |x| counts
    hi2 = _pair(tl.where(hi == hi, _bf16_down(hi), 0x7F80))
    lo2 = _pair(tl.where(lo == lo, _bf16_up(lo), 0xFF80))
    zi = tl.zeros([R], tl.int32)
    return ku, lo2, hi2, tl.zeros([R, 4], tl.int32), zi, zi, zi


@triton.jit
def packed_fold(n, amw, pu, pnz, pout, am, cu, cz, cout):
    """``tile_fast``'s accumulators (am, cu, cz, cout: [R]) with the word loop's added, ``n`` elements per row
    (per lane of R). The word loop counted |x| above the underflow threshold and nonzeros; the fast path keeps minus
    those counts and minus the zeros. It counts no overflow: the caller checks the amax against that
    threshold."""
    cu -= _halves_sum(pu)
    cz -= n - _halves_sum(pnz)
    cout += _halves_sum(pout)
    amp = tl.max(tl.maximum(amw & 0xFFFF, (amw >> 16) & 0x7FFF) << 16, 1).to(tl.float32, bitcast=True)
    return tl.maximum(am, amp), cu, cz, cout
