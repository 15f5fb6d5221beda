"""SwiGLU's elementwise part, h = silu(gate) * up of y = [gate | up] (the fused fc1's output), forward and backward,
in one pass each; the forward can also take the statistics rows of y and of h for the agent from what it reads and
writes anyway.

y (M, 2H) in, h (M, H) out, rounded as torch rounds ``F.silu(gate) * up`` in y's dtype: silu in fp32, rounded to the
dtype, times up in fp32, rounded (the exponential may differ from torch's in the last fp32 bit, so h may differ by
one unit in the last place of the dtype, rarely). The backward gives dy = [d_gate | d_up] as torch's autograd of that
expression does: d_up = dh * silu(gate) and d_gate = (dh * up) * sig (1 + gate (1 - sig)), each product rounded to
the dtype. Reference beside them: ``swiglu_ref``.

``stats=`` (an ``agent.triton_stats.Target``): y's SPEC section-4 row, as the agent's hooks emulate it for a GEMM
output (``triton_stats.nofmt_consts``), accumulated from the tiles the forward loads (``rows_add``) and merged by
the last program; ``h_stats=`` likewise h's, from the tiles it stores. They are the rows of fc1's ``output`` and
fc2's ``input`` (``trainer.layers.SwiGLU``): without them a statistics kernel reads y once more (with an FP8 fc1,
the deferred output read; y is the largest tensor of a Llama block), and with a plain fc2, h too.

Persistent programs (a few per SM) loop over (BM, BN) tiles of h, so the statistics have a few hundred partials
to merge, not one per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent import triton_stats as ts
from agent.triton_stats import fused_bounds, nofmt_epilogue, rows_add, rows_partial, rows_zero

from .fp8_gemm import _to_out
from .quantize import INTERPRET, _num_sms, cdiv

BM, BN = 32, 128
PROGRAMS_PER_SM = 4


@triton.jit
def _silu_rounded(g, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """silu(g) in fp32 (g fp32), rounded to DTYPE and back, as ``F.silu`` returns it; and sigmoid(g)."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    return _to_out(g * sig, DTYPE, SOFT_ROUND).to(tl.float32), sig


@triton.jit(do_not_specialize=["dst_index", "merge", "dst_index_h", "merge_h"])
def _swiglu_fwd_kernel(y_ptr, h_ptr, M, H, stride_y, sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, cen_ptr, c_mean,
                       c_std, k, ahm_ptr, ahm_val, sp_ptr_h, ctr_ptr_h, dst_ptr_h, dst_index_h, merge_h, cen_ptr_h,
                       c_mean_h, c_std_h, k_h, ahm_ptr_h, ahm_val_h, STATS: tl.constexpr, C_PTR: tl.constexpr,
                       AHM_PTR: tl.constexpr, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                       SMODE: tl.constexpr, STATS_H: tl.constexpr, C_PTR_H: tl.constexpr, AHM_PTR_H: tl.constexpr,
                       HIST_H: tl.constexpr, FMAX_H: tl.constexpr, UTHR_H: tl.constexpr, SMODE_H: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """h of y; with STATS y's row, with STATS_H h's row (the *_h arguments: a second target)."""
    dtype = h_ptr.dtype.element_ty
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    if STATS:
        lo, hi = fused_bounds(cen_ptr, c_mean, c_std, k, C_PTR)
        st = rows_zero(BM)
    if STATS_H:
        lo_h, hi_h = fused_bounds(cen_ptr_h, c_mean_h, c_std_h, k_h, C_PTR_H)
        st_h = rows_zero(BM)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        r0 = (t // n_tn) * BM
        c0 = (t % n_tn) * BN
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < H)
        gp = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gp + H, mask=mask, other=0.0).to(tl.float32)
        s, _ = _silu_rounded(g, dtype, SOFT_ROUND)
        h = _to_out(s * u, dtype, SOFT_ROUND)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], h, mask=mask)
        full = (r0 + BM <= M) & (c0 + BN <= H)
        if STATS:  # both halves are elements of y
            st = rows_add(st, g, mask, full, lo, hi, HIST)
            st = rows_add(st, u, mask, full, lo, hi, HIST)
        if STATS_H:
            st_h = rows_add(st_h, h.to(tl.float32), mask, full, lo_h, hi_h, HIST_H)
    if STATS:
        nofmt_epilogue(sp_ptr, ctr_ptr, dst_ptr, dst_index, merge, ahm_ptr, ahm_val, rows_partial(st), AHM_PTR, HIST,
                       FMAX, UTHR, SMODE)
    if STATS_H:
        nofmt_epilogue(sp_ptr_h, ctr_ptr_h, dst_ptr_h, dst_index_h, merge_h, ahm_ptr_h, ahm_val_h, rows_partial(st_h),
                       AHM_PTR_H, HIST_H, FMAX_H, UTHR_H, SMODE_H)


@triton.jit
def _swiglu_bwd_kernel(y_ptr, dh_ptr, dy_ptr, M, H, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                       SOFT_ROUND: tl.constexpr):
    dtype = dy_ptr.dtype.element_ty
    n_tn = tl.cdiv(H, BN)
    tiles = tl.cdiv(M, BM) * n_tn
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rows = (t // n_tn) * BM + tl.arange(0, BM)
        cols = (t % n_tn) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < H)
        r64 = rows[:, None].to(tl.int64)
        gp = y_ptr + r64 * stride_y + cols[None, :]
        g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gp + H, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + r64 * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s, sig = _silu_rounded(g, dtype, SOFT_ROUND)
        d_silu = _to_out(dh * u, dtype, SOFT_ROUND).to(tl.float32)
        d_gate = d_silu * sig * (1.0 + g * (1.0 - sig))
        dp = dy_ptr + r64 * (2 * H) + cols[None, :]
        tl.store(dp, _to_out(d_gate, dtype, SOFT_ROUND), mask=mask)
        tl.store(dp + H, _to_out(dh * s, dtype, SOFT_ROUND), mask=mask)


def _programs(tiles: int, device: torch.device) -> int:
    return max(1, min(tiles, PROGRAMS_PER_SM * _num_sms(device) if not INTERPRET else 4))


def swiglu_forward(y: torch.Tensor, stats: "ts.Target | None" = None,
                   h_stats: "ts.Target | None" = None) -> torch.Tensor:
    """h = silu(gate) * up of y = [gate | up] along the last dimension (even), in y's dtype; with ``stats``, y's row
    into that target, with ``h_stats`` h's row."""
    two_h = y.shape[-1]
    if two_h % 2:
        raise ValueError(f"swiglu: the last dimension ({two_h}) must be even: [gate | up]")
    y2 = y.reshape(-1, two_h)
    if y2.stride(1) != 1:
        y2 = y2.contiguous()
    M, H = y2.shape[0], two_h // 2
    h = torch.empty((M, H), dtype=y.dtype, device=y.device)
    programs = _programs(cdiv(M, BM) * cdiv(H, BN), y.device)
    _swiglu_fwd_kernel[(programs,)](y2, h, M, H, y2.stride(0), **ts.epilogue_args(stats, programs, h),
                                    **ts.epilogue_args(h_stats, programs, h, "_h", counter_row=1), BM=BM, BN=BN,
                                    SOFT_ROUND=INTERPRET, num_warps=8)
    return h.reshape(*y.shape[:-1], H)


def swiglu_backward(y: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """dy = [d_gate | d_up] of h = silu(gate) * up, from y and dh (h's gradient), in y's dtype."""
    two_h = y.shape[-1]
    y2 = y.reshape(-1, two_h)
    if y2.stride(1) != 1:
        y2 = y2.contiguous()
    M, H = y2.shape[0], two_h // 2
    dh2 = dh.reshape(M, H).to(y.dtype).contiguous()
    dy = torch.empty((M, two_h), dtype=y.dtype, device=y.device)
    programs = _programs(cdiv(M, BM) * cdiv(H, BN), y.device)
    _swiglu_bwd_kernel[(programs,)](y2, dh2, dy, M, H, y2.stride(0), BM=BM, BN=BN, SOFT_ROUND=INTERPRET,
                                    num_warps=8)
    return dy.reshape(y.shape)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, stats, h_stats):
        ctx.save_for_backward(y)
        return swiglu_forward(y, stats, h_stats)

    @staticmethod
    def backward(ctx, dh):
        (y,) = ctx.saved_tensors
        return swiglu_backward(y, dh), None, None


def swiglu(y: torch.Tensor, stats: "ts.Target | None" = None, h_stats: "ts.Target | None" = None) -> torch.Tensor:
    """silu(gate) * up of y = [gate | up], differentiable, in one pass each way (see the module docstring); with
    ``stats`` y's statistics row, with ``h_stats`` h's."""
    return _SwiGLUFn.apply(y, stats, h_stats)


def swiglu_ref(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
