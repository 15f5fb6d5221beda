"""The device API of the statistics engine: what a fused kernel (a Triton kernel that computes a tensor's row from
the tiles it already holds, e.g. trainer/kernels) calls. Importing this module needs Triton.

Words. A *row* is a tensor's mergeable statistics, ``layout.WIDTH`` fp64 fields (``layout.FIELDS`` and the log2
histogram). A *target* (``launch.Target``) says where a kernel writes a row: ``rows[index]`` of an fp64 buffer, a
*slot* of the agent's step buffer, overwritten or merged into. A *partial* is one program's share of a tensor
(``layout.PW`` fields at ``layout.P_*``): (nelem, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4,
hist) in registers; every program stores one, and either the launch's last program (an atomic counter per target)
merges them into the row, or a later launch does (``launch.merge_later``, run by ``launch.flush_deferred``).

Protocol. On the host, a kernel's launcher takes a ``Target`` and passes ``launch.fused_args(target, programs,
device, later)`` (or ``launch.epilogue_args`` for row-state kernels) as keyword arguments; ``later=True`` requires
that launch to follow at once and leaves the merge to ``flush_deferred``. In the kernel, each program:

1. takes the outlier bounds: ``fused_bounds(c_ptr, c_mean, c_std, k, C_PTR)`` -> (lo, hi); a kernel that casts with a
   scale known before the read takes ``fused_prologue`` (also the underflow/overflow thresholds);
2. accumulates its tiles, one of
   * streaming tiles (elementwise kernels): ``stream_start(x0, m0, R)`` or ``stream_zero(R)`` for the accumulators
     and the shift, ``stream_add`` per tile (``words_zero``/``words_add``/``words_fold`` for bf16 held as 32-bit
     words, ``bf16_halves`` to split them), then ``stream_partial`` -> the partial (it re-reads through the kernel's
     ``LOAD`` function on ``careful_tiles``' exact fp64 path where the fast sums cannot be trusted: NaN/Inf, fp32
     overflow, a poor shift);
   * register tiles of a GEMM epilogue: ``rows_zero``, ``rows_add`` per tile, ``rows_partial``;
   * a cast's own tiles: ``shift_of`` of the first tile, ``tile_fast`` per tile (``tile_bf16x2`` on bf16 words,
     ``packed_setup``/``packed_fold`` around it), ``fast_result``; where it is not ok, ``tile_sum`` and
     ``tile_careful`` over the tiles again and ``careful_result``;
   the histogram counts into a shared-memory table (``htab()``) where ``SMEM_HIST``, else with ``tl.histogram``;
3. ends with ``fused_epilogue`` (or ``nofmt_epilogue`` for row states, a kernel that casts nothing), which stores
   the partial and, unless merged later, lets the last program write the row.

``outlier_bounds`` converts (mean, std, k) to exact fp32 bounds; ``P_AHM`` is the partial field of the history max;
``Const`` makes a module-level constant a kernel reads (cheap to check at launch).
"""

from .kernels.consts import P_AHM, SMEM_HIST, Const
from .kernels.fused import (
                            bf16_halves,
                            careful_tiles,
                            fused_bounds,
                            fused_epilogue,
                            fused_prologue,
                            nofmt_epilogue,
                            rows_add,
                            rows_partial,
                            rows_zero,
                            stream_add,
                            stream_partial,
                            stream_start,
                            stream_zero,
                            words_add,
                            words_fold,
                            words_zero,
)
from .kernels.hist import htab
from .kernels.tile import careful_result, fast_result, outlier_bounds, shift_of, tile_careful, tile_fast, tile_sum
from .kernels.words import packed_fold, packed_setup, tile_bf16x2

__all__ = ["Const", "P_AHM", "SMEM_HIST", "bf16_halves", "careful_result", "careful_tiles", "fast_result",
           "fused_bounds", "fused_epilogue", "fused_prologue", "htab", "nofmt_epilogue", "outlier_bounds", "packed_fold",
           "packed_setup", "rows_add", "rows_partial", "rows_zero", "shift_of", "stream_add", "stream_partial",
           "stream_start", "stream_zero", "tile_bf16x2", "tile_careful", "tile_fast", "tile_sum", "words_add",
           "words_fold", "words_zero"]
