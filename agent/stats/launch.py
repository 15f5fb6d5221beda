"""The Triton path's host API: all SPEC section-4 statistics of tensors in one read (``rows``), and what fused
kernels need on the host (``Target``, ``fused_args``, ``epilogue_args``, ``defer``, ``cast_row``, ``flush_deferred``).

The launcher ``rows`` produces, for a list of tensors (bf16, fp16 or fp32, any sizes, in ONE launch), the
rows ``torch_path.partials`` produces, in its layout (``merge``, ``to_moments`` and ``Moments.to_stats``
work unchanged), written into a given ``[R, WIDTH]`` fp64 buffer at given rows, optionally merged into
what is there (the agent's step buffer: a micro-batch merges into its slot). No host sync: the tensor table
goes to the device in one non-blocking copy from a persistent pinned staging ring (``staging.Staging``: a buffer
is reused only once its last copy's event has completed, polled, never waited on); nothing is read back.
tests/agent/test_gpu_stats.py checks this under torch's sync debug mode.

Hot loop (standalone kernel): tiles are [ROWS, 16 bytes] (8 bf16/fp16 or 4 fp32 per row); a thread owns
whole rows, so the loads are 16 bytes wide (the launcher makes every address 16-byte aligned, cloning a
misaligned view) and the per-row sums are a thread's own adds: the accumulators are [ROWS], nothing
crosses threads inside the loop. bf16 goes through its words instead, two elements each (``tile_bf16x2``:
counts, outliers and amax without unpacking; with the histogram, only on hardware, where it is a shared-memory
table: ``htab``). The kernel is launched with a register
cap (``tuning.MAXNREG``, ``MAXNREG_FP32``): its cold code (merge, careful path) otherwise drives ptxas to most
of the register file, one program per SM.

Scheme (one kernel):
  * Work: every tensor is cut into chunks (one size per launch, sized to one wave of programs on a GPU:
    ``Engine.chunk_elems``); a program per chunk. A table row per tensor holds its address, dtype, size, chunk,
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
    ``kernels.merge``) and writes the row. No second launch. Histograms skip the partials: each program adds its
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
or x < round_up32(mean - k std). ``torch_path.partials(..., outlier_center=)`` is the reference.

Importing this module never needs Triton (``available()`` says whether it can run); the kernels
(``kernels``) are imported by the first launch. Per-device state lives in the device's ``engine.Engine``.
"""


from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..formats import by_name
from . import torch_path as tp
from .engine import DTYPE_CODES, addressed, center_fields, engine, engines
from .layout import PW, SCALE_CURRENT, SCALE_NONE, WIDTH
from .tuning import INTERPRET, MAX_TENSORS, SMEM_HIST

try:  # the agent must stay importable without Triton
    import triton  # noqa: F401
    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    _HAVE_TRITON = False

__all__ = ["SMEM_HIST", "Target", "available", "cast_row", "cast_rows", "captured_copies_done", "center_fields",
           "counters", "defer", "epilogue_args", "epoch_words", "flush_deferred", "fused_args", "merge_later",
           "nofmt_consts", "partials", "partials_merged_later", "rows", "supports", "to_device"]


def available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton path can run for tensors on ``device`` (CUDA, or the CPU under TRITON_INTERPRET)."""
    if not _HAVE_TRITON:
        return False
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type == "cuda":
        return torch.cuda.is_available() or INTERPRET
    return dev.type == "cpu" and INTERPRET


def supports(x: torch.Tensor) -> bool:
    return x.dtype in DTYPE_CODES


def each(value, n: int, pair: bool = False) -> list:
    """A per-tensor argument as a list of n: a list of n is one value per tensor, anything else one for all.
    With ``pair`` (``center``) a 2-list of numbers is one (mean, std) for all, even for two tensors."""
    if isinstance(value, (list, tuple)) and len(value) == n and not (pair and n == 2 and _is_center_pair(value)):
        return list(value)
    return [value] * n


def _is_center_pair(v) -> bool:
    return all(isinstance(e, (int, float)) for e in v)


def rows(tensors: Sequence[torch.Tensor], *, fmt=None, scale=None, center=None, outlier_k: float = 6.0,
         amax_history_max=None, hist: bool = True, out: torch.Tensor | None = None,
         index: Sequence[int] | None = None, merge: Sequence[bool] | bool = False, later: bool = False) -> torch.Tensor:
    """The ``torch_path`` row of each tensor, all computed by one launch (per MAX_TENSORS tensors).

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
        return out if out is not None else tp.empty(0)
    device = tensors[0].device
    if out is None:
        out = torch.empty(n, WIDTH, dtype=torch.float64, device=device)
        index = range(n)
    assert out.dtype == torch.float64 and out.is_contiguous() and out.device == device
    index = list(index if index is not None else range(n))
    fmts, scales, centers = each(fmt, n), each(scale, n), each(center, n, pair=True)
    ahms, merges = each(amax_history_max, n), each(merge, n)
    if later and any(s is not None for s in scales + ahms):
        raise ValueError("rows(later=True) takes no scale and no amax_history_max: the later merge knows no scale")
    eng = engine(device)
    for lo in range(0, n, MAX_TENSORS):
        hi = min(n, lo + MAX_TENSORS)
        eng.launch(tensors[lo:hi], fmts[lo:hi], scales[lo:hi], centers[lo:hi], float(outlier_k), ahms[lo:hi], hist,
                   out, index[lo:hi], merges[lo:hi], later=later)
    return out


def partials(x: torch.Tensor, *, fmt=None, scale=None, amax_history_max=None, outlier_k: float = 6.0,
             center=None, hist: bool = True) -> torch.Tensor:
    """One tensor's row (``[WIDTH]``): ``torch_path.partials`` with outliers counted against ``center``."""
    return rows([x], fmt=fmt, scale=[scale], center=[center], outlier_k=outlier_k,
                amax_history_max=[amax_history_max], hist=hist)[0]


def counters(device) -> torch.Tensor:
    """The device's counter rows of the last-program merge (``Engine.counters``)."""
    return engine(device).counters()


def to_device(values: list[int] | bytes | bytearray, device) -> torch.Tensor:
    """int64 ``values`` as a tensor on ``device``, without a host sync on CUDA (``Engine.to_device``)."""
    return engine(device).to_device(values)


def epoch_words(device) -> torch.Tensor:
    """The device's epoch words (``Engine.epoch_words``)."""
    return engine(device).epoch_words()


def merge_later() -> None:
    """Merge the rows that launches on any device left in their partials (``later`` launches)."""
    for e in engines():
        e.merge_later()


def flush_deferred() -> None:
    """Write every deferred row now (``defer``), and merge the rows waiting for ``merge_later``, on every device. The
    agent calls it before it takes a step's rows."""
    for e in engines():
        e.flush_deferred()


def captured_copies_done() -> None:
    """Wait for the copies of the tables of launches captured so far into CUDA graphs: call it after a capture,
    before its graph first replays (``trainer.graphs.StepGraphs`` does). Not while a stream captures."""
    for e in engines():
        e.captured_copies_done()


# ---- fused kernels (trainer/kernels): where their row goes -------------------------------------------------------


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
    def new(cls, device, **kw) -> Target:
        """A fresh one-row target (``rows[0]`` holds the result)."""
        return cls(torch.zeros(1, WIDTH, dtype=torch.float64, device=device), **kw)


def defer(x: torch.Tensor, target: Target) -> None:
    """x's row into ``target`` (the current-scaling emulation of ``target.fmt``, as ``rows``), written by the next
    statistics launch on x's device: ``cast_row``'s (a current-scaled cast that follows), or ``flush_deferred``'s,
    which the agent calls before it takes a step's rows; once ``tuning.MAX_DEFERRED`` tensors wait, at once, in one
    launch. Saves the launch (host time) of a tensor that no kernel reads for statistics anyway. x is kept alive until
    then and must not be written in place."""
    engine(x.device).defer(x, target)


def cast_row(x: torch.Tensor, fmt, target: Target) -> torch.Tensor:
    """The statistics of x, about to be cast with current scaling, into ``target``'s row, by the standalone
    kernel in place of the cast's amax pass (it reads x once, as that pass does). The row's scale is the one that
    cast computes from x's finite amax (quantize's ``_scale_from_amax``), overflow is 0 (exact under that scale), and
    underflow is left at 0 for the cast, which counts it at that scale and adds it to the row
    (``quantize_transpose``'s ``COUNT``). The rows deferred on x's device (``defer``) are written by the same launch.

    The row is complete after the next ``flush_deferred``; this returns the ``epoch_words`` that hold x's amax for
    the cast."""
    return engine(x.device).cast_row(x, fmt, target)


def cast_rows(items: list, device) -> None:
    """``cast_row`` of many tensors in one launch: ``(x, fmt, target, amax_out)`` items, e.g. every weight of a model
    before its forward casts them one by one, each cast then reading its ``amax_out``. With the rows deferred on
    ``device``."""
    engine(device).cast_rows(items)


def partials_merged_later(targets: list[Target], spans: list[tuple[int, int]], device) -> torch.Tensor:
    """The partials buffer of one launch whose programs leave partials for many rows, one column each: target i's
    ``spans[i]`` = (first column, programs). Each row is queued for ``merge_later`` (a row already waiting is merged
    first), so the launch must follow at once. The targets share one histogram setting."""
    part = torch.empty(PW + (64 if targets[0].hist else 0), max(1, sum(n for _, n in spans)), dtype=torch.float64,
                       device=device)
    engine(device).wait_for_merges(part, targets, spans)
    return part


def epilogue_args(target: Target | None, programs: int, like: torch.Tensor, suffix: str = "",
                  counter_row: int = 0, later: bool = False) -> dict:
    """The statistics arguments of a kernel whose programs accumulate row states (``rows_add``) and end in
    ``nofmt_epilogue``: ``fused_args`` with the center as ``cen_ptr`` and ``nofmt_consts``, or placeholders (``like``'s
    pointer) and STATS False without a target. Names get ``suffix`` (a second target of one kernel: "_h"), and its
    last program counts on the device's counter row ``counter_row`` (two targets of one launch need two).

    ``later``: ``programs`` is the launch's grid exactly, which is launched next, and the row is merged by the next
    ``merge_later`` rather than by the launch's last program. (A launch's second target must not ask: its
    registration may merge the rows waiting, the first target's among them, before the launch.)"""
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
            engine(like.device).wait_for_merges(args["sp_ptr"], [target], [(0, programs)])
        args = dict(args, **consts, STATS=True)
    return {(k.upper() + suffix.upper() if k.isupper() else k + suffix): v for k, v in args.items()}


def nofmt_consts(target: Target) -> dict:
    """The constexprs of ``nofmt_epilogue`` for the target's ``fmt``."""
    if target.fmt is None:
        return dict(SMODE=SCALE_NONE, FMAX=448.0, UTHR=0.0)
    f = by_name(target.fmt)
    return dict(SMODE=SCALE_CURRENT, FMAX=float(f.max), UTHR=float(f.underflow_threshold))


def fused_args(target: Target, programs: int, device, later: bool = False) -> dict:
    """The statistics arguments of a fused kernel launched on ``programs`` programs (see ``device``); ``later``:
    with room for each program's histogram beside its partial (``merge_later``)."""
    device = torch.device(device)
    rows_ = PW + (64 if later and target.hist else 0)
    part = torch.empty(rows_, max(1, programs), dtype=torch.float64, device=device)  # field-major
    c = target.center
    if c is not None and not isinstance(c, torch.Tensor):  # kernel float arguments are fp32: pass fp64 by pointer
        c = to_device(struct.pack("<2d", float(c[0]), float(c[1])), device).view(torch.float64)
    if isinstance(c, torch.Tensor):
        c_ptr, c_mean, c_std, C_PTR = addressed(c, device, torch.float64, (2,)), 0.0, 0.0, True
    else:
        c_mean, c_std = (0.0, float("nan")) if c is None else (float(c[0]), float(c[1]))
        c_ptr, C_PTR = part, False
    a = target.amax_history_max
    if isinstance(a, torch.Tensor):
        ahm_ptr, ahm_val, AHM_PTR = addressed(a, device, torch.float32, ()), 0.0, True
    else:
        ahm_ptr, ahm_val, AHM_PTR = part, float("nan") if a is None else float(a), False
    return dict(sp_ptr=part, ctr_ptr=counters(device), dst_ptr=target.rows, dst_index=int(target.index),
                merge=int(bool(target.merge)), c_ptr=c_ptr, c_mean=c_mean, c_std=c_std, k=float(target.outlier_k),
                ahm_ptr=ahm_ptr, ahm_val=ahm_val, C_PTR=C_PTR, AHM_PTR=AHM_PTR, HIST=bool(target.hist))
