"""Many fp32 weights cast to bf16 (or fp16) in one launch, each with the statistics row of its fp32 values: autocast's
casts of a model's weights on a reporting step (``trainer.weight_rows.take_cast``), done together.

One cast per weight (``residual.weight_cast``) is one launch per linear, each small at 124M (0.6-3 M elements): the
launch's ramp, its last wave and its partials cost about as much as the bytes (bench/RESULTS.md). Here the programs
of one launch are shared out among the weights in proportion to their blocks; a program casts and sums the blocks
``p, p + programs_t, ...`` of its weight ``t`` as ``residual.branch_grad`` does, and stores its partial at its column of
one partials buffer, which ``triton_stats.merge_later`` merges into each weight's row. Reference beside it:
``weight_casts_ref``.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from agent import triton_stats as ts
from agent.triton_stats import (_P_AHM, _SMEM_HIST, _htab, _outlier_bounds, fused_epilogue, stream_add, stream_partial,
                                stream_start)

from .fp8_gemm import _to_out
from .quantize import INTERPRET, _num_sms, cdiv
from .residual import _b_part, _grad_block

BLOCK = 1024
WARPS = 4
PROGRAMS_PER_SM = 4
MAXNREG = 128  # as residual's kernels with a row: 16 warps of 4-warp programs fill an SM's registers
STAGES = 3
_TAB = struct.Struct("<6q2dq")  # source, cast, elements, first program, programs, center address, center (mean, std), pad
_TABW = tl.constexpr(_TAB.size // 8)


@triton.jit
def _mine_part(src, t, part, BLOCK: tl.constexpr, V: tl.constexpr):
    """``triton_stats.careful_tiles``' loader for a program of a shared launch: careful_tiles counts t = pid, pid +
    nprog, ... (the launch's grid); the k-th of those is block ``p + k * programs`` of the program's own weight."""
    w_ptr, n, pid, nprog, p, programs = src
    return _b_part((w_ptr, n), p + (t - pid) // nprog * programs, part, BLOCK, V)


@triton.jit
def _weight_casts_kernel(tab_ptr, ntab, sp_ptr, k, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                         SMODE: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr,
                         STAGES: tl.constexpr):
    """Program ``pid`` finds its weight in the table's program map (after the ``ntab`` rows), casts its blocks to OUT
    and leaves its partial of their fp32 values in column pid of ``sp_ptr`` for ``merge_later``; a weight's first
    program also leaves the (absent) history max in the weight's first column."""
    V: tl.constexpr = 8
    R: tl.constexpr = BLOCK // V
    OUT: tl.constexpr = tl.bfloat16 if OUT_BF16 else tl.float16
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t = tl.load(tab_ptr + ntab * _TABW + pid)
    row = tab_ptr + t * _TABW
    # 16-byte aligned (the launcher checks): vector loads and stores, as with a tensor argument
    w_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    out_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(OUT)), 16)
    n = tl.load(row + 2)
    first = tl.load(row + 3)
    programs = tl.load(row + 4)
    c_addr = tl.load(row + 5)
    c_mean = tl.load(row + 6).to(tl.float64, bitcast=True)
    c_std = tl.load(row + 7).to(tl.float64, bitcast=True)
    if c_addr != 0:
        c_mean = tl.load(c_addr.to(tl.pointer_type(tl.float64)))
        c_std = tl.load(c_addr.to(tl.pointer_type(tl.float64)) + 1)
    lo, hi = _outlier_bounds(c_mean, c_std, k + tl.zeros([], tl.float64))
    p = pid - first
    nblk = tl.cdiv(n, BLOCK)
    d0, m0 = _b_part((w_ptr, n), p, 0, BLOCK, V)
    c, s, ok, ncp, st = stream_start(d0, m0, R)
    ht = None
    if HIST and _SMEM_HIST:
        ht = _htab()
    ce = tl.zeros([], tl.int32)
    # the full blocks without masks (n is not known to the compiler: a mask by it would cost the vector accesses)
    nfull = n // BLOCK
    everywhere = tl.full([BLOCK], 1, tl.int1)
    for blk in tl.range(p, nfull, programs, num_stages=STAGES):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + offs)
        tl.store(out_ptr + offs, _to_out(w, OUT, SOFT_ROUND))
        st = stream_add(st, w, everywhere, True, s, ncp, lo, hi, HIST, R, V, ht)
        ce += BLOCK
    if nfull < nblk and (nfull - p) % programs == 0:  # the partial last block is this program's
        w, d, offs, mask = _grad_block(w_ptr, n, nfull, OUT, BLOCK, SOFT_ROUND)
        tl.store(out_ptr + offs, d, mask=mask)
        st = stream_add(st, w, mask, False, s, ncp, lo, hi, HIST, R, V, ht)
        ce += (n - nfull * BLOCK).to(tl.int32)
    mine = pid + nprog * tl.cdiv(nblk - p, programs)  # careful_tiles' bound: as many tiles as this program's blocks
    ce, nfin, nonfin, zeros, outl, under, over, amax, mean, m2, m3, m4, hist = stream_partial(
        st, ce, c, s, ok, _mine_part, (w_ptr, n, pid, nprog, p, programs), mine, 1, lo, hi, HIST, R, BLOCK, V, ht)
    nan = tl.full([], float("nan"), tl.float64)
    fused_epilogue(sp_ptr, sp_ptr, sp_ptr, 0, 2, sp_ptr, nan, 1.0, ce, nfin, nonfin, zeros, outl, under, over, amax,
                   mean, m2, m3, m4, hist, FMAX, UTHR, False, HIST, SMODE)
    if p == 0:
        tl.store(sp_ptr + _P_AHM * nprog + first, nan)


def _shares(numels: list[int], device: torch.device) -> list[int]:
    """Programs per weight: about one wave of ``PROGRAMS_PER_SM`` per SM in all, each weight's share in proportion to
    its blocks (at least one, at most one per block)."""
    blocks = [cdiv(n, BLOCK) for n in numels]
    slots = 4 * len(numels) if INTERPRET else PROGRAMS_PER_SM * _num_sms(device)
    per = max(1, cdiv(sum(blocks), max(slots - len(blocks), len(blocks))))  # blocks a program takes
    return [min(b, max(1, cdiv(b, per))) for b in blocks]


def castable(w: torch.Tensor) -> bool:
    """Whether ``weight_casts`` takes w."""
    return w.dtype == torch.float32 and w.is_contiguous() and w.numel() > 0 and w.data_ptr() % 16 == 0


def weight_casts(weights: list[torch.Tensor], dtype: torch.dtype, targets: list["ts.Target"]) -> list[torch.Tensor]:
    """``[w.to(dtype) for w in weights]`` (fp32, contiguous, non-empty, on one device) in one launch, with the row of
    each weight's own values into its target. The targets share one row buffer, histogram setting, outlier k and
    format; the rows are complete after the next ``triton_stats.merge_later``."""
    if not weights:
        return []
    device, t0 = weights[0].device, targets[0]
    for w, t in zip(weights, targets, strict=True):
        if not castable(w) or w.device != device:
            raise ValueError("weight_casts: needs contiguous, non-empty, 16-byte aligned fp32 weights on one device")
        if (t.rows.data_ptr(), bool(t.hist), float(t.outlier_k), t.fmt) != \
                (t0.rows.data_ptr(), bool(t0.hist), float(t0.outlier_k), t0.fmt):
            raise ValueError("weight_casts: the targets must share rows, histogram setting, outlier k and format")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"weight_casts: casts to bf16 or fp16, not {dtype}")
    casts = [torch.empty(w.shape, dtype=dtype, device=device) for w in weights]
    shares = _shares([w.numel() for w in weights], device)
    table, keep, firsts, total = bytearray(), [], [], 0
    for w, out, t, share in zip(weights, casts, targets, shares):
        c_addr, c_mean, c_std = 0, 0.0, float("nan")
        if isinstance(t.center, torch.Tensor):
            c = ts._addressed(t.center, device, torch.float64, (2,))
            keep.append(c)
            c_addr = c.data_ptr()
        elif t.center is not None:
            c_mean, c_std = float(t.center[0]), float(t.center[1])
        table += _TAB.pack(w.data_ptr(), out.data_ptr(), w.numel(), total, share, c_addr, c_mean, c_std, 0)
        firsts.append(total)
        total += share
    program_map = [i for i, share in enumerate(shares) for _ in range(share)]
    tab = ts.to_device(bytes(table) + struct.pack(f"<{total}q", *program_map), device)
    hist = bool(t0.hist)
    part = torch.empty(ts.PW + (64 if hist else 0), total, dtype=torch.float64, device=device)
    if any((t.rows.data_ptr(), int(t.index)) in ts._later_dsts for t in targets):  # a row merged into twice: in order
        ts.merge_later()
    consts = ts.nofmt_consts(t0)
    fcode = ts._FMT_CODES[ts.by_name(t0.fmt).name] if t0.fmt is not None else 0
    opts = {} if INTERPRET else {"maxnreg": MAXNREG}
    _weight_casts_kernel[(total,)](tab, len(weights), part, float(t0.outlier_k), HIST=hist, OUT_BF16=dtype == torch.bfloat16,
                                   BLOCK=BLOCK, SOFT_ROUND=INTERPRET, STAGES=STAGES, num_warps=WARPS, **consts, **opts)
    del keep
    for t, first, share in zip(targets, firsts, shares):
        ts._queue_merge(part, total, first, share, t.rows, int(t.index), hist, bool(t.merge), consts["SMODE"], fcode)
    if len(ts._later) >= ts.MAX_LATER:
        ts.merge_later()
    return casts


def weight_casts_ref(weights: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [w.to(dtype) for w in weights]
