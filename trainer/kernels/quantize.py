"""Tensorwise FP8 quantize on the device: amax + scale + clamp + cast (SPEC sections 4 and 5).

Scales follow ``agent.formats``: ``q = cast(clamp(s * x, -max, max))``, ``s = fmt.max / amax``; the GEMM
multiplies by ``scale_inv = 1 / s``. Everything stays on the device: amax, scale and scale_inv are
written by the kernels into a small fp32 tensor (``meta = [amax, scale, scale_inv]``), never read back
by the host (no ``.item()``, no host sync).

Current scaling needs amax(x) before the first element can be cast, so it is two launches that read x
twice (the choice made here, rather than a one-pass cast that uses a stale amax, which *is* delayed
scaling):
  1. ``_amax_partials_kernel``: a grid of at most ``MAX_PARTIALS`` programs, each a grid-stride loop
     writing the max |x| over its elements to ``partials[pid]`` (no atomics, no zero-init launch);
  2. the cast kernel: every program reduces the partials itself (<= 1024 floats, L2-resident) to amax
     and the scale, casts its block; program 0 writes ``meta``.
Delayed scaling is one pass: the cast kernel reads the scale computed from the amax history, casts,
and atomically maxes its block's amax into a per-tensor accumulator; a one-program
``_delayed_update_kernel`` then rolls the history (index 0 = newest, TE convention), writes the next
scale (fmt.max / max(history) / 2**margin) and resets the accumulator.

amax is the max |x| over finite elements (SPEC section 4); NaN stays NaN through the cast (the clamp is
written with comparisons, which keep NaN), +-Inf saturates to +-max like any value past the clamp.

Rounding: on a GPU the fp32 -> fp8 cast is the hardware round-to-nearest-even. Triton 3.9's
*interpreter* (TRITON_INTERPRET=1) gets that cast wrong: it drops the carry when rounding up crosses a
binade (0.031 -> 0.0156 in E4M3), truncates results that are subnormal in the target format, and rounds
ties away from zero. With ``SOFT_ROUND`` (set automatically under the interpreter) the kernels round to
the FP8 grid in fp32 arithmetic (exact RNE) and encode the FP8 bits with integer operations
(``_soft_cast_fp8``; -0 and NaN too), bypassing the interpreter's conversion; compiled kernels never
take that branch and use the hardware cast.

Statistics (``stats=`` a ``agent.stats.launch.Target``): the cast kernel becomes persistent (at most
4 programs per SM, each a grid-stride loop over tiles) and, from the very registers it casts, accumulates
every SPEC section-4 statistic of x with the scale it casts with (``stats.launch`` explains the scheme:
fp32 power sums about a shift, exact counts from |x|'s bits, log2 histogram); the last program merges the
per-program partials (Chan/Pebay, fp64) into the target row. No second read of x, except on the rare
careful path (NaN/Inf, or a shift too far from the mean), which re-reads the program's tiles.
Reference: ``stats_ref`` (``stats.torch_path.partials`` with the scale in use).

Reference (torch) versions sit beside each launcher: ``quantize_ref``, ``delayed_update_ref``.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fp8mon.agent.formats import Fp8Format, by_name, current_scale, delayed_scale
from fp8mon.agent.formats import quantize as _quantize_cast
from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.device import (
    SMEM_HIST,
    careful_result,
    fast_result,
    fused_epilogue,
    fused_prologue,
    htab,
    shift_of,
    tile_careful,
    tile_fast,
    tile_sum,
)

MAX_PARTIALS = 1024
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# mantissa bits and the exponent of the smallest normal, per format (for the software rounding)
_MBITS = {"e4m3": 3, "e5m2": 2}
_EMIN = {"e4m3": -6, "e5m2": -14}


class Quantized(NamedTuple):
    """An FP8 tensor, optionally its transpose (contiguous, i.e. the K-major operand of the other GEMM),
    and ``meta`` = fp32 device tensor [amax, scale, scale_inv] (0-d views below)."""

    data: torch.Tensor
    data_t: torch.Tensor | None
    meta: torch.Tensor

    @property
    def amax(self) -> torch.Tensor:
        return self.meta[0]

    @property
    def scale(self) -> torch.Tensor:
        return self.meta[1]

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.meta[2]


def _finite_or_one(s):
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _soft_cast_fp8(y, out_dtype: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """fp32 y (clamped to +-max) -> FP8, round to nearest even, encoded in integer arithmetic and
    bitcast: the interpreter's own fp32 -> fp8 conversion is wrong (see the module docstring)."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 127, EMIN)  # below the smallest normal the spacing is fixed (subnormals)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e + MBITS) << 23).to(tl.float32, bitcast=True)
    t = a * inv_ulp  # exact (power of two), t < 2**(MBITS + 1)
    r = ((t + 8388608.0) - 8388608.0) * ulp  # + 2**23 rounds t >= 0 to an integer, ties to even
    rbits = r.to(tl.int32, bitcast=True)
    min_normal = tl.full([], (EMIN + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
    inv_sub_ulp = tl.full([], (MBITS - EMIN + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
    normal = r >= min_normal
    code_normal = (((rbits >> 23) - 127 + 1 - EMIN) << MBITS) | ((rbits >> (23 - MBITS)) & ((1 << MBITS) - 1))
    code_sub = (tl.where(r < min_normal, r, 0.0) * inv_sub_ulp).to(tl.int32)  # NaN compares False: 0
    code = tl.where(normal, code_normal, code_sub)
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)  # sign bit, -0 included
    code = tl.where(y != y, 0x7F, code)  # NaN
    return code.to(tl.uint8).to(out_dtype, bitcast=True)


@triton.jit
def _cast_fp8(y, out_dtype: tl.constexpr, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
              SOFT_ROUND: tl.constexpr):
    if SOFT_ROUND:
        y = tl.where(y > FMAX, FMAX, y)  # comparisons keep NaN (tl.clamp/min/max would not)
        y = tl.where(y < -FMAX, -FMAX, y)
        return _soft_cast_fp8(y, out_dtype, MBITS, EMIN)
    else:
        # compiled for sm_89+ (Triton has no fp8 casts below), this is cvt.rn.satfinite: it clamps to +-FMAX
        # (Inf included) and keeps NaN, what the two compares above do, which cost ~6 instructions per element
        return y.to(out_dtype)


@triton.jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN < inf is False: NaN and Inf count as 0


@triton.jit
def _scale_from_amax(amax, FMAX: tl.constexpr):
    """fp8mon.agent.formats.current_scale exactly: reciprocal(amax) * max in fp32; 1.0 if amax <= 0 (or s inf)."""
    s = tl.math.div_rn(1.0, tl.where(amax > 0, amax, 1.0)) * FMAX
    return tl.where((amax > 0) & (s < float("inf")), s, 1.0)


@triton.jit
def _current_scale_from_partials(part_ptr, n_part, FMAX: tl.constexpr, P_BLOCK: tl.constexpr):
    offs = tl.arange(0, P_BLOCK)
    p = tl.load(part_ptr + offs, mask=offs < n_part, other=0.0)
    amax = tl.max(p, 0)
    return amax, _scale_from_amax(amax, FMAX)


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _amax_partials_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _finite_abs(x))
    tl.store(part_ptr + pid, tl.max(acc, 0))


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, part_ptr, n_part, scale_ptr, accum_ptr, meta_ptr, n,
                     FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     CURRENT: tl.constexpr, SOFT_ROUND: tl.constexpr, P_BLOCK: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if CURRENT:
        amax, s = _current_scale_from_partials(part_ptr, n_part, FMAX, P_BLOCK)
    else:
        s = tl.load(scale_ptr)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _cast_fp8(x * s, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
    tl.store(q_ptr + offs, q, mask=mask)
    if not CURRENT:
        tl.atomic_max(accum_ptr, tl.max(_finite_abs(x), 0))
    if pid == 0:
        if CURRENT:
            tl.store(meta_ptr, amax)
        tl.store(meta_ptr + 1, s)
        tl.store(meta_ptr + 2, tl.math.div_rn(1.0, s))


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _quantize_stats_kernel(x_ptr, q_ptr, part_ptr, n_part, scale_ptr, accum_ptr, meta_ptr, n,
                           sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, c_ptr, c_mean, c_std, k, ahm_ptr, ahm_val,
                           FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, OUT_DTYPE: tl.constexpr,
                           CURRENT: tl.constexpr, SOFT_ROUND: tl.constexpr, P_BLOCK: tl.constexpr,
                           UTHR: tl.constexpr, OTHR: tl.constexpr, C_PTR: tl.constexpr, AHM_PTR: tl.constexpr,
                           HIST: tl.constexpr, BLOCK: tl.constexpr):
    """``_quantize_kernel`` made persistent, with the statistics of x from the same registers."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CURRENT:
        amax, s = _current_scale_from_partials(part_ptr, n_part, FMAX, P_BLOCK)
    else:
        s = tl.load(scale_ptr)
    tu, to, lo, hi = fused_prologue(s, c_ptr, c_mean, c_std, k, UTHR, OTHR, C_PTR)
    r = tl.arange(0, BLOCK)
    m0 = pid * BLOCK + r < n
    c, p, ok = shift_of(tl.load(x_ptr + pid * BLOCK + r, mask=m0, other=0.0).to(tl.float32), m0)
    ncp = -(c * p)
    zf = tl.zeros([BLOCK], tl.float32)
    zi = tl.zeros([BLOCK], tl.int32)
    s1, s2, s3, s4, am, cu, co, cout, cz, h = zf, zf, zf, zf, zf, zi, zi, zi, zi, tl.zeros([64], tl.int32)
    ce = zi
    ntiles = tl.cdiv(n, BLOCK)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    for t in range(pid, ntiles, nprog):
        offs = t * BLOCK + r
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = _cast_fp8(x * s, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        tl.store(q_ptr + offs, q, mask=mask)
        s1, s2, s3, s4, am, cu, co, cout, cz, h = tile_fast(
            x, mask, p, ncp, tu, to, lo, hi, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, True, False, ht)
        ce += mask.to(tl.int32)
    if pid == 0:
        if CURRENT:
            tl.store(meta_ptr, amax)
        tl.store(meta_ptr + 1, s)
        tl.store(meta_ptr + 2, tl.math.div_rn(1.0, s))
    nelem = tl.sum(ce, 0)
    ok2, mean, m2, m3, m4, samax, zeros, under, over, outl, hist = fast_result(
        nelem, c, p, tu, to, s1, s2, s3, s4, am, cu, co, cout, cz, h, HIST, ht)
    nfin = nelem
    nonfin = tl.zeros([], tl.int32)
    if not (ok & ok2):  # NaN/Inf or a poor shift: re-read this program's tiles, carefully
        acc = tl.zeros([BLOCK], tl.float64)
        cnt = zi
        for t in range(pid, ntiles, nprog):
            offs = t * BLOCK + r
            mask = offs < n
            acc, cnt = tile_sum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask, acc, cnt)
        nfin = tl.sum(cnt, 0)
        mean0 = tl.sum(acc, 0) / tl.maximum(nfin, 1).to(tl.float64)
        zd = tl.zeros([BLOCK], tl.float64)
        t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = zd, zd, zd, zd, zf, zi, zi, zi, zi, zi, \
            tl.zeros([64], tl.int32)
        for t in range(pid, ntiles, nprog):
            offs = t * BLOCK + r
            mask = offs < n
            t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h = tile_careful(
                tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask, mean0, tu, to, lo, hi,
                t1, t2, t3, t4, am, cu, co, cout, cz, cnf, h, HIST)
        mean, m2, m3, m4, samax, zeros, under, over, outl, nonfin = careful_result(
            nfin, mean0, t1, t2, t3, t4, am, cu, co, cout, cz, cnf)
        hist = h
    if not CURRENT:  # the finite amax, from either path (as in quantize_transpose's statistics variant)
        tl.atomic_max(accum_ptr, samax)
    fused_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, s, nelem, nfin, nonfin, zeros,
                   outl, under, over, samax, mean, m2, m3, m4, hist, FMAX, UTHR, AHM_PTR, HIST)


@triton.jit
def _delayed_update_kernel(accum_ptr, hist_ptr, scale_ptr, meta_ptr, H, inv_margin,
                           FMAX: tl.constexpr, H_BLOCK: tl.constexpr):
    """One program: amax <- accumulator (then 0); history <- [amax, history[:-1]]; next scale."""
    amax = tl.load(accum_ptr)
    offs = tl.arange(0, H_BLOCK)
    prev = tl.load(hist_ptr + offs - 1, mask=(offs >= 1) & (offs < H), other=0.0)
    new = tl.where(offs == 0, amax, prev)
    tl.debug_barrier()  # every thread's reads of the old history before any write
    tl.store(hist_ptr + offs, new, mask=offs < H)
    tl.store(accum_ptr, 0.0)
    tl.store(meta_ptr, amax)
    m = tl.max(tl.where(offs < H, new, 0.0), 0)
    s = tl.math.div_rn(1.0, tl.where(m > 0, m, 1.0)) * FMAX * inv_margin
    tl.store(scale_ptr, tl.where((m > 0) & (s < float("inf")), s, 1.0))


# ----------------------------------------------------------------------------------------------------
# launchers


_TL_DTYPE = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


def _consts(fmt: Fp8Format) -> dict:
    return dict(FMAX=float(fmt.max), MBITS=_MBITS[fmt.name], EMIN=_EMIN[fmt.name], SOFT_ROUND=INTERPRET,
                OUT_DTYPE=_TL_DTYPE[fmt.name])


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers (``triton.cdiv`` is a constexpr function: microseconds per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1), of a host integer (``triton.next_power_of_2`` is slow there too)."""
    return 1 << max(n - 1, 0).bit_length()


def _num_sms(device: torch.device) -> int:
    return _sms(device.index or 0) if device.type == "cuda" else 4


def persistent_programs(work: int, per_sm: int, device: torch.device) -> int:
    """Programs of a persistent kernel over ``work`` items: ``per_sm`` per SM (4 in the interpreter), at least one."""
    return max(1, min(work, 4 if INTERPRET else per_sm * _num_sms(device)))


def reg_cap(cap: int | None) -> dict:
    """The launch option capping a kernel's registers at ``cap`` (ptxas); none without a cap or in the interpreter."""
    return {"maxnreg": cap} if cap and not INTERPRET else {}


def amax_partials(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """fp32 tensor of per-program partial amaxes of contiguous x (reduce with .max(); stage 1 of 2)."""
    n = x.numel()
    grid = max(1, min(cdiv(n, block), 4 * _num_sms(x.device), MAX_PARTIALS))
    part = torch.empty(grid, dtype=torch.float32, device=x.device)
    _amax_partials_kernel[(grid,)](x, part, n, BLOCK=block, num_warps=8)
    return part


def delayed_update(accum: torch.Tensor, history: torch.Tensor, scale: torch.Tensor, meta: torch.Tensor,
                   fmt: Fp8Format | str, margin: float = 0) -> None:
    """Roll ``history`` (in place) with the amax collected in ``accum``, write the next ``scale``."""
    fmt = by_name(fmt)
    H = history.numel()
    _delayed_update_kernel[(1,)](accum, history, scale, meta, H, 2.0 ** -margin, FMAX=float(fmt.max),
                                 H_BLOCK=next_power_of_2(max(H, 1)), num_warps=4)


def stats_consts(fmt: Fp8Format) -> dict:
    return dict(UTHR=float(fmt.underflow_threshold), OTHR=float(fmt.overflow_threshold))


# Persistent programs per SM of the casts with statistics (here and quantize_transpose.py): at quantize_transpose's
# register cap (128 a thread, 8 warps) two are resident, one wave; four would queue a second wave, which is slower.
STATS_PROGRAMS_PER_SM = 2


def stats_programs(tiles: int, device: torch.device) -> int:
    """Programs of a persistent statistics kernel: every program gets at least one tile."""
    return max(1, min(tiles, STATS_PROGRAMS_PER_SM * _num_sms(device)))


def quantize(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None,
             accum: torch.Tensor | None = None, block: int = 2048, stats: ts.Target | None = None) -> Quantized:
    """Quantize x (any shape, made contiguous) to ``fmt``.

    ``scale is None``: current scaling (amax pass + cast pass). Else delayed: cast with the fp32
    device scalar ``scale`` and max the tensor's amax into the fp32 device scalar ``accum`` (call
    ``delayed_update`` afterwards; ``meta[0]`` (amax) is written by it).
    ``stats``: also write x's statistics row (with the scale used) into the target, from the same read.
    """
    fmt = by_name(fmt)
    x = x.contiguous()
    n = x.numel()
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    meta = torch.empty(3, dtype=torch.float32, device=x.device)
    if stats is not None:
        grid = (stats_programs(cdiv(n, block), x.device),)
        if scale is None:
            part = amax_partials(x)
            args = (x, q, part, part.numel(), meta, meta, meta, n)
            P = next_power_of_2(part.numel())
        else:
            assert accum is not None, "delayed scaling needs an amax accumulator"
            args = (x, q, meta, 0, scale, accum, meta, n)
            P = 1
        _quantize_stats_kernel[grid](*args, **ts.fused_args(stats, grid[0], x.device), CURRENT=scale is None,
                                     P_BLOCK=P, BLOCK=block, num_warps=8, **_consts(fmt), **stats_consts(fmt))
        return Quantized(q, None, meta)
    grid = (max(1, cdiv(n, block)),)
    if scale is None:
        part = amax_partials(x)
        _quantize_kernel[grid](x, q, part, part.numel(), meta, meta, meta, n, CURRENT=True,
                               P_BLOCK=next_power_of_2(part.numel()), BLOCK=block, num_warps=8,
                               **_consts(fmt))
    else:
        assert accum is not None, "delayed scaling needs an amax accumulator"
        _quantize_kernel[grid](x, q, meta, 0, scale, accum, meta, n, CURRENT=False, P_BLOCK=1, BLOCK=block,
                               num_warps=8, **_consts(fmt))
    return Quantized(q, None, meta)


# ----------------------------------------------------------------------------------------------------
# torch references (also the CPU path of trainer.fp8_linear)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over finite elements, fp32 0-d (SPEC section 4)."""
    a = x.detach().to(torch.float32).abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax() if a.numel() else a.new_zeros(())


def quantize_ref(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None,
                 transpose: bool = False) -> Quantized:
    """What ``quantize``/``quantize_transpose`` compute, in torch (agent.formats' scale and cast).

    ``transpose`` gives ``data_t`` as a transposed *view* of the 2-D data (the CPU GEMM takes any layout).
    With ``scale`` (delayed) ``meta[0]`` is this tensor's amax too (the Triton path writes it in
    ``delayed_update``)."""
    fmt = by_name(fmt)
    amax = finite_amax(x)
    s = _finite_or_one(current_scale(amax, fmt)) if scale is None else scale.detach().to(torch.float32).reshape(())
    q = _quantize_cast(x, s, fmt)
    meta = torch.stack([amax, s, torch.reciprocal(s)])
    return Quantized(q, q.t() if transpose else None, meta)


def delayed_update_ref(amax: torch.Tensor, history: torch.Tensor, scale: torch.Tensor,
                       fmt: Fp8Format | str, margin: float = 0) -> None:
    """In place: history <- [amax, history[:-1]]; scale <- fmt.max / max(history) / 2**margin."""
    new = torch.cat([amax.reshape(1).to(history.dtype), history[:-1]])
    history.copy_(new)
    scale.copy_(_finite_or_one(delayed_scale(history, fmt, margin)).reshape(scale.shape))


def stats_ref(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor, target: ts.Target) -> torch.Tensor:
    """What the fused statistics write: ``stats.torch_path.partials`` of x with the scale in use (outliers
    against the target's center), merged into the target row like the kernel does."""
    c = target.center
    row = ds.partials(x, fmt=fmt, scale=scale, amax_history_max=target.amax_history_max,
                      outlier_k=target.outlier_k, hist=target.hist,
                      outlier_center=(0.0, float("nan")) if c is None else c)
    if target.merge:
        row = ds.merge(target.rows[target.index], row)
    target.rows[target.index].copy_(row)
    return row
