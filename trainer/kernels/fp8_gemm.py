"""FP8 GEMM in Triton: ``C = (A @ Bᵀ) * scale_a * scale_b (+ bias)``, fp32 accumulation.

A is (M, K) and B is (N, K), both K-major (row-major, contiguous along K): on Hopper an FP8 ``tl.dot``
(wgmma) needs both operands K-major in shared memory, otherwise Triton silently drops the software
pipelining. Any mix of E4M3 and E5M2 operands (dgrad and wgrad are E5M2 gradient x E4M3 weight or
activation). Output bf16 or fp32 (or fp16). ``scale_a``/``scale_b`` are fp32 device scalars (the
quantizer's ``scale_inv``), read by the kernel: no host sync.

Accumulation: on sm90 Triton accumulates FP8 products in the tensor cores' reduced-precision
accumulator by default (like cuBLAS fast accumulation). ``fast_accum=False`` passes
``max_num_imprecise_acc=BK``, which promotes the partial sums into the fp32 accumulator after every
BK-deep block (BK = 128 in the tuned configs, as cuBLAS and DeepGEMM do); the Fp8Linear recipe uses fast
accumulation in the forward GEMM and precise accumulation in the two backward GEMMs.

Two Triton implementations, both autotuned over BM x BN x BK in {128x256x128, 256x128x128, 128x128x128, ...},
3-5 stages, 8 warps, grouped tile ordering (GROUP_M tiles of M share B tiles in L2):
  * ``"tma"``: persistent (one program per SM), A/B tiles through TMA descriptors, TMA store of C in
    two half tiles (Triton's persistent-matmul tutorial structure). Needs K % 16 == 0 and a C row
    pitch that is a multiple of 16 bytes.
  * ``"ptr"``: one program per tile, pointer loads (Triton's matmul tutorial structure); any shape.
  * ``"ws"`` (trainer/kernels/fp8_gemm_ws.py, Gluon, sm90 only): precise accumulation only, no statistics
    epilogue; a TMA producer warp and two consumer warpgroups that promote without a CTA-wide barrier, so one
    warpgroup's fp32 adds overlap the other's wgmma. Falls back to "tma"/"ptr" elsewhere (and in the
    interpreter, which has no Gluon). Among ``impl="auto"``'s candidates for precise GEMMs without statistics.
Split-K (the Triton kernels) when the output has fewer 128x128 tiles than the GPU has SMs and K >= 8192
(the 124M model's wgrads, e.g. 768 x 768 x 16384): fp32 partials per K slice, then a fixed-order reduce.
``impl="auto"`` (the default) runs every candidate on the first call of each shape/dtype/flag combination (that
call autotunes and synchronizes), checks them against each other, keeps the faster; later calls are a
dict lookup and never synchronize. A variant with a statistics epilogue (``stats=``) is tuned among two configs
only, of tiles of at most 128x128: the one chosen for the same GEMM without statistics (tuned first if need be)
when it qualifies, and a 128x128 tile. Its epilogue accumulates per tile row (``agent.stats.device.rows_add``); it
costs a wgrad more than a separate read of the gradient does, which is why Fp8Linear takes grad_weight's row from
a separate read.

Speed: the Triton kernels' fast-accumulation forward GEMM is close to torch._scaled_mm; their precise backward
GEMMs fall behind it, because Triton's promotion (a wait on the wgmma chain and an fp32 add per BK block, both warp
groups in lockstep) leaves the tensor cores idle during every add: the Gluon "ws" kernel, among the candidates for
precise GEMMs, avoids that. Eager calls on small shapes are bound by the launch's Python host time. Promoting every
256 instead of 128 products (BK=256) would be faster but less accurate, so it is not used.

Reference beside it: ``fp8_gemm_ref`` (``torch._scaled_mm``, or dequantize + fp32 matmul where
_scaled_mm refuses the operands).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats.device import fused_bounds, nofmt_epilogue, rows_add, rows_partial, rows_zero

from . import fp8_gemm_ws as _ws
from .quantize import _num_sms, cdiv, stats_ref
from .timing import fastest

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
INTERPRET_CONFIG = {"BM": 64, "BN": 64, "BK": 64, "GROUP_M": 4}

_CFG = [  # (BM, BN, BK, stages, warps)
    (128, 256, 128, 3, 8),
    (256, 128, 128, 3, 8),
    (128, 256, 128, 4, 8),
    (256, 128, 128, 4, 8),
    (128, 128, 128, 4, 8),
    (128, 128, 128, 5, 8),
    (64, 128, 128, 4, 4),
]


def _ptr_configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in _CFG]


def _tma_set_block_shapes(nargs):
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn // 2]


def _tma_configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w,
                          pre_hook=_tma_set_block_shapes)
            for bm, bn, bk, s, w in _CFG if w == 8]


@triton.jit
def _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive tile rows sweep the columns together (B stays in L2)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _to_out(acc, out_dtype: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Output cast. Under the interpreter (SOFT_ROUND) fp32 -> bf16 is rounded to nearest even with integer
    arithmetic first: the interpreter's own downcast loses the carry into the exponent."""
    if SOFT_ROUND and (out_dtype == tl.bfloat16):
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    return acc.to(out_dtype)


@triton.jit
def _rc_rows(st, y, row0, col0, M, N, lo, hi, HIST: tl.constexpr):
    """The statistics row state ``st`` (``rows_zero``) with the tile ``y`` of the (M, N) output C added (its values
    in the output dtype) whose first row and column are ``row0``, ``col0``."""
    rows = row0 + tl.arange(0, y.shape[0])
    cols = col0 + tl.arange(0, y.shape[1])
    full = (row0 + y.shape[0] <= M) & (col0 + y.shape[1] <= N)  # scalars: a tl.min over rows crossed the CTA
    return rows_add(st, y.to(tl.float32), (rows[:, None] < M) & (cols[None, :] < N), full, lo, hi, HIST)


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _fp8_gemm_ptr_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                         stride_cm, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean, c_std, k,
                         ahm_ptr, ahm_val, KEY: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACC: tl.constexpr,
                         SOFT_ROUND: tl.constexpr, SPLIT_K: tl.constexpr, STATS: tl.constexpr,
                         C_PTR: tl.constexpr, AHM_PTR: tl.constexpr, HIST: tl.constexpr,
                         FMAX: tl.constexpr, UTHR: tl.constexpr, SMODE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    offs_am = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows/cols: loads need no M/N mask
    offs_bn = (pid_n * BN + tl.arange(0, BN)) % N
    offs_am = tl.max_contiguous(tl.multiple_of(offs_am, BM), BM)
    offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BN), BN)
    # split-K: program (tile, pid_k) sums K tiles [k0, k1); partial sums go to an fp32 workspace
    k_tiles = tl.cdiv(K, BK)
    if SPLIT_K == 1:
        k0 = 0
        k1 = k_tiles
    else:
        per = tl.cdiv(k_tiles, SPLIT_K)
        k0 = tl.program_id(1) * per
        k1 = tl.minimum(k0 + per, k_tiles)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + (k0 * BK + offs_k)[None, :]
    b_ptrs = b_ptr + offs_bn[:, None].to(tl.int64) * stride_bn + (k0 * BK + offs_k)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(k0, k1):
        k_left = K - kt * BK
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        if FAST_ACC:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BK)
        a_ptrs += BK
        b_ptrs += BK
    offs_cm = pid_m * BM + tl.arange(0, BM)
    offs_cn = pid_n * BN + tl.arange(0, BN)
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    if SPLIT_K == 1:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_cn, mask=offs_cn < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_cm[:, None].to(tl.int64) * stride_cm + offs_cn[None, :]
        y = _to_out(acc, c_ptr.dtype.element_ty, SOFT_ROUND)
        tl.store(c_ptrs, y, mask=c_mask)
        if STATS:  # one partial per program (= tile)
            lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
            part = rows_partial(_rc_rows(rows_zero(BM), y, pid_m * BM, pid_n * BN, M, N, lo, hi, HIST))
            nofmt_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, part, AHM_PTR, HIST, FMAX,
                           UTHR, SMODE)
    else:  # c_ptr is the (SPLIT_K, M, N) fp32 workspace
        ws_ptrs = (c_ptr + tl.program_id(1).to(tl.int64) * M * N + offs_cm[:, None].to(tl.int64) * N
                   + offs_cn[None, :])
        tl.store(ws_ptrs, acc, mask=c_mask)


@triton.jit
def _reduce_block(ws_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, MN, N, blk, SPLIT_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SOFT_ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``blk`` of C = sum over splits of the workspace, * sa * sb (+ bias); returns (C values, offsets)."""
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    y = _to_out(acc, c_ptr.dtype.element_ty, SOFT_ROUND)
    tl.store(c_ptr + offs, y, mask=mask)
    return y, offs


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _splitk_reduce_kernel(ws_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, MN, N, sp_ptr, ctr_ptr, dst_ptr,
                          dst_index, merge, cen_ptr, c_mean, c_std, k, ahm_ptr, ahm_val, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SOFT_ROUND: tl.constexpr, STATS: tl.constexpr,
                          C_PTR: tl.constexpr, AHM_PTR: tl.constexpr, HIST: tl.constexpr,
                          FMAX: tl.constexpr, UTHR: tl.constexpr, SMODE: tl.constexpr, BLOCK: tl.constexpr):
    """C = sum over splits of the workspace, * sa * sb (+ bias), in a fixed order (deterministic). With
    ``STATS`` the grid is persistent (blocks pid, pid + nprog, ...): one statistics partial per program."""
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        st = rows_zero(BLOCK // 16)
        for blk in range(tl.program_id(0), tl.cdiv(MN, BLOCK), tl.num_programs(0)):
            y, offs = _reduce_block(ws_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, MN, N, blk + tl.zeros([], tl.int32),
                                    SPLIT_K, HAS_BIAS, SOFT_ROUND, BLOCK)
            o2 = tl.reshape(offs, [BLOCK // 16, 16])  # the statistics helpers take 2-D tiles
            full = (blk + 1 + tl.zeros([], tl.int64)) * BLOCK <= MN
            st = rows_add(st, tl.reshape(y, [BLOCK // 16, 16]).to(tl.float32), o2 < MN, full, lo, hi, HIST)
        nofmt_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, rows_partial(st), AHM_PTR, HIST,
                       FMAX, UTHR, SMODE)
    else:
        _reduce_block(ws_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, MN, N, tl.program_id(0), SPLIT_K, HAS_BIAS,
                      SOFT_ROUND, BLOCK)


@triton.jit(do_not_specialize=["dst_index", "merge"])
def _fp8_gemm_tma_kernel(a_desc, b_desc, c_desc, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                         sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean, c_std, k,
                         ahm_ptr, ahm_val,
                         KEY: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_ACC: tl.constexpr, NUM_SMS: tl.constexpr,
                         SOFT_ROUND: tl.constexpr, SPLIT_K: tl.constexpr, STATS: tl.constexpr, C_PTR: tl.constexpr,
                         AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                         SMODE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    num_items = num_tiles * SPLIT_K  # work item = (output tile, K slice)
    per = tl.cdiv(k_tiles, SPLIT_K)
    scale = tl.load(sa_ptr) * tl.load(sb_ptr)
    out_dtype = c_desc.dtype
    item_c = start_pid - NUM_SMS  # separate epilogue counter (tutorial: keeps the flattened loop simple)
    if STATS:  # the program's tiles accumulate into one row state
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        st = rows_zero(BM)
    for item in tl.range(start_pid, num_items, NUM_SMS, flatten=True):
        if SPLIT_K == 1:
            pid_m, pid_n = _tile_ids(item, num_pid_m, num_pid_n, GROUP_M)
            k0 = 0
            k1 = k_tiles
        else:
            pid_m, pid_n = _tile_ids(item % num_tiles, num_pid_m, num_pid_n, GROUP_M)
            k0 = (item // num_tiles) * per
            k1 = tl.minimum(k0 + per, k_tiles)
        offs_am = pid_m * BM
        offs_bn = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k0, k1):
            offs_k = ki * BK
            a = a_desc.load([offs_am, offs_k])
            b = b_desc.load([offs_bn, offs_k])
            if FAST_ACC:
                acc = tl.dot(a, b.T, acc)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BK)
        item_c += NUM_SMS
        if SPLIT_K == 1:
            pid_m, pid_n = _tile_ids(item_c, num_pid_m, num_pid_n, GROUP_M)
            offs_cm = pid_m * BM
            offs_cn = pid_n * BN
            acc = acc * scale
            if HAS_BIAS:
                cols = offs_cn + tl.arange(0, BN)
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc = tl.reshape(acc, (BM, 2, BN // 2))
            acc = tl.permute(acc, (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            y0 = _to_out(acc0, out_dtype, SOFT_ROUND)
            y1 = _to_out(acc1, out_dtype, SOFT_ROUND)
            c_desc.store([offs_cm, offs_cn], y0)
            c_desc.store([offs_cm, offs_cn + BN // 2], y1)
            if STATS:  # after the stores are issued, so that they drain meanwhile; a half tile at a time
                st = _rc_rows(st, y0, offs_cm, offs_cn, M, N, lo, hi, HIST)
                st = _rc_rows(st, y1, offs_cm, offs_cn + BN // 2, M, N, lo, hi, HIST)
        else:  # unscaled fp32 partial sums into the (SPLIT_K, M, N) workspace
            pid_m, pid_n = _tile_ids(item_c % num_tiles, num_pid_m, num_pid_n, GROUP_M)
            rows = pid_m * BM + tl.arange(0, BM)
            cols = pid_n * BN + tl.arange(0, BN)
            ws = (ws_ptr + (item_c // num_tiles).to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N
                  + cols[None, :])
            tl.store(ws, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
    if STATS:
        nofmt_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, rows_partial(st), AHM_PTR, HIST,
                       FMAX, UTHR, SMODE)


def _tune_bench(fn, quantiles=None):
    """Shorter timing than the autotuner's default: a dozen configs are timed for each shape."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# The config the autotuner chose for a GEMM without statistics, per (impl, shape, flags): a variant with a
# statistics epilogue is tuned among that config and one 128x128 tile only. Tuning it among every config cost
# the first reporting step minutes at 1.5B (each config of each statistics variant is a large kernel to
# compile), for an epilogue that runs once per tile and leaves the main loop's best shape unchanged. Tiles over
# 128 x 128 are left out: their 128 fp32 accumulator registers per thread plus the epilogue's spill (ptxas,
# sm_90a: 900+ bytes of stack for 128 x 256 against 8 for 128 x 128).
_PLAIN_BEST: dict = {}
_STATS_SPARE = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_stages": 4, "num_warps": 8}
_STATS_MAX_TILE = 128 * 128


def _plain_key(impl: str, M: int, N: int, K: int, flags: dict) -> tuple:
    return (impl, M, N, K, flags["KEY"], flags["HAS_BIAS"], flags["FAST_ACC"], flags["SPLIT_K"])


def _config_dict(cfg) -> dict:
    return dict(cfg.kwargs, num_stages=cfg.num_stages, num_warps=cfg.num_warps)


def _stats_prune(impl: str):
    """The autotuner's ``early_config_prune`` of ``impl``: every config without statistics; with statistics,
    the configs of at most 128 x 128 tiles, of those the plain variant's best config (when known) and
    ``_STATS_SPARE``."""

    def prune(configs, nargs, **kwargs):
        if not kwargs.get("STATS"):
            return configs
        small = [c for c in configs if c.kwargs["BM"] * c.kwargs["BN"] <= _STATS_MAX_TILE] or configs
        best = _PLAIN_BEST.get(_plain_key(impl, nargs["M"], nargs["N"], nargs["K"], kwargs))
        if best is None:
            return small
        keep = [c for c in small if _config_dict(c) in (best, _STATS_SPARE)]
        return keep or small

    return prune


def _autotune(impl: str, configs, extra=()):
    key = ["M", "N", "K", "KEY", "HAS_BIAS", "FAST_ACC", "STATS", *extra]
    # the statistics row is restored after every timed run (a merge into it must happen once)
    kw = dict(configs=configs, key=key, restore_value=["dst_ptr"],
              prune_configs_by={"early_config_prune": _stats_prune(impl)})
    try:
        return triton.autotune(**kw, do_bench=_tune_bench)
    except TypeError:  # pragma: no cover - Triton without the do_bench argument
        return triton.autotune(**kw)


_ptr_tuned = _autotune("ptr", _ptr_configs(), ["SPLIT_K"])(_fp8_gemm_ptr_kernel)
_tma_tuned = _autotune("tma", _tma_configs(), ["SPLIT_K"])(_fp8_gemm_tma_kernel)


def _tuned_launch(tuner, impl: str, grid, args, flags: dict, M: int, N: int, K: int) -> None:
    """An autotuned launch; a plain one records its config for the statistics variants of the same GEMM."""
    tuner[grid](*args, **flags)
    if not flags["STATS"]:
        best = getattr(tuner, "best_config", None)  # None (unknown): the statistics variants try every config
        _PLAIN_BEST.setdefault(_plain_key(impl, M, N, K, flags), None if best is None else _config_dict(best))


def _tma_ok(a, b, out_dtype) -> bool:
    K = a.shape[1]
    N = b.shape[0]
    esz = torch.finfo(out_dtype).bits // 8
    return (TensorDescriptor is not None and K % 16 == 0 and (N * esz) % 16 == 0 and a.data_ptr() % 16 == 0
            and b.data_ptr() % 16 == 0 and a.stride(0) == K and b.stride(0) == K)


_AUTO_CHOICE: dict = {}
AUTO_CANDIDATES = ["ptr", "tma"]  # timed by impl="auto", with "ws" where it runs


def _ws_ok(a, b, out_dtype, fast_accum: bool, stats) -> bool:
    """Where impl "ws" (fp8_gemm_ws, Gluon, sm90) runs: precise accumulation, no statistics epilogue, TMA alignment."""
    return not fast_accum and stats is None and _ws.supported(a) and _tma_ok(a, b, out_dtype)


def _pick_impl(a, b, scale_a, scale_b, out_dtype, bias, fast_accum) -> str:
    """impl="auto": the first call of a (shape, dtypes, flags) runs every candidate (autotuned), checks it
    against the first, times them and keeps the fastest (this synchronizes, like the autotuner's own first
    call); later calls are a dict lookup. A candidate that fails to compile or disagrees is skipped. The
    candidates are compared by ``timing.fastest`` (device time, medians of interleaved rounds)."""
    key = (a.shape, b.shape, a.dtype, b.dtype, out_dtype, bias is not None, fast_accum, a.device)
    impl = _AUTO_CHOICE.get(key)
    if impl is None:
        fns, ref = {}, None
        cands = AUTO_CANDIDATES if _tma_ok(a, b, out_dtype) else ["ptr"]
        for cand in cands + ["ws"] * _ws_ok(a, b, out_dtype, fast_accum, None):
            fn = functools.partial(fp8_gemm, a, b, scale_a, scale_b, out_dtype, bias, fast_accum, cand)
            try:
                out = fn().float()  # autotunes outside the timing
            except Exception as exc:
                if cand == "ptr":
                    raise
                warnings.warn(f"fp8_gemm: variant {cand} unavailable ({type(exc).__name__}: {exc})", stacklevel=2)
                continue
            if ref is None:
                ref = out
            elif not bool(((out - ref).norm() <= 1e-2 * ref.norm()).item()):
                warnings.warn(f"fp8_gemm: variant {cand} disagrees with {cands[0]}; skipped", stacklevel=2)
                continue
            fns[cand] = fn
        impl = _AUTO_CHOICE[key] = fastest(fns)
    return impl


def _max_programs(M: int, N: int, impl: str, config: dict | None, num_sms: int) -> int:
    """An upper bound of the GEMM kernel's programs over the configs it may run with (autotuning)."""
    shapes = [(config["BM"], config["BN"])] if config is not None else [(c[0], c[1]) for c in _CFG]
    tiles = max(cdiv(M, bm) * cdiv(N, bn) for bm, bn in shapes)
    return tiles if impl == "ptr" else min(num_sms, tiles)


def _stats_args(stats, programs: int, dummy: torch.Tensor) -> dict:
    """The statistics arguments of the GEMM and reduce kernels (``dummy`` pointers when ``stats`` is None)."""
    return ts.epilogue_args(stats, programs, dummy)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None, fast_accum: bool = True,
             impl: str | None = None, config: dict | None = None, split_k: int | None = None,
             stats: ts.Target | None = None) -> torch.Tensor:
    """(M, N) = (a @ b.T) * scale_a * scale_b (+ bias), a: (M, K) fp8, b: (N, K) fp8, both K-major.

    ``config`` = {"BM", "BN", "BK", "GROUP_M", "num_warps", "num_stages"} bypasses the autotuner (tests,
    interpreter). ``impl``: "auto" (None) | "tma" | "ws" | "ptr"; the TMA variants
    fall back to "ptr" where the TMA alignment does not hold; "ws" (precise, sm90, no ``stats``) falls back to
    "tma" elsewhere. ``split_k`` (ptr only; None = heuristic): partial sums over
    K slices into an fp32 workspace, then a reduce kernel in a fixed order (deterministic).

    ``stats`` (an ``agent.stats.launch.Target``): also write the statistics row of the returned C (format-less:
    scale, underflow, overflow NaN) from the epilogue's registers (after the split-K reduce with split-K), no
    second read of C."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    assert a.element_size() == 1 and b.element_size() == 1, "fp8 operands expected"
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0 or K == 0:
        if K == 0:
            c = c.zero_() if bias is None else c.copy_(bias.expand(M, N))
        if stats is not None:
            stats_ref(c, stats.fmt, None, stats)
        return c
    has_bias = bias is not None
    bias_arg = bias if has_bias else scale_a
    key = f"{a.dtype}x{b.dtype}->{out_dtype}"
    if config is None and INTERPRET:  # the autotuner times configs with CUDA events
        config = INTERPRET_CONFIG
    if impl is None:
        impl = "auto"
    if impl not in ("ptr", "auto") and not _tma_ok(a, b, out_dtype):
        impl = "ptr"
    if impl == "auto":
        impl = _pick_impl(a, b, scale_a, scale_b, out_dtype, bias, fast_accum) if a.is_cuda else "tma"
        if impl == "tma" and not _tma_ok(a, b, out_dtype):
            impl = "ptr"
    if impl not in ("ptr", "tma", "ws"):
        raise ValueError(f"unknown impl {impl!r}")
    if impl == "ws" and not _ws_ok(a, b, out_dtype, fast_accum, stats):
        impl = "tma" if _tma_ok(a, b, out_dtype) else "ptr"
    if impl == "ws" and split_k is None:  # few tiles: its stream-K configs fill the GPU (no workspace split)
        split_k = 1
    if split_k is None:  # few output tiles and a long K (the 124M wgrads): split K to fill the GPU
        split_k = 4 if (a.is_cuda and cdiv(M, 128) * cdiv(N, 128) < _num_sms(a.device)
                        and K >= 8192) else 1
    ws = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device) if split_k > 1 else None
    plain = dict(KEY=key, HAS_BIAS=has_bias, FAST_ACC=fast_accum, SPLIT_K=1)
    if stats is not None and ws is None and config is None and impl in ("ptr", "tma") and \
            _plain_key(impl, M, N, K, plain) not in _PLAIN_BEST:
        # first call of this GEMM with statistics: tune the plain variant first (see _PLAIN_BEST)
        fp8_gemm(a, b, scale_a, scale_b, out_dtype, bias, fast_accum, impl, None, 1)
    flags = dict(KEY=key, HAS_BIAS=has_bias, FAST_ACC=fast_accum, SOFT_ROUND=INTERPRET, SPLIT_K=split_k)
    num_sms = _num_sms(a.device)
    programs = _max_programs(M, N, impl, config, num_sms) if stats is not None and ws is None else 0
    flags.update(_stats_args(stats if ws is None else None, programs, scale_a))
    if impl == "ws":
        _ws.run(a, b, c, ws, scale_a, scale_b, bias, split_k, num_sms)
    elif impl == "ptr":
        args = (a, b, c if ws is None else ws, scale_a, scale_b, bias_arg, M, N, K, a.stride(0), b.stride(0),
                c.stride(0))
        if config is None:
            grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]), split_k)  # noqa: E731
            _tuned_launch(_ptr_tuned, "ptr", grid, args, flags, M, N, K)
        else:
            cfg = dict(config)
            grid = (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]), split_k)
            _fp8_gemm_ptr_kernel[grid](*args, **flags, **cfg)
    else:
        flags.update(NUM_SMS=num_sms)
        dummy = [1, 1]
        a_desc = TensorDescriptor(a, [M, K], [K, 1], dummy)
        b_desc = TensorDescriptor(b, [N, K], [K, 1], dummy)
        c_desc = TensorDescriptor(c, [M, N], [N, 1], dummy)
        args = (a_desc, b_desc, c_desc, c if ws is None else ws, scale_a, scale_b, bias_arg, M, N, K)
        if config is None:
            def grid(meta):
                return (min(num_sms, cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]) * split_k),)

            _tuned_launch(_tma_tuned, "tma", grid, args, flags, M, N, K)
        else:
            cfg = dict(config)
            _tma_set_block_shapes({"a_desc": a_desc, "b_desc": b_desc, "c_desc": c_desc, **cfg})
            grid = (min(num_sms, cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]) * split_k),)
            _fp8_gemm_tma_kernel[grid](*args, **flags, **cfg)
    if ws is not None:
        block = 1024
        grid = cdiv(M * N, block)
        if stats is not None:  # persistent: a statistics partial per program
            grid = min(grid, 4 * num_sms)
        _splitk_reduce_kernel[(grid,)](ws, c, scale_a, scale_b, bias_arg, M * N, N,
                                       **_stats_args(stats, grid, scale_a), SPLIT_K=split_k,
                                       HAS_BIAS=has_bias, SOFT_ROUND=INTERPRET, BLOCK=block, num_warps=4)
    return c


# ----------------------------------------------------------------------------------------------------
# torch reference (also the CPU path of trainer.fp8_linear)

_SCALED_MM_REFUSED: set = set()


def _dequant_mm(a, b, scale_a, scale_b, out_dtype, bias):
    c = (a.to(torch.float32) @ b.to(torch.float32).t()) * (scale_a.to(torch.float32) * scale_b.to(torch.float32))
    if bias is not None:
        c = c + bias.to(torch.float32)
    return c.to(out_dtype)


def fp8_gemm_ref(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                 fast_accum: bool = True, stats: ts.Target | None = None) -> torch.Tensor:
    """``_scaled_mm_ref`` (below), and with ``stats`` the row ``fp8_gemm`` writes (``stats.torch_path.partials``
    of the result)."""
    c = _scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, bias, fast_accum)
    if stats is not None:
        stats_ref(c, stats.fmt, None, stats)
    return c


def _scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, bias, fast_accum) -> torch.Tensor:
    """The same product through ``torch._scaled_mm`` on CUDA (tensorwise scales, fp32 accumulation), through
    dequantize + fp32 matmul on the CPU.

    a: (M, K), b: (N, K), any strides. On the CPU, torch's _scaled_mm accepts every case but runs a slow
    reference kernel, so the CPU path dequantizes: the same values, as every product of two FP8 numbers is exact in
    fp32, summed
    in fp32. On CUDA _scaled_mm wants mat1 row-major, mat2 column-major, dims multiple of 16 and rejects
    e5m2 x e5m2: operands are made contiguous here and anything it still refuses (odd dims, dtype pair, older
    GPU) goes through dequantize + fp32 matmul (remembered per case, so the refusal costs one try). Bias is
    added in fp32 before the output cast."""
    sa = scale_a.to(torch.float32).reshape(())
    sb = scale_b.to(torch.float32).reshape(())
    if not a.is_cuda:
        return _dequant_mm(a, b, sa, sb, out_dtype, bias)
    a, b = a.contiguous(), b.contiguous()
    case = (a.device.type, a.dtype, b.dtype, out_dtype, a.shape[0] % 16, a.shape[1] % 16, b.shape[0] % 16)
    if case not in _SCALED_MM_REFUSED:
        try:
            if bias is None:
                return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                                        use_fast_accum=fast_accum)
            c = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                                 use_fast_accum=fast_accum)
            return (c + bias.to(torch.float32)).to(out_dtype)
        except (RuntimeError, NotImplementedError):
            _SCALED_MM_REFUSED.add(case)
    return _dequant_mm(a, b, sa, sb, out_dtype, bias)
