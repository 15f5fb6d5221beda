"""Many tensors cast in one launch, each with the statistics row of its values: autocast's casts of a model's fp32
weights to bf16 on a reporting step, and the casts of their bf16 gradients back to fp32 (``trainer.weight_rows``),
done together rather than one launch per linear each way (``residual.weight_cast``).

A small model's weights are small: a launch's ramp, its last wave and its partials cost about as much as its bytes.
Here the programs of one launch are shared out among the tensors in proportion to their
blocks; a program casts and sums the blocks ``p, p + programs_t, ...`` of its tensor ``t`` as ``residual.branch_grad``
does, and stores its partial at its column of one partials buffer, which ``stats.launch.merge_later`` merges into each
tensor's row. ``weight_casts`` is the autograd form: the weights' casts as one node whose backward casts all their
gradients in one launch. Reference beside it: ``weight_casts_ref``.
"""

from __future__ import annotations

import struct
import weakref

import torch
import triton
import triton.language as tl

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats.device import (
    P_AHM,
    SMEM_HIST,
    fused_epilogue,
    htab,
    outlier_bounds,
    stream_add,
    stream_partial,
    stream_start,
)

from .fp8_gemm import _to_out
from .quantize import INTERPRET, _num_sms, cdiv
from .residual import _b_part, _grad_block

BLOCK = 1024
WARPS = 4
PROGRAMS_PER_SM = 4
MAXNREG = 128  # as residual's kernels with a row: 16 warps of 4-warp programs fill an SM's registers
STAGES = 3
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TAB = struct.Struct("<6q2dq")  # source, cast, elements, first program, programs, center address, center (mean, std), pad
_TABW = tl.constexpr(_TAB.size // 8)


@triton.jit
def _mine_part(src, t, part, BLOCK: tl.constexpr, V: tl.constexpr):
    """``stats.device.careful_tiles``' loader for a program of a shared launch: careful_tiles counts t = pid, pid +
    nprog, ... (the launch's grid); the k-th of those is block ``p + k * programs`` of the program's own tensor."""
    w_ptr, n, pid, nprog, p, programs = src
    return _b_part((w_ptr, n), p + (t - pid) // nprog * programs, part, BLOCK, V)


@triton.jit
def _casts_kernel(tab_ptr, ntab, sp_ptr, k, HIST: tl.constexpr, FMAX: tl.constexpr, UTHR: tl.constexpr,
                  SMODE: tl.constexpr, SRC: tl.constexpr, DST: tl.constexpr, BLOCK: tl.constexpr,
                  SOFT_ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Program ``pid`` finds its tensor in the table's program map (after the ``ntab`` rows), casts its blocks from
    SRC to DST (``_CODE``) and leaves its partial of their source values in column pid of ``sp_ptr`` for
    ``merge_later``; a tensor's first program also leaves the (absent) history max in the tensor's first column."""
    V: tl.constexpr = 8
    R: tl.constexpr = BLOCK // V
    IN: tl.constexpr = tl.float32 if SRC == 0 else (tl.bfloat16 if SRC == 1 else tl.float16)
    OUT: tl.constexpr = tl.float32 if DST == 0 else (tl.bfloat16 if DST == 1 else tl.float16)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t = tl.load(tab_ptr + ntab * _TABW + pid)
    row = tab_ptr + t * _TABW
    # 16-byte aligned (the launcher checks): vector loads and stores, as with a tensor argument
    w_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(IN)), 16)
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
    lo, hi = outlier_bounds(c_mean, c_std, k + tl.zeros([], tl.float64))
    p = pid - first
    nblk = tl.cdiv(n, BLOCK)
    d0, m0 = _b_part((w_ptr, n), p, 0, BLOCK, V)
    c, s, ok, ncp, st = stream_start(d0, m0, R)
    ht = None
    if HIST and SMEM_HIST:
        ht = htab()
    ce = tl.zeros([], tl.int32)
    # the full blocks without masks (n is not known to the compiler: a mask by it would cost the vector accesses)
    nfull = n // BLOCK
    everywhere = tl.full([BLOCK], 1, tl.int1)
    for blk in tl.range(p, nfull, programs, num_stages=STAGES):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + offs).to(tl.float32)
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
        tl.store(sp_ptr + P_AHM * nprog + first, nan)


def _shares(numels: list[int], device: torch.device) -> list[int]:
    """Programs per tensor: about one wave of ``PROGRAMS_PER_SM`` per SM in all, each tensor's share in proportion to
    its blocks (at least one, at most one per block)."""
    blocks = [cdiv(n, BLOCK) for n in numels]
    slots = 4 * len(numels) if INTERPRET else PROGRAMS_PER_SM * _num_sms(device)
    per = max(1, cdiv(sum(blocks), max(slots - len(blocks), len(blocks))))  # blocks a program takes
    return [min(b, max(1, cdiv(b, per))) for b in blocks]


def castable(x: torch.Tensor) -> bool:
    """Whether ``casts_with_rows`` takes x."""
    return x.dtype in _CODE and x.is_contiguous() and x.numel() > 0 and x.data_ptr() % 16 == 0


def casts_with_rows(xs: list[torch.Tensor], dtype: torch.dtype, targets: list[ts.Target]) -> list[torch.Tensor]:
    """``[x.to(dtype) for x in xs]`` (one dtype, each ``castable``, on one device) in one launch, with the row of each
    x's own values into its target. The targets share one row buffer, histogram setting, outlier k and format; the
    rows are complete after the next ``stats.launch.merge_later``."""
    if not xs:
        return []
    device, t0 = xs[0].device, targets[0]
    for x, t in zip(xs, targets, strict=True):
        if not castable(x) or x.device != device or x.dtype != xs[0].dtype:
            raise ValueError("casts_with_rows: needs contiguous, non-empty, 16-byte aligned tensors of one floating "
                             "dtype (fp32, bf16, fp16) on one device")
        if _shared(t) != _shared(t0):
            raise ValueError("casts_with_rows: the targets must share rows, histogram setting, outlier k and format")
    if dtype not in _CODE:
        raise ValueError(f"casts_with_rows: casts to fp32, bf16 or fp16, not {dtype}")
    casts = [torch.empty(x.shape, dtype=dtype, device=device) for x in xs]
    shares = _shares([x.numel() for x in xs], device)
    firsts = [sum(shares[:i]) for i in range(len(shares))]
    table, keep = bytearray(), []
    for x, out, t, first, share in zip(xs, casts, targets, firsts, shares):
        c, c_mean, c_std = ts.center_fields(t.center, device)
        keep.append(c)
        table += _TAB.pack(x.data_ptr(), out.data_ptr(), x.numel(), first, share, 0 if c is None else c.data_ptr(),
                           c_mean, c_std, 0)
    program_map = [i for i, share in enumerate(shares) for _ in range(share)]
    tab = ts.to_device(bytes(table) + struct.pack(f"<{len(program_map)}q", *program_map), device)
    part = ts.partials_merged_later(targets, list(zip(firsts, shares)), device)
    opts = {} if INTERPRET else {"maxnreg": MAXNREG}
    _casts_kernel[(len(program_map),)](tab, len(xs), part, float(t0.outlier_k), HIST=bool(t0.hist),
                                       SRC=_CODE[xs[0].dtype], DST=_CODE[dtype], BLOCK=BLOCK, SOFT_ROUND=INTERPRET,
                                       STAGES=STAGES, num_warps=WARPS, **ts.nofmt_consts(t0), **opts)
    del keep
    return casts


def _shared(t: ts.Target) -> tuple:
    """What the targets of one ``casts_with_rows`` launch share."""
    return t.rows.data_ptr(), bool(t.hist), float(t.outlier_k), t.fmt


def grouped_casts(xs: list, dtype: torch.dtype, targets: list) -> list:
    """``casts_with_rows`` of the xs whose target is not None, one launch per group of targets that can share one;
    the casts in xs' order (None where the target is)."""
    groups: dict = {}
    for i, t in enumerate(targets):
        if t is not None:
            groups.setdefault(_shared(t), []).append(i)
    casts = [None] * len(xs)
    for idx in groups.values():
        for i, cast in zip(idx, casts_with_rows([xs[i] for i in idx], dtype, [targets[i] for i in idx])):
            casts[i] = cast
    return casts


class _WeightCastsFn(torch.autograd.Function):
    """The weights' casts as one node: its backward runs once every cast's gradient is in (the end of the backward
    pass) and casts them back in one launch, each taking its gradient's row where its link asks for it."""

    @staticmethod
    def forward(ctx, dtype, targets, links, *weights):
        ctx.set_materialize_grads(False)
        ctx.dtype, ctx.links = weights[0].dtype, links
        ctx.weights = [weakref.ref(w) for w in weights]
        return tuple(grouped_casts([w.detach() for w in weights], dtype, targets))

    @staticmethod
    def backward(ctx, *grads):
        out = [None] * len(grads)
        targets = [None] * len(grads)
        for i, g in enumerate(grads):
            if g is None or not ctx.needs_input_grad[3 + i]:
                continue
            w = ctx.weights[i]()
            # the cast back becomes w.grad as it is only while no gradient is accumulated yet: then it takes the row
            if w is not None and w.grad is None and castable(g):
                targets[i] = ctx.links[i].grad_weight_target(g.device)
            if targets[i] is None:
                out[i] = g.to(ctx.dtype)
        for i, grad in enumerate(grouped_casts(grads, ctx.dtype, targets)):
            if grad is not None:
                out[i] = grad
                ctx.links[i].took_grad_weight(grad, targets[i])
        return (None, None, None, *out)


@torch.compiler.disable
def weight_casts(weights: list[torch.Tensor], dtype: torch.dtype, targets: list[ts.Target],
                 links: list) -> list[torch.Tensor]:
    """``[w.to(dtype) for w in weights]`` (fp32 weights, each ``castable``), differentiable as that, in one launch
    that takes each weight's row into its target. The backward casts the gradients back in one launch once all are
    in, each taking its gradient's row where its link (``agent.core.FusedLink``) asks for it (``grad_weight_target``).
    One node for all: a gradient is ready only at the end of the backward pass, which a distributed data-parallel
    wrapper's overlap of communication with the backward does not want (``trainer.weight_rows.grads_together``)."""
    if any(w.dtype != torch.float32 for w in weights):
        raise ValueError("weight_casts: casts fp32 weights")
    return list(_WeightCastsFn.apply(dtype, targets, links, *weights))


def weight_casts_ref(weights: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [w.to(dtype) for w in weights]
