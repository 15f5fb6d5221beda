"""The FP8 formats' limits as the server needs them (SPEC section 4), without torch: agent.formats holds the same
numbers with their torch dtypes, and tests/monitor/test_histograms.py checks that the two agree.

Limits are on |s·x|, s the scale in use: a value overflows (saturates) above `overflow` and quantizes to zero at or
below `underflow` (min_subnormal / 2, round to nearest even)."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FormatLimits:
    name: str
    max: float
    min_normal: float
    min_subnormal: float
    overflow: float  # the agent's overflow_threshold

    @property
    def underflow(self) -> float:
        return self.min_subnormal / 2

    def to_dict(self) -> dict:
        return {"name": self.name, "max": self.max, "min_normal": self.min_normal,
                "min_subnormal": self.min_subnormal, "overflow": self.overflow, "underflow": self.underflow}


E4M3 = FormatLimits("e4m3", 448.0, 2.0**-6, 2.0**-9, 464.0)
E5M2 = FormatLimits("e5m2", 57344.0, 2.0**-14, 2.0**-16, 61440.0 - 2.0**-8)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
# The agent's default format per site (agent.core.DEFAULT_FORMATS): E4M3 forward, E5M2 gradients.
SITE_FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}


def limit_lines(fmt: FormatLimits, scale_min: list, scale_max: list) -> dict:
    """Where the format's limits fall on |x| (log2) per histogram column, at the column's scales: overflow above
    log2(overflow / s) with the largest s of the column, zero at or below log2(underflow / s) with the smallest
    (the worst case of the column). A column without a reported scale is drawn at s = 1."""
    def log2(value: float, scale) -> float:
        return math.log2(value / (scale or 1.0))

    return {"format": fmt.to_dict(),
            "overflow_log2": [log2(fmt.overflow, s) for s in scale_max],
            "underflow_log2": [log2(fmt.underflow, s) for s in scale_min],
            "min_normal_log2": [log2(fmt.min_normal, s) for s in scale_min]}
