"""The constants the statistics kernels read, as compile-time constants (``Const``), and the layouts as
constexprs (the kernels index with them). Host code reads the same values from ``..layout`` and ``..tuning``."""

import triton.language as tl

from ...wire import LOG2_HIST_BINS, LOG2_HIST_LO
from ..layout import CTRW, MTABW, PW, ROW_UNDERFLOW, SCALE_CAST, SCALE_CURRENT, SCALE_GIVEN, SCALE_NONE, TABW, WIDTH
from ..tuning import INTERPRET, P_BLOCK
from ..tuning import SMEM_HIST as _SMEM_HIST_ON


class Const(tl.constexpr):
    """A module-level constant the kernels read. On every launch Triton checks each global a kernel read
    against the value it compiled with, by ``!=``; ``tl.constexpr`` answers that with a new constexpr object
    (host time on every launch, for each of the standalone kernel's constants). This answers a plain bool."""

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
SMEM_HIST = Const(_SMEM_HIST_ON)
_CTRW = Const(CTRW)
_MTABW = Const(MTABW)
_PW = Const(PW)
_ROW_UNDER = Const(ROW_UNDERFLOW)
_TABW = Const(TABW)
_WIDTH = Const(WIDTH)
SCALE_NONE_C = Const(SCALE_NONE)
SCALE_GIVEN_C = Const(SCALE_GIVEN)
SCALE_CURRENT_C = Const(SCALE_CURRENT)
SCALE_CAST_C = Const(SCALE_CAST)
# the layouts, as constexprs for the kernels (they index Python lists as well)
(_P_N, _P_NUMEL, _P_NONFIN, _P_ZEROS, _P_OUTL, _P_UNDER, _P_OVER, _P_AMAX, _P_MEAN, _P_M2, _P_M3,
 _P_M4, P_AHM) = (Const(v) for v in range(13))
(_T_ADDR, _T_NUMEL, _T_CODE, _T_FIRST, _T_NWORK, _T_DST, _T_MERGE, _T_SMODE, _T_SCALE_ADDR, _T_SCALE,
 _T_CENTER_ADDR, _T_MEAN, _T_STD, _T_AHM_ADDR, _T_AHM, _T_FMT, _T_K,
 _T_CHUNK, _T_AMAX_OUT) = (Const(v) for v in range(19))
