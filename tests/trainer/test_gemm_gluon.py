"""trainer/kernels/fp8_gemm_gluon.py (precise-accumulation FP8 GEMM in Gluon) against the torch reference.

The kernel runs on sm90 GPUs only (no Gluon in Triton's interpreter): the CUDA tests below are skipped
elsewhere; on the CPU this file checks that the module imports and declines CPU tensors, and
tests/trainer/test_kernels.py checks (in the interpreter) that ``fp8_gemm(impl="gluon")`` falls back to the
Triton kernel. Tolerances: against an fp64 product, no worse than ``torch._scaled_mm(use_fast_accum=False)``
on the same operands (x1.5 + output rounding), since both promote into fp32 every 128 products.
"""

from __future__ import annotations

import pytest
import torch

from trainer.kernels import fp8_gemm_gluon as G
from trainer.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and G.AVAILABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU and Triton's Gluon")


def test_declines_cpu_tensors():
    assert not G.supported(torch.empty(2, 2))


def _operands(M, N, K, da, db, seed, dev="cuda"):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 4).to(da).to(dev)
    b = (torch.randn(N, K, generator=g) * 4).to(db).to(dev)
    return a, b


def _rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


CASES = [  # M, N, K, out dtype, bias, split_k: edges (M, N not tile multiples, K % 128 != 0), split-K
    (256, 256, 512, torch.float32, False, 1),
    (1000, 520, 272, torch.bfloat16, True, 1),
    (130, 200, 96, torch.float32, False, 1),
    (384, 512, 8192, torch.float32, False, 1),
    (384, 512, 8192, torch.float32, False, 4),
    (300, 260, 4112, torch.bfloat16, True, 3),
]


@needs_sm90
@pytest.mark.parametrize("config", G.CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_gluon_cuda_vs_fp64(case, config):
    M, N, K, od, with_bias, split_k = case
    a, b = _operands(M, N, K, torch.float8_e5m2, torch.float8_e4m3fn, seed=M + K)
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.9, device="cuda")
    bias = torch.randn(N, device="cuda") if with_bias else None
    c = fp8_gemm(a, b, sa, sb, out_dtype=od, bias=bias, fast_accum=False, impl="gluon", config=config,
                 split_k=split_k)
    exact = (a.double() @ b.double().t()) * (0.37 * 1.9) + (0 if bias is None else bias.double())
    cublas = _rel(fp8_gemm_ref(a, b, sa, sb, out_dtype=torch.float32, fast_accum=False), exact - (
        0 if bias is None else bias.double()))
    e = _rel(c, exact)
    assert c.shape == (M, N) and c.dtype == od and bool(torch.isfinite(c).all())
    assert e <= 1.5 * cublas + (4e-3 if od == torch.bfloat16 else 1e-6), (e, cublas)


@needs_sm90
def test_gluon_cuda_promotes_every_128():
    """Precise accumulation: with values whose partial sums exceed the tensor-core accumulator's precision,
    the error must stay at _scaled_mm's precise level, far below its fast-accumulation level."""
    a, b = _operands(256, 256, 16384, torch.float8_e4m3fn, torch.float8_e4m3fn, seed=3)
    a = (a.float().abs() * 16).to(torch.float8_e4m3fn)  # same-sign products: large, growing partial sums
    b = (b.float().abs()).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    exact = a.double() @ b.double().t()
    e = _rel(fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=False, impl="gluon"), exact)
    precise = _rel(fp8_gemm_ref(a, b, one, one, out_dtype=torch.float32, fast_accum=False), exact)
    fast = _rel(fp8_gemm_ref(a, b, one, one, out_dtype=torch.float32, fast_accum=True), exact)
    assert e <= 1.5 * precise + 1e-7, (e, precise, fast)


@needs_sm90
def test_gluon_cuda_auto_falls_back_with_stats_or_fast_accum():
    a, b = _operands(256, 256, 256, torch.float8_e4m3fn, torch.float8_e4m3fn, seed=5)
    one = torch.tensor(1.0, device="cuda")
    ref = fp8_gemm_ref(a, b, one, one, out_dtype=torch.float32, fast_accum=True)
    c = fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=True, impl="gluon")  # runs "tma"
    assert _rel(c, ref) < 1e-5
