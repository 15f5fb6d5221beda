"""bf16 tensors as 32-bit words, two elements a word: the consumer kernels' statistics then share the counts' and the
amax's integer and bf16x2 operations between a word's two elements (``agent.stats.device.tile_bf16x2``, the
standalone kernel's bf16 path), and their elementwise math runs on the low and the high elements apart."""

from __future__ import annotations

import triton
import triton.language as tl

from fp8mon.agent.stats.device import bf16_halves

from .fp8_gemm import _to_out

# the two bf16 of each word, as fp32: the low half (the element at the lower address), then the high
unpack = bf16_halves


@triton.jit
def pack(lo, hi, SOFT_ROUND: tl.constexpr):
    """Words of two fp32 tensors each rounded to bf16 (to nearest even), ``lo`` in the low halves: one
    ``cvt.rn.bf16x2.f32`` a word on hardware (the compiler pairs adjacent elements of one tensor so, not two
    tensors), ``_to_out``'s software rounding in the interpreter (SOFT_ROUND)."""
    if SOFT_ROUND:
        hb = _to_out(hi, tl.bfloat16, True).to(tl.int16, bitcast=True).to(tl.int32)
        lb = _to_out(lo, tl.bfloat16, True).to(tl.int16, bitcast=True).to(tl.int32)
        return (hb << 16) | (lb & 0xFFFF)
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)
