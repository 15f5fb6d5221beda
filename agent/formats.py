"""FP8 formats (OCP "FP8 Formats for Deep Learning") and tensorwise scaling helpers (SPEC section 4).

Scales follow the convention ``q = cast(clamp(s * x, -max, max))``, i.e. ``s = fmt.max / amax``.
Every helper accepts plain numbers or torch tensors; a tensor argument gives a float32 tensor result on
the same device (no host sync), a number gives a Python float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    max: float
    min_normal: float
    min_subnormal: float
    dtype: torch.dtype
    # Largest fp32 |s*x| that a round-to-nearest-even cast *without* saturation still rounds to +-max;
    # anything above it is lost to saturation (the clamp), i.e. overflows. max + half an ulp, or the fp32
    # value just below that when the tie rounds away (max has an odd mantissa, as in E5M2).
    overflow_threshold: float

    @property
    def underflow_threshold(self) -> float:
        """Largest |s*x| that casts to zero: min_subnormal/2 (round-half-to-even sends the tie to 0)."""
        return self.min_subnormal / 2


# E4M3: 448 = 1.110b * 2^8, ulp 32, tie 464 rounds to even 448. E5M2: 57344 = 1.11b * 2^15, ulp 8192,
# tie 61440 rounds to even 65536 = Inf, so the threshold is the fp32 predecessor of 61440.
E4M3 = Fp8Format("e4m3", 448.0, 2.0**-6, 2.0**-9, torch.float8_e4m3fn, 464.0)
E5M2 = Fp8Format("e5m2", 57344.0, 2.0**-14, 2.0**-16, torch.float8_e5m2, 61440.0 - 2.0**-8)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def by_name(name: str | Fp8Format) -> Fp8Format:
    """Look a format up by name ("e4m3" or "e5m2", case-insensitive); a Fp8Format passes through."""
    if isinstance(name, Fp8Format):
        return name
    try:
        return FORMATS[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(FORMATS)}") from None


def _scale_from_amax(amax, fmt: Fp8Format, margin: float = 0.0):
    """fmt.max / amax / 2**margin, or 1.0 where amax is 0, negative or non-finite."""
    fmt = by_name(fmt)
    if isinstance(amax, torch.Tensor):
        a = amax.to(torch.float32)
        ok = torch.isfinite(a) & (a > 0)
        s = fmt.max / torch.where(ok, a, torch.ones_like(a)) / 2.0**margin
        return torch.where(ok, s, torch.ones_like(s))
    a = float(amax)
    if not (math.isfinite(a) and a > 0):
        return 1.0
    return fmt.max / a / 2.0**margin


def current_scale(amax, fmt: Fp8Format | str):
    """Current (tensorwise) scaling: s = fmt.max / amax(x); 1.0 when amax is 0 or non-finite."""
    return _scale_from_amax(amax, fmt)


def delayed_scale(amax_history, fmt: Fp8Format | str, margin: float = 0):
    """Delayed scaling (TE, algo "max"): s = fmt.max / max(amax_history) / 2**margin.

    An empty history, or a history whose max is 0 or non-finite (a NaN anywhere propagates), gives 1.0.
    """
    if isinstance(amax_history, torch.Tensor):
        h = amax_history.detach().to(torch.float32).reshape(-1)
        m = h.max() if h.numel() else h.new_zeros(())
        return _scale_from_amax(m, fmt, margin)
    h = torch.as_tensor(list(amax_history), dtype=torch.float64)
    m = float(h.max()) if h.numel() else 0.0
    return _scale_from_amax(m, fmt, margin)


def scale_tensor(scale, device=None) -> torch.Tensor:
    """The scale as the float32 0-d tensor that multiplies x (quantize and the statistics share it)."""
    return torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(())


def quantize(x: torch.Tensor, scale, fmt: Fp8Format | str) -> torch.Tensor:
    """Cast fp32(x) * fp32(scale) to fmt, saturating: clamp to +-fmt.max first, then cast (RNE)."""
    fmt = by_name(fmt)
    y = x.to(torch.float32) * scale_tensor(scale, x.device)
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)
