"""Triton FP8 kernels of the trainer, each file a kernel, its launcher and its torch reference:

  fp8_gemm            C = (A @ Bᵀ) * sa * sb, A (M, K) and B (N, K) K-major, any e4m3/e5m2 mix
  quantize            amax + scale + clamp + cast (current or delayed tensorwise scaling)
  quantize_transpose  the same, writing the FP8 tensor and its transpose in one pass
  swiglu              silu(gate) * up of y = [gate | up], forward and backward in one pass each, with y's row
  residual            a block's residual add, with the branch's row
  rope                RoPE on the attention's qkv output, forward and backward in one pass each, with its row
  heads               the attention's heads merged for its projection
  weight_casts        many tensors cast in one launch, each with its row (a bf16 model's weights and gradients)
  fp8_gemm_ws         the warp-specialized precise-accumulation GEMM (Gluon, sm90); stream_k its stream-K schedule
  timing              timing kernel candidates against each other (first-call tuning)
  rmsnorm             RMSNorm forward and backward in one pass each, with the output's row
  words               bf16 tensors as 32-bit words (the consumer kernels' bf16x2 statistics)

Importing this package imports Triton; ``trainer.fp8_linear`` imports it only when it runs the Triton
path (CUDA, or ``backend="triton"`` under ``TRITON_INTERPRET=1``).
"""

from .fp8_gemm import fp8_gemm, fp8_gemm_ref
from .quantize import Quantized, delayed_update, delayed_update_ref, finite_amax, quantize, quantize_ref
from .quantize_transpose import quantize_transpose, quantize_transpose_ref
from .swiglu import swiglu, swiglu_ref

__all__ = [
    "Quantized",
    "delayed_update",
    "delayed_update_ref",
    "finite_amax",
    "fp8_gemm",
    "fp8_gemm_ref",
    "quantize",
    "quantize_ref",
    "quantize_transpose",
    "quantize_transpose_ref",
    "swiglu",
    "swiglu_ref",
]
