"""Quantize a 2-D tensor to FP8 and write it *and* its transpose in one pass over the input.

The backward GEMMs need K-major operands that the forward layout does not give: wgrad dW = Gᵀ X needs
Gᵀ (N, M) and Xᵀ (K, M) contiguous, dgrad dX = G W needs Wᵀ (K, N) contiguous. Each (BM, BN) tile of x
is read once, scaled, clamped and cast, then stored row-major into ``q`` and, transposed, into ``q_t``
(``TRANS_MODE``: bf16 tiles are transposed in registers, which Triton stages through shared memory;
fp32 tiles are re-read transposed, from L1/L2, because Triton 3.6's register transpose of them came out
wrong on an H200). Scaling is as in ``quantize.py`` (current: amax
partials pass first; delayed: scale from history, amax accumulated atomically, then
``delayed_update``). Reference beside it: ``quantize_transpose_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent.formats import Fp8Format, by_name

from .quantize import (Quantized, _cast_fp8, _consts, _current_scale_from_partials, _finite_abs,
                       amax_partials, quantize_ref)

# How the transposed tile is produced, per input dtype (see the kernel): 0 = tl.trans of the fp8 tile,
# 1 = tl.trans of the fp32 tile then cast, 2 = re-read the tile transposed (no tl.trans). On an H200 with
# Triton 3.6 (bench/gemm.py --check, 2026-11), modes 0 and 1 wrote a wrong qT for fp32 inputs whose row
# count is a multiple of 16 (every 4th column garbage), while mode 2 was bit-exact; for bf16 inputs mode 0
# was bit-exact on every shape checked. Each dtype uses the mode verified for it.
TRANS_MODE = {torch.float32: 2}
TRANS_MODE_DEFAULT = 0


@triton.jit
def _quantize_transpose_kernel(x_ptr, q_ptr, qt_ptr, part_ptr, n_part, scale_ptr, accum_ptr, meta_ptr,
                               M, N, stride_xm,
                               FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                               OUT_DTYPE: tl.constexpr, CURRENT: tl.constexpr,
                               WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                               SOFT_ROUND: tl.constexpr, P_BLOCK: tl.constexpr, TRANS_MODE: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if CURRENT:
        amax, s = _current_scale_from_partials(part_ptr, n_part, FMAX, P_BLOCK)
    else:
        s = tl.load(scale_ptr)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    y = x * s
    if WRITE_Q:
        q = _cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
    if WRITE_QT:
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        if TRANS_MODE == 0:  # transpose the fp8 tile (H200 + Triton 3.6: wrong for fp32 inputs, fine for bf16)
            q_t = tl.trans(_cast_fp8(y, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND))
        elif TRANS_MODE == 1:  # transpose the fp32 tile, then cast (H200 + Triton 3.6: wrong for fp32 too)
            q_t = _cast_fp8(tl.trans(y), OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        else:  # re-read the tile transposed (from L1/L2), no register transpose at all
            x_t = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + cols[:, None], mask=mask_t, other=0.0)
            q_t = _cast_fp8(x_t.to(tl.float32) * s, OUT_DTYPE, FMAX, MBITS, EMIN, SOFT_ROUND)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], q_t, mask=mask_t)
    if not CURRENT:
        tl.atomic_max(accum_ptr, tl.max(tl.max(_finite_abs(x), 1), 0))
    if (pid_m == 0) & (pid_n == 0):
        if CURRENT:
            tl.store(meta_ptr, amax)
        tl.store(meta_ptr + 1, s)
        tl.store(meta_ptr + 2, tl.math.div_rn(1.0, s))


def quantize_transpose(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None,
                       accum: torch.Tensor | None = None, write_q: bool = True, write_qt: bool = True,
                       bm: int = 64, bn: int = 128, num_warps: int = 8, trans_mode: int | None = None) -> Quantized:
    """Quantize 2-D x (M, N) to ``fmt``: ``data`` (M, N) and ``data_t`` (N, M), both contiguous.

    ``scale``/``accum`` as in ``quantize.quantize`` (None: current scaling). ``write_q``/``write_qt``
    drop an output that is not needed (then that field is None). ``trans_mode`` overrides ``TRANS_MODE``."""
    assert x.dim() == 2, "quantize_transpose takes a 2-D tensor"
    fmt = by_name(fmt)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape
    dev = x.device
    q = torch.empty((M, N), dtype=fmt.dtype, device=dev) if write_q else None
    qt = torch.empty((N, M), dtype=fmt.dtype, device=dev) if write_qt else None
    meta = torch.empty(3, dtype=torch.float32, device=dev)
    grid = (max(1, triton.cdiv(M, bm)), max(1, triton.cdiv(N, bn)))
    common = dict(WRITE_Q=write_q, WRITE_QT=write_qt, BM=bm, BN=bn, num_warps=num_warps,
                  TRANS_MODE=TRANS_MODE.get(x.dtype, TRANS_MODE_DEFAULT) if trans_mode is None else trans_mode,
                  **_consts(fmt))
    q_arg = q if write_q else meta
    qt_arg = qt if write_qt else meta
    if scale is None:
        part = amax_partials(x if x.is_contiguous() else x.contiguous())
        _quantize_transpose_kernel[grid](x, q_arg, qt_arg, part, part.numel(), meta, meta, meta, M, N,
                                         x.stride(0), CURRENT=True,
                                         P_BLOCK=triton.next_power_of_2(part.numel()), **common)
    else:
        assert accum is not None, "delayed scaling needs an amax accumulator"
        _quantize_transpose_kernel[grid](x, q_arg, qt_arg, meta, 0, scale, accum, meta, M, N, x.stride(0),
                                         CURRENT=False, P_BLOCK=1, **common)
    return Quantized(q, qt, meta)


def quantize_transpose_ref(x: torch.Tensor, fmt: Fp8Format | str, scale: torch.Tensor | None = None) -> Quantized:
    """Torch reference: the same values, ``data_t`` materialised contiguous."""
    r = quantize_ref(x, fmt, scale)
    return Quantized(r.data, r.data.t().contiguous(), r.meta)
