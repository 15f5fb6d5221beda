"""The log2 histogram in shared memory (hardware only): a table of per-lane counters the kernels add to,
reduced to the 64 bins at the end of a program. ``htab`` is the consumer kernels' table of 57 clamped rows;
``_erows`` the standalone kernel's table of a row per fp32 exponent (no clamp per element)."""

import triton
import triton.language as tl

from .consts import _BIN_ZERO, _EROW_SUM, _HTAB_ROW_SUM, _LO, _NB

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
def htab():
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
    """The byte offset, from ``htab``'s address, of the row of exponent field ``e128`` (the exponent at bits
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
    table's address). Declared once per kernel, as ``htab``."""
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
