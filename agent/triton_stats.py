"""All SPEC section-4 statistics of a tensor in one read, with Triton: the fast path of ``device_stats``.

The launcher ``rows`` produces, for a list of tensors (bf16, fp16 or fp32, any sizes, in ONE launch), the
rows ``device_stats.partials`` produces, in its layout (``merge``, ``to_moments`` and ``Moments.to_stats``
work unchanged), written into a given ``[R, WIDTH]`` fp64 buffer at given rows, optionally merged into
what is there (the agent's step buffer: a micro-batch merges into its slot). No host sync: the tensor table
goes to the device in one non-blocking copy from a persistent pinned staging ring (``_Staging``: a buffer
is reused only once its last copy's event has completed, polled, never waited on); nothing is read back.
bench/stats_check.py checks this under torch's sync debug mode (rows, fused kernels, an agent step).

Hot loop (standalone kernel): tiles are [ROWS, 16 bytes] (8 bf16/fp16 or 4 fp32 per row); a thread owns
whole rows, so the loads are 16 bytes wide (the launcher makes every address 16-byte aligned, cloning a
misaligned view) and the per-row sums are a thread's own adds: the accumulators are [ROWS], nothing
crosses threads inside the loop. bf16 goes through its words instead, two elements each (``_tile_bf16x2``:
counts, outliers and amax without unpacking; with the histogram, only on hardware, where it is a shared-memory
table: ``_htab``). The kernel is launched with a register
cap (``MAXNREG``, ``MAXNREG_FP32``): its cold code (merge, careful path) otherwise drives ptxas to 153-255
registers, one program per SM.

Scheme (one kernel):
  * Work: every tensor is cut into chunks (one size per launch, sized to one wave of programs on a GPU:
    ``_chunk_elems``); a program per chunk. A table row per tensor holds its address, dtype, size, chunk,
    its first chunk's program, the scale/center/history pointers or values and where its row goes, so tensors
    of different dtypes and sizes share a launch; a program finds its tensor by bisection over the rows' first
    chunks (the host's work is per tensor, not per chunk).
  * Per program, one read of its chunk: amax, a 64-bin histogram of the fp32 exponent (the 56 log2 binades
    of ``wire``, plus zeros and non-finite: zero/nonzero/non-finite counts come from it), underflow and
    overflow counts, outlier count, and the power sums of ``d = (x - c) * p`` in fp32 per lane, where the
    shift ``c`` is the mean of the chunk's first tile and ``p`` a power of two from its amax (exact
    scaling: no fp32 under/overflow of d**4 for tiny or large tensors). The per-program sums become central
    moments in fp64. If the shift was poor (|mean - c| > std/4, where fp32 power sums would cancel), or the
    chunk holds a NaN/Inf or values whose 4th power overflows fp32, the program re-reads its chunk on a
    careful path: two passes in fp64 with masks, as the oracle does. Rare by construction; exact always.
  * The last program of a tensor (an atomic counter per tensor) merges the tensor's per-program partials in
    fp64 (Pebay's formulas applied at once about the first partial's mean, then shifted to the grand mean:
    ``_finalize``) and writes the row. No second launch. Histograms skip the partials: each program adds its
    bins to the tensor's counter row atomically. A current-scaled cast's launch (``cast_row``) leaves that merge
    to a later launch for many rows instead (``merge_later``): the cast waits for no last program.
    So do the consumer kernels of trainer/kernels and the agent's launches of rows with no scale known before the
    read: their rows are complete after the next ``flush_deferred``.

Underflow/overflow are exact counts of ``fl32(|x| * s) <= fmt.underflow_threshold`` and
``> fmt.overflow_threshold`` when the scale ``s`` is known before the read (a scale tensor or number: delayed
scaling, the trainer's real scale, the fused quantize kernels): monotonicity of the fp32 product turns each
test into one integer comparison of |x|'s bits against a threshold found by bisection per program.
Current scaling (s = max / amax of this very tensor) is only known after the read: then ``overflow`` is 0
(exact: with s = max/amax nothing saturates), the scale is derived from the merged amax, and ``underflow``
is derived from the log2 histogram: exact for the binades below the threshold's binade, plus that binade's
count times the fraction of it below the threshold (values taken as uniform within it). The error is at
most that one binade's count; without a histogram (``hist=False``) underflow is absent (NaN). The fused
quantize kernels know the scale before the cast and are always exact. So is ``cast_row``, this kernel in place of a
current-scaled cast's amax pass: it hands the merged amax to the cast, which counts the underflow at its scale.

Outliers (|x - mean| > k * std) need the mean and std before the read. They come from the caller as a
``center`` = (mean, std) pair (numbers, or a device fp64 tensor of 2): the agent passes the previous
reporting step's mean and std of the same (layer, site); before one exists (std NaN) no outlier is counted.
The count against the given center is exact (the oracle's ``outlier_center``): x > round_down32(mean + k std)
or x < round_up32(mean - k std). ``device_stats.partials(..., outlier_center=)`` is the reference.

Importing this module never needs Triton (``available()`` says whether it can run).
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from . import device_stats as ds
from .formats import by_name
from .wire import LOG2_HIST_BINS, LOG2_HIST_LO

try:  # the agent must stay importable without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# The most elements per program of the standalone kernel (a multiple of 8; at most 16383 tiles: the bf16 words
# path counts in 16-bit halves); on the CPU, the chunk.
CHUNK = 1 << 20
# On a GPU the launcher sizes chunks so that a launch is one wave of programs, one per slot (a program's place on an
# SM at the register cap): a partial last wave leaves most SMs idle, and set-up and merge are paid per program.
NUM_WARPS = 8
ROWS = 512  # rows of a [ROWS, 16 bytes] tile: ROWS / (32 * NUM_WARPS) 16-byte loads per thread per iteration
# Register cap (ptxas): uncapped, the cold code (finalize, careful path, threshold bisection) took 153-255
# registers, one program (8 warps) per SM. At 128 (2 programs per SM) the bf16 words path ran at 0.71 of copy
# bandwidth on 256 MiB against 0.58 at 80 (3 programs per SM, cold code spilling); fp32 alone ran best at 80
# (0.83 against 0.76): a launch of fp32 tensors only takes MAXNREG_FP32 (H200, bench/stats_kernel_time.py).
# The log2 histogram in a shared-memory table (``_htab``) on hardware: fewer instructions per element than
# tl.histogram's ballots. The interpreter has no shared memory and counts with tl.histogram.
SMEM_HIST = not INTERPRET
MAXNREG = 128
MAXNREG_FP32 = 80
P_BLOCK = 512  # partials the finalize step reads at once (2 per lane with 8 warps); more: blocks of this size
MAX_TENSORS = 4096  # per launch (the size of the per-device counter buffer)
PW = 16  # fp64 fields of a per-program partial (the histogram goes to the counter buffer's row)
CTRW = 1 + 64  # int64 fields of a tensor's counter row: programs done, then its histogram's 64 bins
TABW = 20  # int64 fields of a tensor's table row
MTABW = 8  # int64 fields of a row of ``_merge_kernel``'s table (``_MROW``)
_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}

# per-program partial layout
_P_N, _P_NUMEL, _P_NONFIN, _P_ZEROS, _P_OUTL, _P_UNDER, _P_OVER, _P_AMAX, _P_MEAN, _P_M2, _P_M3, _P_M4, _P_AHM = \
    range(13)  # _P_AHM: the history max, in a tensor's first partial, where a later launch merges (``_merge_kernel``)
# table row layout (int64; float fields bit-cast): the scale/center/history are a device pointer when
# the *_ADDR field is non-zero, else the inline value
(_T_ADDR, _T_NUMEL, _T_CODE, _T_FIRST, _T_NWORK, _T_DST, _T_MERGE, _T_SMODE, _T_SCALE_ADDR, _T_SCALE,
 _T_CENTER_ADDR, _T_MEAN, _T_STD, _T_AHM_ADDR, _T_AHM, _T_FMT, _T_K, _T_CHUNK, _T_AMAX_OUT) = range(19)
# no format; scale known; s = max/amax of this tensor; the same, for a tensor whose cast follows (``cast_row``)
SCALE_NONE, SCALE_GIVEN, SCALE_CURRENT, SCALE_CAST = 0, 1, 2, 3


def available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton path can run for tensors on ``device`` (CUDA, or the CPU under TRITON_INTERPRET)."""
    if triton is None:
        return False
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type == "cuda":
        return torch.cuda.is_available() or INTERPRET
    return dev.type == "cpu" and INTERPRET


def supports(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPE_CODE


_FMT_CODES = {"e4m3": 1, "e5m2": 2}
_FMT_CONST = {1: by_name("e4m3"), 2: by_name("e5m2")}


if triton is not None:
    class Const(tl.constexpr):
        """A module-level constant the kernels read. On every launch Triton checks each global a kernel read
        against the value it compiled with, by ``!=``; ``tl.constexpr`` answers that with a new constexpr object
        (with the ~27 of the standalone kernel, ~10 us of host time per launch). This answers a plain bool."""

        def __ne__(self, other):
            return self.value != (other.value if isinstance(other, tl.constexpr) else other)

    # the sum of a row of the shared histogram table (32 lanes' uint32 cells from address $1) into $0
    _HTAB_ROW_SUM = Const("{.reg .b32 a, b, c, d; mov.u32 $0, 0;" + "".join(
        f" ld.shared.v4.u32 {{a, b, c, d}}, [$1+{16 * i}]; add.u32 $0, $0, a; add.u32 $0, $0, b;"
        f" add.u32 $0, $0, c; add.u32 $0, $0, d;" for i in range(8)) + "}")
    # the same for the row at byte offset $1 of the exponent-row table (``_erows``)
    _EROW_SUM = Const("{.reg .b32 p, a, b, c, d; mov.u32 p, fp8mon_erows; add.u32 p, p, $1; mov.u32 $0, 0;" + "".join(
        f" ld.shared.v4.u32 {{a, b, c, d}}, [p+{16 * i}]; add.u32 $0, $0, a; add.u32 $0, $0, b;"
        f" add.u32 $0, $0, c; add.u32 $0, $0, d;" for i in range(8)) + "}")
    _LO = Const(LOG2_HIST_LO)
    _NB = Const(LOG2_HIST_BINS)
    _BIN_ZERO = Const(LOG2_HIST_BINS)  # 56
    _BIN_NONFIN = Const(LOG2_HIST_BINS + 1)  # 57
    _BIN_DUMP = Const(63)
    _NAN_BITS = Const(0x7FC00000)
    _INF_BITS = Const(0x7F800000)
    # partials per block in the finalize step (smaller in the interpreter, which runs a reduction per element)
    _PB = Const(8 if INTERPRET else P_BLOCK)
    # multi-operand reductions (one round through shared memory for many fields) on hardware only: the
    # interpreter runs a reduction with a combine function as a Python call per element
    _JOINT = Const(not INTERPRET)
    _SMEM_HIST = Const(SMEM_HIST)
    _CTRW = Const(CTRW)
    _MTABW = Const(MTABW)
    _PW = Const(PW)
    _ROW_UNDER = Const(ds.UNDERFLOW)
    _TABW = Const(TABW)
    _WIDTH = Const(ds.WIDTH)
    SCALE_NONE_C = Const(SCALE_NONE)
    SCALE_GIVEN_C = Const(SCALE_GIVEN)
    SCALE_CURRENT_C = Const(SCALE_CURRENT)
    SCALE_CAST_C = Const(SCALE_CAST)
    # the layouts, as constexprs for the kernels (they index Python lists as well)
    (_P_N, _P_NUMEL, _P_NONFIN, _P_ZEROS, _P_OUTL, _P_UNDER, _P_OVER, _P_AMAX, _P_MEAN, _P_M2, _P_M3,
     _P_M4, _P_AHM) = (Const(v) for v in range(13))
    (_T_ADDR, _T_NUMEL, _T_CODE, _T_FIRST, _T_NWORK, _T_DST, _T_MERGE, _T_SMODE, _T_SCALE_ADDR, _T_SCALE,
     _T_CENTER_ADDR, _T_MEAN, _T_STD, _T_AHM_ADDR, _T_AHM, _T_FMT, _T_K,
     _T_CHUNK, _T_AMAX_OUT) = (Const(v) for v in range(19))

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
    def _outlier_bounds(mean, std, k):
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

    # ---- the log2 histogram in shared memory (hardware only) ---------------------------------------
    # ``tl.histogram`` lowers to a warp ballot per bit of the bin index (6 for 64 bins) and two popcounts per
    # lane, ~22 instructions per element, and a round through shared memory with barriers per call. Here each
    # lane adds 1 to its own cell (bin, lane) of a [57, 32] uint32 table in static shared memory (``red.shared.add``;
    # row 56 is where a partial tile's masked lanes count): the cell's byte offset is the fp32 exponent field masked
    # in place (e * 128 = bits >> 16 & 0x7F80) and clamped to the binades' rows, so an element costs a shift, a
    # logic op, two min/max and the atomic, and the lanes of a warp always hit 32 different banks. Zeros land in bin
    # 0 with the subnormals; ``_htab_bins`` moves their count (taken from the bits anyway) to bin 56. A non-finite
    # value lands in bin 55, but no fast path keeps one: it sends the program to the careful path, whose histogram
    # is ``tl.histogram``'s. The table is 8 KiB: a kernel's own shared memory plus it must stay within the 48 KiB
    # a launch gets without opting in (32 KiB, a row per exponent, did not in quantize_transpose's cast).
    # The interpreter has no inline PTX: there, ``ht`` is None and ``tl.histogram`` counts.

    @triton.jit
    def _htab():
        """This program's table, zeroed, as the address (shared window) of its lane's cell for exponent 0 (bin
        -87: only clamped offsets are added to it). Declared once per kernel: a second call site is a ptxas error
        (a duplicate definition), not a second table."""
        base = tl.inline_asm_elementwise(".shared .align 128 .b32 fp8mon_htab[2048]; mov.u32 $0, fp8mon_htab;",
                                         "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        _zero_shared(base, 512)
        return base + _lane() * 4 - (127 + _LO) * 128

    @triton.jit
    def _zero_shared(base, WORDS: tl.constexpr):
        """``WORDS`` 16-byte words of shared memory from ``base`` set to 0 by the program's threads, then a barrier."""
        q = tl.arange(0, WORDS)
        tl.inline_asm_elementwise("{.reg .b32 z; mov.b32 z, 0; st.shared.v4.b32 [$1], {z, z, z, z};} mov.u32 $0, 0;",
                                  "=r,r", [base + q * 16], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()

    @triton.jit
    def _lane():
        return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _htab_cell(e128):
        """The byte offset, from ``_htab``'s address, of the row of exponent field ``e128`` (the exponent at bits
        7-14): its binade's, clamped to the table's 56 bins."""
        return tl.minimum(tl.maximum(e128, (127 + _LO) * 128), (126 + _LO + _NB) * 128)

    @triton.jit
    def _htab_add(ht, e128):
        """One count in the lane's cell of the binade of exponent field ``e128``."""
        _htab_red(ht, _htab_cell(e128))

    @triton.jit
    def _htab_dump(ht, mask, e128):
        """``_htab_add`` where ``mask``, else one count in the dump row."""
        _htab_red(ht, tl.where(mask, _htab_cell(e128), (127 + _LO + _NB) * 128))

    @triton.jit
    def _htab_red(ht, cell):
        tl.inline_asm_elementwise("red.shared.add.u32 [$1], 1; mov.u32 $0, 0;", "=r,r", [ht + cell], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _htab_bins(ht, zeros):
        """The table as the 64 bins of ``_bins`` (int32), after every lane's adds: each bin's 32 cells summed, and
        ``zeros`` moved from bin 0 to bin 56."""
        tl.debug_barrier()
        j = tl.arange(0, 64)
        row0 = ht - (ht & 127) + (127 + _LO) * 128  # lane 0's cell of bin 0 (128-byte rows, 128-byte aligned)
        per_bin = tl.inline_asm_elementwise(_HTAB_ROW_SUM, "=r,r", [row0 + tl.minimum(j, _NB - 1) * 128],
                                            dtype=tl.int32, is_pure=False, pack=1)
        return _table_hist(j, per_bin, zeros)

    @triton.jit
    def _table_hist(j, per_bin, zeros):
        """The 64 bins ``j`` of ``_bins`` from a table's per-bin counts (valid below ``_NB``), ``zeros`` moved from bin 0
        (with the subnormals) to bin 56."""
        hist = tl.where(j < _NB, per_bin, 0)
        return hist + tl.where(j == _BIN_ZERO, zeros, 0) - tl.where(j == 0, zeros, 0)

    # ---- the standalone kernel's table: a row per exponent ------------------------------------------
    # 256 rows of 32 lanes (32 KiB), row e for the exponent field e: an element's cell is its exponent field masked
    # in place or'ed with its lane's offset, one logic op before the atomic (the table's address is folded into the
    # atomic's), where the clamped table pays two min/max and an add more. The rows become bins once, at the end
    # (``_erow_bins``). Row 255 (Inf/NaN, which no fast path keeps) takes a partial tile's masked lanes.

    @triton.jit
    def _erows():
        """This program's exponent-row table, zeroed, as its lane's byte offset within a row (``_erow_add`` adds the
        table's address). Declared once per kernel, as ``_htab``."""
        base = tl.inline_asm_elementwise(".shared .align 128 .b32 fp8mon_erows[8192]; mov.u32 $0, fp8mon_erows;",
                                         "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        _zero_shared(base, 2048)
        return _lane() * 4

    @triton.jit
    def _erow_add(ht, e128):
        """One count in the lane's cell of the row of exponent field ``e128`` (the exponent at bits 7-14)."""
        tl.inline_asm_elementwise("{.reg .b32 a; mov.u32 a, fp8mon_erows; add.u32 a, a, $1; red.shared.add.u32 [a], 1;}"
                                  " mov.u32 $0, 0;", "=r,r", [e128 | ht], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _erow_bins(ht, zeros):
        """The exponent rows as the 64 bins of ``_bins`` (int32), after every lane's adds: each row's 32 cells summed,
        the rows below and above the binades added to the first and last bin, row 255 (masked lanes) left out, and
        ``zeros`` moved from bin 0 to bin 56. The bins are summed in the first 64 cells (read by then)."""
        tl.debug_barrier()
        r = tl.arange(0, 256)
        per_row = tl.inline_asm_elementwise(_EROW_SUM, "=r,r", [r * 128], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        j = tl.arange(0, 64)
        tl.inline_asm_elementwise("{.reg .b32 a; mov.u32 a, fp8mon_erows; add.u32 a, a, $1; st.shared.u32 [a], 0;}"
                                  " mov.u32 $0, 0;", "=r,r", [j * 4], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        b = tl.minimum(tl.maximum(r - (127 + _LO), 0), _NB - 1)
        tl.inline_asm_elementwise("{.reg .b32 a; mov.u32 a, fp8mon_erows; add.u32 a, a, $1; "
                                  "red.shared.add.u32 [a], $2;} mov.u32 $0, 0;", "=r,r,r",
                                  [b * 4, tl.where(r < 255, per_row, 0)], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        per_bin = tl.inline_asm_elementwise("{.reg .b32 a; mov.u32 a, fp8mon_erows; add.u32 a, a, $1; "
                                            "ld.shared.u32 $0, [a];}", "=r,r", [j * 4], dtype=tl.int32,
                                            is_pure=False, pack=1)
        return _table_hist(j, per_bin, zeros)

    @triton.jit
    def _tile_fast(x, mask, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, amax, cu, co, cout, cz, hist,
                   HIST: tl.constexpr, HAS_MASK: tl.constexpr, RED: tl.constexpr = False, ht=None,
                   HTF: tl.constexpr = False):
        """Fast path (no NaN/Inf expected): fp32 power sums of the scaled shifted values per lane, counts
        as integer compares of |x|'s bits. ``cu``, ``co`` and ``cz`` hold *minus* the counts of |x| above the
        underflow threshold, above the overflow threshold and of zeros (``_fast_result`` turns them into
        counts): ``(t - bits) >> 31`` is -1 exactly when bits > t (bits >= 0, t >= -1: no wrap-around), two
        instructions where a compare-and-count took three (ptxas made it a conditional increment). Only a
        partial tile (``HAS_MASK``) pays for masks; its masked lanes are loaded as 0, which exceeds a threshold
        only when that is -1 (no scale, or an infinite one: ``_fast_result`` handles both), so only the zero and
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
    def _tile_sum(x, mask, acc, cnt, RED: tl.constexpr = False):
        """Careful pass 1: fp64 sum and count of the finite elements."""
        v = mask & (tl.abs(x) < float("inf"))
        return acc + _red(tl.where(v, x, 0.0).to(tl.float64), RED), cnt + _red(v.to(tl.int32), RED)

    @triton.jit
    def _tile_careful(x, mask, mean0, tu, to, lo, hi, t1, t2, t3, t4, amax, cu, co, cout, cz, cnf, hist,
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
    def _shift_of(x, mask):
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
    def _fast_result(n, c, p, tu, to, s1, s2, s3, s4, amax, cu, co, cout, cz, hist, HIST: tl.constexpr, ht=None,
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
    def _careful_result(n, mean0, t1, t2, t3, t4, amax, cu, co, cout, cz, cnf):
        nf = n.to(tl.float64)
        md, m2, m3, m4 = _central(nf, tl.sum(t1, 0), tl.sum(t2, 0), tl.sum(t3, 0), tl.sum(t4, 0))
        return (mean0 + md, m2, m3, m4, tl.max(amax, 0), tl.sum(cz, 0), tl.sum(cu, 0), tl.sum(co, 0),
                tl.sum(cout, 0), tl.sum(cnf, 0))

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
        # divisions at every level, made this serial tail, run by one program while the GPU idles, 25-45 us of a
        # 60-150 us kernel; about the grand mean, which needs a reduction first, it was two rounds, ~8.5 us.)
        # c0 is near the grand mean c: a chunk of n_i of N elements has n_i (mean_i - c)^2 <= N var, so
        # |c0 - c| <= std sqrt(N / n_0), and the shift back to c costs at most a few of fp64's 16 digits, the
        # partials holding fp32 sums. Up to PB partials (the usual case: a launch is about a wave of programs)
        # are read once into registers; more go in blocks (lane j: partials j, j + PB, ...).
        # The histogram is not in the partials: each program added it to the tensor's accumulator (``_done``);
        # this reads and clears it. ``LATER`` (``_merge_kernel``, after the read's launch and the cast that followed
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
        # into the destination row: overwrite, or merge as device_stats.merge(old, new) does
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

    # ---- one chunk: fast path, careful path ----------------------------------------------------------

    @triton.jit
    def _count_sum_max_count(n1, s1, m1, k1, n2, s2, m2, k2):
        return n1 + n2, s1 + s2, tl.maximum(m1, m2), k1 + k2

    @triton.jit
    def _shift_of2(x, mask):
        """``_shift_of`` of a 2-D first tile (its four reductions as one, per axis)."""
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

    # ---- bf16 two at a time (the standalone kernel's fast path; with the histogram only through ``_htab``) ----
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
    def _tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz, pout, ht=None, HTF: tl.constexpr = False,
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
        """``_tile_fast``'s accumulators (am, cu, cz, cout: [R]) with the word loop's added, ``n`` elements per row
        (per lane of R). The word loop counted |x| above the underflow threshold and nonzeros; the fast path keeps minus
        those counts and minus the zeros. It counts no overflow: the caller checks the amax against that
        threshold."""
        cu -= _halves_sum(pu)
        cz -= n - _halves_sum(pnz)
        cout += _halves_sum(pout)
        amp = tl.max(tl.maximum(amw & 0xFFFF, (amw >> 16) & 0x7FFF) << 16, 1).to(tl.float32, bitcast=True)
        return tl.maximum(am, amp), cu, cz, cout

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

    @triton.jit
    def _words(w, wb, woffs, nfull, TILE: tl.constexpr, p, ncp, ku, lo2, hi2, acc, ht, HTF: tl.constexpr,
               UCOUNT: tl.constexpr):
        """The word loop over ``nfull`` full tiles, the first (``w``) loaded: ``_tile_bf16x2``'s accumulators ``acc``
        with every tile's added."""
        s1, s2, s3, s4, amw, pu, pnz, pout = acc
        # two tiles per iteration, each loaded into the registers the other is not using: carrying one tile from an
        # iteration to the next cost a register move per word
        for k in range(0, nfull // 2):
            wn = tl.load(wb + (2 * k + 1) * (TILE // 2) + woffs)
            s1, s2, s3, s4, amw, pu, pnz, pout = _tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                              pout, ht, HTF, UCOUNT)
            w = tl.load(wb + tl.minimum(2 * k + 2, nfull - 1) * (TILE // 2) + woffs)
            s1, s2, s3, s4, amw, pu, pnz, pout = _tile_bf16x2(wn, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                              pout, ht, HTF, UCOUNT)
        if nfull % 2 == 1:  # w: the last full tile
            s1, s2, s3, s4, amw, pu, pnz, pout = _tile_bf16x2(w, p, ncp, ku, lo2, hi2, s1, s2, s3, s4, amw, pu, pnz,
                                                              pout, ht, HTF, UCOUNT)
        return s1, s2, s3, s4, amw, pu, pnz, pout

    @triton.jit
    def _chunk(base, n, s, smode, uthr, othr, lo, hi, tr, HIST: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
               TRACE: tl.constexpr, PACKED: tl.constexpr = False, ht=None, HTF: tl.constexpr = False):
        """Statistics of the ``n`` elements at ``base`` (16-byte aligned). Tiles are [R, V]: a thread holds whole
        rows of V contiguous elements (one 16-byte load), so the per-row sums inside the loop are a thread's own
        adds and the accumulators are [R] (no cross-thread work in the hot loop). The first tiles' loads are
        issued before the scalar set-up (threshold bisections, the shift's reductions), which runs while they
        are in flight; the loop keeps the next tile's loads in flight while it works on one (a depth of 2 did not
        run faster on the H200)."""
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
                    s1, s2, s3, s4, am, cu, co, cout, cz, h = _tile_fast(
                        x, m0, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, False, True, ht,
                        HTF)
                    x = xn.to(tl.float32)
            _stamp(tr, 2, TRACE)
            if nfull < ntiles:
                mt = nfull * TILE + offs < n
                x = tl.load(base + nfull * TILE + offs, mask=mt, other=0.0).to(tl.float32)
                s1, s2, s3, s4, am, cu, co, cout, cz, h = _tile_fast(
                    x, mt, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, True, True, ht, HTF)
            ok, mean, m2, m3, m4, amax, zeros, under, over, outl, hist = _fast_result(
                n, c, p, tu, to, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, ht, HTF)
            if PACKED:  # an element above the overflow threshold: the careful path counts them
                ok = ok & ((to < 0) | (amax.to(tl.int32, bitcast=True) <= to))
        if not ok:  # NaN/Inf, fp32 overflow of the power sums or a poor shift: two exact fp64 passes
            acc = tl.zeros([R], tl.float64)
            cnt = zi
            for k in range(0, ntiles):
                mt = k * TILE + offs < n
                x = tl.load(base + k * TILE + offs, mask=mt, other=0.0).to(tl.float32)
                acc, cnt = _tile_sum(x, mt, acc, cnt, True)
            nfin = tl.sum(cnt, 0)
            mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
            zd = tl.zeros([R], tl.float64)
            t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, zf, zi, zi, zi, zi, zi, \
                tl.zeros([64], tl.int32)
            for k in range(0, ntiles):
                mt = k * TILE + offs < n
                x = tl.load(base + k * TILE + offs, mask=mt, other=0.0).to(tl.float32)
                t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = _tile_careful(
                    x, mt, mean0, tu, to, lo, hi, t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h, HIST, True)
            mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin = _careful_result(
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
    def _stats_kernel(tab_ptr, ntab, part_ptr, ctr_ptr, dst_ptr, trace_ptr, HIST: tl.constexpr, R: tl.constexpr,
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
        lo, hi = _outlier_bounds(cmean, cstd, _f64(tl.load(row + _T_K)))
        epoch_ptr = tl.load(row + _T_AMAX_OUT).to(tl.pointer_type(tl.int64))
        epoch = tl.zeros([], tl.int64)
        if LATER:
            if smode == SCALE_CAST_C:  # loaded now: its latency passes under the read
                epoch = tl.load(epoch_ptr + 1)
        n = (end - start).to(tl.int32)  # <= the chunk; the launcher makes every address 16-byte aligned
        if HIST and _SMEM_HIST:  # the standalone kernel's table: a row per fp32 exponent, no clamp per element
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
        if LATER:  # the rows are merged by a later launch (``_merge_kernel``): no counter, no last program here
            if smode == SCALE_CAST_C:  # the amax to the cast, through the epoch words (``epoch_words``)
                tl.atomic_max(epoch_ptr, ((epoch + 1) << 32) | amax.to(tl.int32, bitcast=True).to(tl.int64),
                              sem="relaxed", scope="gpu")
            if HIST:
                tl.store(part_ptr + w + (_PW + tl.arange(0, 64)) * tl.num_programs(0), hist.to(tl.float64))
            if w == first:
                tl.store(part_ptr + w + _P_AHM * tl.num_programs(0), ahm)
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

    @triton.jit
    def _merge_kernel(mtab_ptr, trace_ptr, HIST: tl.constexpr, PB: tl.constexpr):
        """One program per row of the table: the partials a ``LATER`` launch of ``_stats_kernel`` left for a tensor,
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
                  fmax, uthr, tl.load(part + _P_AHM * stride), HIST, PB, trace_ptr, False, False, None, hist, True)


# ---- launcher ---------------------------------------------------------------------------------------

_counters: dict = {}
_counters_lock = threading.Lock()


def counters(device: torch.device) -> torch.Tensor:
    """The per-device int64 counter rows of the last-program-done merge (``[MAX_TENSORS, CTRW]``: programs
    done, histogram). Each launch leaves them at 0 again; launches on one stream are ordered, so they can
    share them."""
    key = (device.type, device.index)
    with _counters_lock:
        c = _counters.get(key)
        if c is None:
            c = _counters[key] = torch.zeros(MAX_TENSORS, CTRW, dtype=torch.int64, device=device)
        return c


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", float(v)))[0]


def _each(value, n: int, pair: bool = False) -> list:
    """A per-tensor argument as a list of n: a list of n is one value per tensor, anything else one for all.
    With ``pair`` (``center``) a 2-list of numbers is one (mean, std) for all, even for two tensors."""
    if isinstance(value, (list, tuple)) and len(value) == n and not (pair and n == 2 and _is_center_pair(value)):
        return list(value)
    return [value] * n


def _is_center_pair(v) -> bool:
    return all(isinstance(e, (int, float)) for e in v)


def _scale_of_history(ahm: float, fmt) -> float:
    """ds.scale_from_amax for a number: fp32(max / ahm), 1.0 for 0 or non-finite."""
    if not (ahm == ahm and 0 < ahm < float("inf")):
        return 1.0
    return _f32(fmt.max / ahm)


def rows(tensors: Sequence[torch.Tensor], *, fmt=None, scale=None, center=None, outlier_k: float = 6.0,
         amax_history_max=None, hist: bool = True, out: torch.Tensor | None = None,
         index: Sequence[int] | None = None, merge: Sequence[bool] | bool = False, later: bool = False) -> torch.Tensor:
    """The ``device_stats`` row of each tensor, all computed by one launch (per MAX_TENSORS tensors).

    Per-tensor arguments take one value for all or a list: ``fmt`` ("e4m3" | "e5m2" | None), ``scale``
    (None: current scaling, or delayed from ``amax_history_max`` when that is given; a number or a device
    tensor otherwise), ``center`` ((mean, std) numbers, or an fp64 device tensor of 2; None: no outliers),
    ``amax_history_max`` (number or device tensor). ``out`` (``[R, WIDTH]`` fp64, on the tensors' device)
    receives tensor i's row at ``index[i]``, merged into the row there where ``merge[i]``; without ``out``
    a new ``[len(tensors), WIDTH]`` tensor is returned (``out`` is returned either way).

    ``later``: the rows are merged by the next ``merge_later`` (``flush_deferred``), not by the launch's last program
    (no serial merge at the end of the launch); only for rows with no scale known before the read (no ``scale``, no
    ``amax_history_max``: the merge launch knows none)."""
    n = len(tensors)
    if n == 0:
        return out if out is not None else ds.empty(0)
    device = tensors[0].device
    if out is None:
        out = torch.empty(n, ds.WIDTH, dtype=torch.float64, device=device)
        index = range(n)
    assert out.dtype == torch.float64 and out.is_contiguous() and out.device == device
    index = list(index if index is not None else range(n))
    fmts, scales, centers = _each(fmt, n), _each(scale, n), _each(center, n, pair=True)
    ahms, merges = _each(amax_history_max, n), _each(merge, n)
    if later and any(s is not None for s in scales + ahms):
        raise ValueError("rows(later=True) takes no scale and no amax_history_max: the later merge knows no scale")
    for lo in range(0, n, MAX_TENSORS):
        hi = min(n, lo + MAX_TENSORS)
        _launch(tensors[lo:hi], fmts[lo:hi], scales[lo:hi], centers[lo:hi], float(outlier_k), ahms[lo:hi], hist,
                out, index[lo:hi], merges[lo:hi], device, later=later)
    return out


# A table row as bytes: int64 fields, the float ones (scale, center mean/std, history max, k) as fp64 bits, in
# the order of the _T_* indices (TABW fields; the last one unused).
_ROW = struct.Struct("<9qdq2dqdqd3q")
assert _ROW.size == TABW * 8


def _addressed(v: torch.Tensor, device, dtype, shape) -> torch.Tensor:
    """``v`` as a contiguous ``dtype`` tensor of ``shape`` on ``device`` that the kernel reads by address: ``v``
    itself when it already is one (no torch op: each costs microseconds of host time on CUDA)."""
    if v.device == device and v.dtype == dtype and v.shape == shape and v.is_contiguous():
        return v
    return v.detach().to(device=device, dtype=dtype).reshape(shape).contiguous()


_slot_count: dict = {}


def _slots(device: torch.device, cap: int) -> int:
    """Programs of the standalone kernel the GPU runs at once (SMs x programs per SM at register cap ``cap``)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), cap, NUM_WARPS)
    if key not in _slot_count:
        props = torch.cuda.get_device_properties(key[0])
        threads = 32 * NUM_WARPS
        per_sm = props.max_threads_per_multi_processor // threads
        if cap:
            per_sm = min(per_sm, props.regs_per_multiprocessor // (cap * threads))
        _slot_count[key] = props.multi_processor_count * max(1, per_sm)
    return _slot_count[key]


def _chunk_elems(numels: list[int], device: torch.device, cap: int) -> int:
    """Elements per program: CHUNK, or on a GPU the chunk that cuts tensors of ``numels`` elements into at most one
    program per slot, a whole number of [ROWS, 8] tiles (so every start stays 16-byte aligned). Each tensor's last
    chunk may be partial, so k tensors need up to k programs more than total / chunk: the chunk is sized for
    target - k programs (a second wave of a few programs costs more than smaller chunks)."""
    if device.type != "cuda":
        return CHUNK
    tile = ROWS * 8
    target = _slots(device, cap)
    k = len(numels)
    per = -(-sum(numels) // (target - k if 2 * k <= target else target))
    return max(tile, min(CHUNK, -(-per // tile) * tile))


_trace: list | None = None  # benches: a list to receive each launch's [programs, 16] int32 timer stamps


def _launch(tensors, fmts, scales, centers, k, ahms, hist, out, index, merges, device, aouts=None,
            later: bool = False) -> None:
    """``_launch_once`` of the tensors, in as few launches as keep their rows apart: a tensor whose row is already
    the destination of an earlier tensor of the launch goes to the next launch. (A launch's programs run in any order:
    two merges into one row in one launch would race, and the second micro-batch's row of a tensor, deferred with the
    first's, could be read before the first is written.)"""
    aouts = aouts or [None] * len(tensors)
    start, seen = 0, set()
    for i, dst in enumerate(index):
        if int(dst) in seen:
            _launch_once(tensors[start:i], fmts[start:i], scales[start:i], centers[start:i], k, ahms[start:i], hist,
                         out, index[start:i], merges[start:i], device, aouts[start:i], later)
            start, seen = i, set()
        seen.add(int(dst))
    _launch_once(tensors[start:], fmts[start:], scales[start:], centers[start:], k, ahms[start:], hist, out,
                 index[start:], merges[start:], device, aouts[start:], later)


def _launch_once(tensors, fmts, scales, centers, k, ahms, hist, out, index, merges, device, aouts=None,
                 later: bool = False) -> None:
    """One launch of ``_stats_kernel`` (``rows``). ``aouts``: per tensor None, or the fp32 device tensor that
    receives its finite amax; such a tensor's scale is that of its current-scaling cast (``cast_row``). ``later``:
    the rows are merged by the next ``merge_later``, and an amax goes to the ``epoch_words`` given
    as its ``aouts``."""
    keep = []  # what the device reads by address: alive until the launch is queued
    table = bytearray(_ROW.size * len(tensors))
    spans, modes = [], []  # per tensor (first program, programs), (scale mode, format code)
    nwork_total = 0
    # other dtypes are read as fp32 (below): a launch without 16-bit tensors is an fp32 launch
    cap = MAXNREG if any(x.dtype in (torch.bfloat16, torch.float16) for x in tensors) else MAXNREG_FP32
    chunk = _chunk_elems([x.numel() for x in tensors], device, cap)
    for i, x in enumerate(tensors):
        if x.device != device:
            raise ValueError("rows(): all tensors must be on one device")
        if x.dtype not in _DTYPE_CODE:
            x = x.detach().to(torch.float32)
        if not x.is_contiguous() or (x.data_ptr() % 16 and x.numel()):  # the kernel loads 16 aligned bytes
            x = x.detach().contiguous() if not x.is_contiguous() else x.detach().clone()
        keep.append(x)
        numel = x.numel()
        nwork = max(1, -(-numel // chunk))
        first, nwork_total = nwork_total, nwork_total + nwork
        fmt = None if fmts[i] is None else by_name(fmts[i])
        smode, s_addr, s_val = SCALE_NONE, 0, float("nan")
        ahm = ahms[i]
        ahm_addr, ahm_val = 0, float("nan")
        if isinstance(ahm, torch.Tensor):
            ahm = _addressed(ahm, device, torch.float32, ())
            keep.append(ahm)
            ahm_addr = ahm.data_ptr()
        elif ahm is not None:
            ahm_val = float(ahm)
        s = scales[i]
        if fmt is not None:
            if s is None and ahms[i] is not None:  # delayed scale from the history max, margin 0
                s = ds.scale_from_amax(ahm, fmt) if isinstance(ahm, torch.Tensor) else _scale_of_history(ahm_val, fmt)
            if aouts is not None and aouts[i] is not None:
                smode = SCALE_CAST
            elif s is None:
                smode = SCALE_CURRENT
            elif isinstance(s, torch.Tensor):
                s = _addressed(s, device, torch.float32, ())
                keep.append(s)
                smode, s_addr = SCALE_GIVEN, s.data_ptr()
            else:
                smode, s_val = SCALE_GIVEN, _f32(s)
        elif s is not None:
            raise ValueError("a scale needs an FP8 format (fmt='e4m3' or 'e5m2')")
        c, c_mean, c_std = center_fields(centers[i], device)
        keep.append(c)
        c_addr = 0 if c is None else c.data_ptr()
        fcode = _FMT_CODES.get(fmt.name, 0) if fmt is not None else 0
        _ROW.pack_into(table, i * _ROW.size, x.data_ptr(), numel, _DTYPE_CODE[x.dtype], first, nwork, int(index[i]),
                       int(bool(merges[i])), smode, s_addr, s_val, c_addr, c_mean, c_std, ahm_addr, ahm_val,
                       fcode, k, chunk, aouts[i].data_ptr() if smode == SCALE_CAST else 0, 0)
        spans.append((first, nwork))
        modes.append((smode, fcode))
    tab = to_device(table, device)
    # field-major (_store_partial); merged later, with each program's histogram beside its partial
    part = torch.empty(PW + (64 if later and hist else 0), nwork_total, dtype=torch.float64, device=device)
    dsts = [(out.data_ptr(), int(i)) for i in index]
    if any(d in _later_dsts for d in dsts):  # a row merged into twice: the first merge goes first
        merge_later()
    opts = {} if INTERPRET or not cap else {"maxnreg": cap}
    trace = None if _trace is None else torch.zeros(nwork_total, 16, dtype=torch.int32, device=device)
    _stats_kernel[(nwork_total,)](tab, len(tensors), part, counters(device), out, part if trace is None else trace,
                                  HIST=bool(hist), R=ROWS, TRACE=trace is not None,
                                  NARROW=chunk * P_BLOCK < 2**31, LATER=later,
                                  num_warps=NUM_WARPS, **opts)
    if trace is not None:
        _trace.append(trace)
    del keep
    if later:
        for i, ((first, nwork), (smode, fcode)) in enumerate(zip(spans, modes)):
            _queue_merge(part, nwork_total, first, nwork, out, dsts[i][1], bool(hist), bool(merges[i]), smode, fcode)
        if len(_later) >= MAX_LATER:
            merge_later()


# A current-scaled cast's row is merged by ``merge_later`` (``flush_deferred`` calls it: the agent, before it takes a
# step's rows), in one launch for all rows waiting: the statistics launch before the cast has no counter and no last
# program (whose merge would be a serial tail of every cast), and hands the cast the amax through the ``epoch_words``.
MAX_LATER = 1024  # rows waiting for ``merge_later`` at most (their partials stay allocated): then merged at once
_MROW = struct.Struct("<8q")  # part address, its stride, first program, programs, row address, merge, smode, format
assert _MROW.size == MTABW * 8
# (partials, row buffer, hist, _MROW bytes); the row buffer is kept alive until the merge has written into it. Whoever
# moves a row buffer (the agent growing its step buffer) merges first: the merge writes where the rows were.
_later: list = []
_later_dsts: set = set()  # (row buffer address, index) of the rows waiting
_later_lock = threading.Lock()




def _queue_merge(part: torch.Tensor, stride: int, first: int, nwork: int, rows: torch.Tensor, index: int, hist: bool,
                 merge: bool, smode: int, fcode: int) -> None:
    """Queue the row ``rows[index]`` for ``merge_later``: the ``nwork`` partials from column ``first`` of ``part``
    (field-major, ``stride`` columns, the histograms beside them with ``hist``)."""
    with _later_lock:
        _later.append((part, rows, hist, _MROW.pack(part.data_ptr(), stride, first, nwork,
                                                    rows.data_ptr() + index * ds.WIDTH * 8, int(merge), smode, fcode)))
        _later_dsts.add((rows.data_ptr(), index))


def _wait_for_merges(part: torch.Tensor, targets: list["Target"], spans: list[tuple[int, int]]) -> None:
    """``_queue_merge`` of the partials of the launch that follows: target i's ``spans[i]`` = (first column, programs)
    of ``part``. A row already waiting is merged first (never after queuing: the launch comes next)."""
    if any((t.rows.data_ptr(), int(t.index)) in _later_dsts for t in targets) or \
            len(_later) + len(targets) > MAX_LATER:
        merge_later()
    total = sum(n for _, n in spans)
    for t, (first, n) in zip(targets, spans, strict=True):
        smode, fcode = _merge_codes(t)
        _queue_merge(part, total, first, n, t.rows, int(t.index), bool(t.hist), bool(t.merge), smode, fcode)


def _merge_codes(target: "Target") -> tuple[int, int]:
    """(scale mode, format code) with which ``_merge_kernel`` finishes the target's row."""
    return nofmt_consts(target)["SMODE"], _FMT_CODES[by_name(target.fmt).name] if target.fmt is not None else 0


def partials_merged_later(targets: list["Target"], spans: list[tuple[int, int]], device) -> torch.Tensor:
    """The partials buffer of one launch whose programs leave partials for many rows, one column each: target i's
    ``spans[i]`` = (first column, programs). Each row is queued for ``merge_later`` (a row already waiting is merged
    first), so the launch must follow at once. The targets share one histogram setting."""
    part = torch.empty(PW + (64 if targets[0].hist else 0), max(1, sum(n for _, n in spans)), dtype=torch.float64,
                       device=device)
    _wait_for_merges(part, targets, spans)
    return part


def center_fields(c, device) -> tuple[torch.Tensor | None, float, float]:
    """(fp64 device tensor of 2 to read by address, or None; mean; std) of an outlier center (a ``Target``'s: (mean,
    std), a device tensor of 2, or None); no center: (None, 0, NaN), which counts no outlier."""
    if isinstance(c, torch.Tensor):
        return _addressed(c, torch.device(device), torch.float64, (2,)), 0.0, float("nan")
    return (None, 0.0, float("nan")) if c is None else (None, float(c[0]), float(c[1]))


def merge_later() -> None:
    """Merge the rows that launches left in their partials (``later`` launches): one launch per device
    and histogram setting."""
    if not _later:
        return
    with _later_lock:
        todo, _later[:] = list(_later), []
        _later_dsts.clear()
    groups: dict = {}
    for part, out, hist, mrow in todo:
        groups.setdefault((part.device, hist), []).append((part, out, mrow))
    for (device, hist), entries in groups.items():
        mtab = to_device(b"".join(m for _, _, m in entries), device)
        _merge_kernel[(len(entries),)](mtab, mtab, HIST=hist, PB=8 if INTERPRET else P_BLOCK, num_warps=NUM_WARPS)
        del entries  # the partials (and a row buffer no longer used) may be reused once the launch is queued


class _Staging:
    """Host-to-device staging without a host sync: a ring of persistent pinned int64 buffers, each reused
    only once the copy that last read it has completed (a CUDA event, polled with ``query()``, never waited
    on). When every buffer is still in flight, the ring grows by one (pinned allocation: rare, bounded by
    the number of copies in flight)."""

    def __init__(self, device: torch.device, size: int = 1 << 14):
        self.device, self.size = device, size
        self.bufs: list[list] = []  # [pinned tensor, event or None]
        self.next = 0
        self.lock = threading.Lock()
        # Under CUDA-graph capture a table is the same at every replay, so it goes to the device once, outside the
        # graph: into a device arena whose words are handed out once and never reused (graphs freed later do not
        # return their words), by a copy on a side stream that the capture does not follow. A copy captured into
        # the graph was a node per launch, re-reading its pinned source at every replay: at 1.5B 193 nodes, 0.23
        # ms of copies and idle gaps between them and the kernels (H200). The arenas (pinned source, device
        # words) and the stream are made with the first (eager) copy: nothing is allocated while a stream
        # captures, and eager warm-up steps precede a capture. ``captured_copies_done`` waits for the side copies;
        # a captured launch's graph must not replay before it (``StepGraphs`` calls it after each capture).
        self.arena: torch.Tensor | None = None
        self.dev_arena: torch.Tensor | None = None
        self.side: torch.cuda.Stream | None = None
        self.side_event: torch.cuda.Event | None = None
        self.arena_used = 0

    def put(self, data: bytes | bytearray) -> torch.Tensor:
        """The int64 values whose little-endian bytes are ``data``, in a new device tensor."""
        n = len(data) // 8
        if torch.cuda.is_current_stream_capturing():
            return self._put_captured(data, n)
        with self.lock:
            if self.arena is None:
                self.arena = torch.empty(CAPTURE_STAGING_WORDS, dtype=torch.int64, pin_memory=True)
                self.dev_arena = torch.empty(CAPTURE_STAGING_WORDS, dtype=torch.int64, device=self.device)
                self.side = torch.cuda.Stream(self.device)
                self.side_event = torch.cuda.Event()
            slot = None
            for j in range(len(self.bufs)):
                i = (self.next + j) % len(self.bufs)
                b = self.bufs[i]
                if b[0].numel() >= n and (b[1] is None or b[1].query()):
                    slot, self.next = b, (i + 1) % len(self.bufs)
                    break
            if slot is None:
                slot = [torch.empty(max(self.size, n), dtype=torch.int64, pin_memory=True), None]
                self.bufs.append(slot)
            host = slot[0][:n]
            host.numpy()[:] = np.frombuffer(data, dtype="<i8")  # a memcpy: no torch op
            dev = torch.empty(n, dtype=torch.int64, device=self.device)
            dev.copy_(host, non_blocking=True)
            if slot[1] is None:
                slot[1] = torch.cuda.Event()
            slot[1].record()
            return dev

    def _put_captured(self, data, n: int) -> torch.Tensor:
        with self.lock:
            if self.arena is None or self.arena_used + n > self.arena.numel():
                raise RuntimeError(
                    f"triton_stats: the capture staging arena ({CAPTURE_STAGING_WORDS} words) is "
                    + ("exhausted by the graphs captured so far" if self.arena is not None else
                       "not allocated: run the step eagerly once before capturing it")
                    + "; raise triton_stats.CAPTURE_STAGING_WORDS before the first launch")
            host = self.arena[self.arena_used: self.arena_used + n]
            words = slice(self.arena_used, self.arena_used + n)
            self.arena_used += n
            host.numpy()[:] = np.frombuffer(data, dtype="<i8")
            dev = self.dev_arena[words]
            with torch.cuda.stream(self.side):
                dev.copy_(host, non_blocking=True)
                self.side_event.record()
            return dev

    def copies_done(self) -> None:
        if self.side_event is not None:
            self.side_event.synchronize()


# Pinned and device int64 words per device for the tables of launches captured into CUDA graphs (``_Staging``): a
# launch of T tensors takes 20*T words (``_ROW``); 4 MiB holds ~26k tensors' launches, far more than a few graphs
# of a whole step.
CAPTURE_STAGING_WORDS = 1 << 19
_staging: dict = {}


def captured_copies_done() -> None:
    """Wait for the copies of the tables of launches captured so far (``_Staging``): call it after a capture,
    before its graph first replays. Not while a stream captures."""
    for st in list(_staging.values()):
        st.copies_done()


def to_device(values: list[int] | bytes | bytearray, device: torch.device) -> torch.Tensor:
    """int64 ``values`` (a list, or their little-endian bytes) as a tensor on ``device``, without a host sync on
    CUDA (see ``_Staging``)."""
    data = values if isinstance(values, (bytes, bytearray)) else struct.pack(f"<{len(values)}q", *values)
    if device.type != "cuda":
        return torch.frombuffer(bytearray(data), dtype=torch.int64)
    key = device.index if device.index is not None else torch.cuda.current_device()
    with _counters_lock:
        st = _staging.get(key)
        if st is None:
            st = _staging[key] = _Staging(torch.device("cuda", key))
    with torch.cuda.device(key):
        return st.put(data)


def partials(x: torch.Tensor, *, fmt=None, scale=None, amax_history_max=None, outlier_k: float = 6.0,
             center=None, hist: bool = True) -> torch.Tensor:
    """One tensor's row (``[WIDTH]``): ``device_stats.partials`` with outliers counted against ``center``."""
    return rows([x], fmt=fmt, scale=[scale], center=[center], outlier_k=outlier_k,
                amax_history_max=[amax_history_max], hist=hist)[0]


# ---- fused kernels (trainer/kernels/quantize*.py): where their row goes ----------------------------

# Rows to be written by the next launch on their device (``defer``): per device, a list of ``_launch_items`` items.
_deferred: dict = {}
_deferred_lock = threading.Lock()
MAX_DEFERRED = 8  # tensors waiting at most (they are kept alive until their launch): then a launch of their own


def _launch_items(items: list, device, later: bool = False) -> None:
    """(tensor, Target, fmt, amax_out) items, each row into its target with the current scaling of ``fmt``
    (the cast's, with x's amax into ``amax_out``, where that is not None: ``cast_row``): one launch per
    histogram setting, outlier k and row buffer (launch-wide), in one launch the usual case. ``later``: see
    ``_launch`` (an ``amax_out`` is then the ``epoch_words``)."""
    groups: dict = {}
    for item in items:
        t = item[1]
        groups.setdefault((bool(t.hist), float(t.outlier_k), t.rows.data_ptr()), []).append(item)
    for (hist, k, _), group in groups.items():
        ts_ = [t for _, t, _, _ in group]
        _launch([x for x, _, _, _ in group], [f for _, _, f, _ in group], [None] * len(group),
                [t.center for t in ts_], k, [t.amax_history_max for t in ts_], hist, ts_[0].rows,
                [int(t.index) for t in ts_], [bool(t.merge) for t in ts_], device,
                aouts=[a for _, _, _, a in group], later=later)


def defer(x: torch.Tensor, target: "Target") -> None:
    """x's row into ``target`` (the current-scaling emulation of ``target.fmt``, as ``rows``), written by the next
    statistics launch on x's device: ``cast_row``'s (a current-scaled cast that follows), or ``flush_deferred``'s,
    which the agent calls before it takes a step's rows; once MAX_DEFERRED tensors wait, at once, in one launch.
    Saves the launch (host time) of a tensor that no kernel reads for statistics anyway (Fp8Linear's output with
    ``OUTPUT_STATS = "deferred"``). x is kept alive until then and must not be written in place."""
    key = (x.device.type, x.device.index)
    with _deferred_lock:
        pending = _deferred.setdefault(key, [])
        pending.append((x.detach(), target, target.fmt, None))
        items = None
        if len(pending) >= MAX_DEFERRED:
            items, _deferred[key] = pending, []
    if items:
        _launch_items(items, x.device)


def _take_deferred(device: torch.device) -> list:
    key = (device.type, device.index)
    if not _deferred.get(key):
        return []
    with _deferred_lock:
        items, _deferred[key] = _deferred.get(key, []), []
    return items


def flush_deferred() -> None:
    """Write every deferred row now (``defer``), and merge the rows waiting for ``merge_later``."""
    if any(_deferred.values()):
        with _deferred_lock:
            pending = [items for items in _deferred.values() if items]
            _deferred.clear()
        for items in pending:
            _launch_items(items, items[0][0].device)
    merge_later()


def cast_row(x: torch.Tensor, fmt, target: "Target") -> torch.Tensor:
    """The statistics of x, about to be cast with current scaling, into ``target``'s row, by the standalone
    kernel in place of the cast's amax pass (it reads x once, as that pass does). The row's scale is the one that
    cast computes from x's finite amax (quantize's ``_scale_from_amax``), overflow is 0 (exact under that scale), and
    underflow is left at 0 for the cast, which counts it at that scale and adds it to the row
    (``quantize_transpose``'s ``COUNT``). The rows deferred on x's device (``defer``) are written by the same launch.

    The row is complete after the next ``flush_deferred``; this returns the ``epoch_words`` that hold x's amax for
    the cast."""
    word = epoch_words(x.device)
    _launch_items([(x, target, by_name(fmt).name, word)] + _take_deferred(x.device), x.device, later=True)
    return word


_epochs: dict = {}


def epoch_words(device: torch.device) -> torch.Tensor:
    """The device's two int64 words through which a ``LATER`` statistics launch hands its cast the amax: every
    program of the cast's tensor does an atomic max of ``(e + 1) << 32 | amax bits`` into word 0, where ``e`` is word 1,
    the epoch the last cast read (``quantize_transpose``'s ``EPOCH``), which records ``e + 1`` in turn. A value left
    from an earlier launch carries a lower epoch, so no reset (a launch, or a last program) is needed between launches.
    A statistics launch and its cast follow each other on one stream; casts on two streams of a device at once would
    share the words. Made on the first use, which must not be under CUDA-graph capture (eager warm-up steps precede a
    capture)."""
    key = (device.type, device.index)
    w = _epochs.get(key)
    if w is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triton_stats: a cast's statistics launch under CUDA-graph capture before any eager one: "
                               "run the step eagerly once before capturing it")
        w = _epochs[key] = torch.zeros(2, dtype=torch.int64, device=device)
    return w


def cast_rows(items: list, device: torch.device) -> None:
    """``cast_row`` of many tensors in one launch: ``(x, fmt, target, amax_out)`` items, e.g. every weight of a model
    before its forward casts them one by one, each cast then reading its ``amax_out``. With the rows deferred on
    ``device``."""
    todo = [(x, t, by_name(f).name, a) for x, f, t, a in items] + _take_deferred(device)
    for lo in range(0, len(todo), MAX_TENSORS):
        _launch_items(todo[lo: lo + MAX_TENSORS], device)


@dataclass
class Target:
    """Where a fused kernel writes a tensor's row: ``rows[index]`` (``[R, WIDTH]`` fp64 on the tensor's
    device), merged into the row there if ``merge``; the outlier ``center`` ((mean, std) or an fp64 device
    tensor of 2, None: no outliers), ``outlier_k``, ``hist``, and the delayed-scaling history max to record
    (number, fp32 device tensor or None). ``fmt``: for a kernel that casts nothing (the GEMM epilogues), the
    format ("e4m3" | "e5m2") whose current scaling (s = max / amax of the tensor) the row assumes, as the
    agent's hooks emulate it; None: no format (scale, underflow, overflow NaN)."""

    rows: torch.Tensor
    index: int = 0
    merge: bool = False
    center: Any = None
    outlier_k: float = 6.0
    hist: bool = True
    amax_history_max: Any = None
    fmt: Any = None

    @classmethod
    def new(cls, device, **kw) -> "Target":
        """A fresh one-row target (``rows[0]`` holds the result)."""
        return cls(torch.zeros(1, ds.WIDTH, dtype=torch.float64, device=device), **kw)


def epilogue_args(target: Target | None, programs: int, like: torch.Tensor, suffix: str = "",
                  counter_row: int = 0, later: bool = False) -> dict:
    """The statistics arguments of a kernel whose programs accumulate row states (``rows_add``) and end in
    ``nofmt_epilogue``: ``fused_args`` with the center as ``cen_ptr`` and ``nofmt_consts``, or placeholders (``like``'s
    pointer) and STATS False without a target. Names get ``suffix`` (a second target of one kernel: "_h"), and its
    last program counts on the device's counter row ``counter_row`` (two targets of one launch need two).

    ``later``: ``programs`` is the launch's grid exactly, which is launched next, and the row may be merged by the next
    ``merge_later`` rather than by the launch's last program. (A launch's second target must not
    ask: its registration may merge the rows waiting, the first target's among them, before the launch.)"""
    if target is None:
        args = dict(sp_ptr=like, ctr_ptr=like, dst_ptr=like, dst_index=0, merge=0, cen_ptr=like, c_mean=0.0,
                    c_std=0.0, k=0.0, ahm_ptr=like, ahm_val=0.0, STATS=False, C_PTR=False, AHM_PTR=False,
                    HIST=False, SMODE=0, FMAX=448.0, UTHR=0.0)
    else:
        args = fused_args(target, programs, like.device, later)
        args["cen_ptr"] = args.pop("c_ptr")
        args["ctr_ptr"] = args["ctr_ptr"][counter_row]
        consts = nofmt_consts(target)
        if later:
            args["merge"] |= 2
            _wait_for_merges(args["sp_ptr"], [target], [(0, programs)])
        args = dict(args, **consts, STATS=True)
    return {(k.upper() + suffix.upper() if k.isupper() else k + suffix): v for k, v in args.items()}


def nofmt_consts(target: Target) -> dict:
    """The constexprs of ``nofmt_epilogue`` for the target's ``fmt``."""
    if target.fmt is None:
        return dict(SMODE=SCALE_NONE, FMAX=448.0, UTHR=0.0)
    f = by_name(target.fmt)
    return dict(SMODE=SCALE_CURRENT, FMAX=float(f.max), UTHR=float(f.underflow_threshold))


def fused_args(target: Target, programs: int, device, later: bool = False) -> dict:
    """The statistics arguments of a fused kernel launched on ``programs`` programs (see quantize.py); ``later``:
    with room for each program's histogram beside its partial (``merge_later``)."""
    rows = PW + (64 if later and target.hist else 0)
    part = torch.empty(rows, max(1, programs), dtype=torch.float64, device=device)  # field-major (_store_partial)
    c = target.center
    if c is not None and not isinstance(c, torch.Tensor):  # kernel float arguments are fp32: pass fp64 by pointer
        c = to_device(struct.pack("<2d", float(c[0]), float(c[1])), torch.device(device)).view(torch.float64)
    if isinstance(c, torch.Tensor):
        c_ptr, c_mean, c_std, C_PTR = _addressed(c, torch.device(device), torch.float64, (2,)), 0.0, 0.0, True
    else:
        c_mean, c_std = (0.0, float("nan")) if c is None else (float(c[0]), float(c[1]))
        c_ptr, C_PTR = part, False
    a = target.amax_history_max
    if isinstance(a, torch.Tensor):
        ahm_ptr, ahm_val, AHM_PTR = _addressed(a, torch.device(device), torch.float32, ()), 0.0, True
    else:
        ahm_ptr, ahm_val, AHM_PTR = part, float("nan") if a is None else float(a), False
    return dict(sp_ptr=part, ctr_ptr=counters(device), dst_ptr=target.rows, dst_index=int(target.index),
                merge=int(bool(target.merge)), c_ptr=c_ptr, c_mean=c_mean, c_std=c_std, k=float(target.outlier_k),
                ahm_ptr=ahm_ptr, ahm_val=ahm_val, C_PTR=C_PTR, AHM_PTR=AHM_PTR, HIST=bool(target.hist))


if triton is not None:

    @triton.jit
    def fused_bounds(c_ptr, c_mean, c_std, k, C_PTR: tl.constexpr):
        """(lo, hi): the outlier bounds of a fused kernel's center."""
        cm = c_mean + tl.zeros([], tl.float64)
        cs = c_std + tl.zeros([], tl.float64)
        if C_PTR:
            cm = tl.load(c_ptr)
            cs = tl.load(c_ptr + 1)
        return _outlier_bounds(cm, cs, k + tl.zeros([], tl.float64))

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
                tl.store(sp_ptr + _P_AHM * nprog, ahm)
        else:
            _done(sp_ptr, nprog, ctr_ptr, nprog, dst_ptr + dst_index * _WIDTH, merge, SMODE, s, FMAX, UTHR, ahm,
                  hist, HIST)

    # ---- statistics of the tiles a consumer kernel streams through (trainer/kernels/swiglu.py, residual.py, rope.py,
    # rmsnorm.py)
    # As the standalone kernel takes them: a thread sums its own rows of V elements (``_tile_fast``) about a shift from
    # the program's first tile; no scale is known before the read (the epilogue derives underflow and overflow).

    @triton.jit
    def stream_start(x0, m0, R: tl.constexpr):
        """A persistent program's statistics set-up from its first tile ``x0`` (fp32, mask ``m0``, any shape): the shift
        c, scale p and whether they hold (``_shift_of``), -c*p and empty ``stream_add`` accumulators of R rows. (The
        histogram's shared-memory table stays the caller's: Triton 3.6 cannot return None in a tuple.)"""
        c, p, ok = _shift_of(tl.reshape(x0, [x0.numel]), tl.reshape(m0, [m0.numel]))
        return c, p, ok, -(c * p), stream_zero(R)

    @triton.jit
    def stream_zero(R: tl.constexpr):
        """Empty ``_tile_fast`` accumulators of R rows: s1-s4, amax, cu, co, outliers, cz, histogram."""
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
            s1, s2, s3, s4, am, cu, co, cout, cz, h = _tile_fast(xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu,
                                                                 co, cout, cz, h, HIST, False, True, ht)
        else:
            s1, s2, s3, s4, am, cu, co, cout, cz, h = _tile_fast(xv, mv, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu,
                                                                 co, cout, cz, h, HIST, True, True, ht)
        return s1, s2, s3, s4, am, cu, co, cout, cz, h

    # ---- the same through bf16 words (trainer/kernels/swiglu.py) -------------------------------------------------
    # A consumer kernel that holds its bf16 tensor as 32-bit words (it loads or packs them anyway) takes the row a word
    # at a time on its full tiles (``_tile_bf16x2``: the counts and the amax of both halves at once) and through
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
            s1, s2, s3, s4, amw, pu, pnz, pout = _tile_bf16x2(tl.reshape(wa, [R, 4]), p, ncp, ku, lo2, hi2, s1, s2, s3,
                                                              s4, amw, pu, pnz, pout, ht, UCOUNT=False)
            nw += 8  # 4 words of 2 elements a row
            if wb is not None:
                s1, s2, s3, s4, amw, pu, pnz, pout = _tile_bf16x2(tl.reshape(wb, [R, 4]), p, ncp, ku, lo2, hi2, s1, s2,
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
                acc, cnt = _tile_sum(x, m, acc, cnt, True)
        nfin = tl.sum(cnt, 0)
        mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
        zd = tl.zeros([R], tl.float64)
        zi = tl.zeros([R], tl.int32)
        t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, tl.zeros([R], tl.float32), zi, zi, zi, zi, zi, \
            tl.zeros([64], tl.int32)
        for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
            for part in tl.static_range(PARTS):
                x, m = LOAD(src, t, part, C1, C2)
                t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = _tile_careful(
                    x, m, mean0, tu, to, lo, hi, t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h, HIST, True)
        mean, m2, m3, m4, amax, zeros, under, over, outl, nonfin = _careful_result(
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
        ok2, mean, m2, m3, m4, amax, zeros, under, over, outl, hist = _fast_result(
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
    # into its bucket's fp64 sums. The earlier per-tile partial reduced every statistic across the CTA and merged
    # Chan/Pebay per tile; with 128 x 256 tiles ptxas spilled up to 1592 registers, and the forward GEMM took 3-9x
    # its time without statistics (bench/gemm_stats.py, H200).

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
