"""The layouts of the statistics engine, defined once: host code, the torch path and the kernels index with these.

Row: a tensor's mergeable statistics as ``WIDTH`` fp64 fields (``FIELDS``, then the ``LOG2_HIST_BINS`` bins of the
log2 histogram from ``HIST``). A step's rows for every (layer, site) live in one ``[slots, WIDTH]`` buffer; a slot is
a (layer, site)'s row index in it. Absent optional fields are NaN.

Partial: what one program of a statistics kernel leaves for its share of a tensor, ``PW`` fp64 fields at the
``P_*`` indices, field-major in a ``[PW (+64), programs]`` buffer (the histogram beside it when the row is merged
by a later launch). A tensor's partials merge into its row.

Table row: a tensor's line in the standalone kernel's launch table, ``TABW`` int64 fields at the ``T_*`` indices
(float fields bit-cast; a scale/center/history field holds a device address when its ``*_ADDR`` field is
non-zero). ``MTABW`` fields per row of the merge kernel's table.
"""

from __future__ import annotations

import struct

from ..wire import LOG2_HIST_BINS

FIELDS = (
    "parts",  # how many partials were merged into the row; 0: nothing observed
    "numel",
    "n",  # finite elements
    "nonfinite",
    "zeros",
    "nonzero",  # finite nonzero elements
    "outliers",
    "underflow",
    "overflow",
    "amax",
    "mean",
    "M2",
    "M3",
    "M4",
    "scale",
    "amax_history_max",
)
(PARTS, NUMEL, N, NONFINITE, ZEROS, NONZERO, OUTLIERS, UNDERFLOW, OVERFLOW, AMAX, MEAN, M2, M3, M4, SCALE,
 AMAX_HISTORY_MAX) = range(len(FIELDS))
HIST = len(FIELDS)  # first histogram bin
WIDTH = HIST + LOG2_HIST_BINS
ROW_UNDERFLOW = UNDERFLOW

# a program's partial
PW = 16  # fp64 fields (the histogram goes to the counter row, or beside the partial when merged later)
(P_N, P_NUMEL, P_NONFIN, P_ZEROS, P_OUTL, P_UNDER, P_OVER, P_AMAX, P_MEAN, P_M2, P_M3, P_M4,
 P_AHM) = range(13)  # P_AHM: the history max, in a tensor's first partial, where a later launch merges
CTRW = 1 + 64  # int64 fields of a tensor's counter row: programs done, then its histogram's 64 bins

# a tensor's row of the standalone kernel's table
TABW = 20
(T_ADDR, T_NUMEL, T_CODE, T_FIRST, T_NWORK, T_DST, T_MERGE, T_SMODE, T_SCALE_ADDR, T_SCALE,
 T_CENTER_ADDR, T_MEAN, T_STD, T_AHM_ADDR, T_AHM, T_FMT, T_K, T_CHUNK, T_AMAX_OUT) = range(19)
# the same as bytes: int64 fields, the float ones (scale, center mean/std, history max, k) as fp64 bits
TABLE_ROW = struct.Struct("<9qdq2dqdqd3q")
assert TABLE_ROW.size == TABW * 8
# a row of the merge kernel's table: part address, its stride, first program, programs, row address, merge, scale
# mode, format code
MTABW = 8
MERGE_ROW = struct.Struct("<8q")
assert MERGE_ROW.size == MTABW * 8

# scale modes: no format; scale known before the read; s = max/amax of this tensor; the same, for a tensor whose
# cast follows (``launch.cast_row``)
SCALE_NONE, SCALE_GIVEN, SCALE_CURRENT, SCALE_CAST = 0, 1, 2, 3
FORMAT_CODES = {"e4m3": 1, "e5m2": 2}
