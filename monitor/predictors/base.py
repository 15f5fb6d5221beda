"""What every signal returns for a step, and the shared mapping from a threshold ratio to a score."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from fp8mon.monitor.assessment import Finding

MAX_CULPRITS = 5  # per signal


def score_of(ratio: float | np.ndarray):
    """Signal score in [0, 1] from ratio = value / its alert threshold: 0 up to half the threshold, 0.5 at
    the threshold, 1 from 1.5x the threshold on."""
    r = np.asarray(ratio, dtype=np.float64)
    return np.clip(np.where(r == r, r, 0.0) - 0.5, 0.0, 1.0)


# Ratio cap of conditions that cannot page (yet): info-only series, a spike that has not lasted, overflow
# during warm-up. They score at most 0.25, so risk >= 0.5 always means a warning-level condition.
INFO_RATIO_CAP = 0.75


def scalar_score(ratio: float) -> float:
    """score_of for one number."""
    return min(1.0, max(0.0, ratio - 0.5)) if ratio == ratio else 0.0


@dataclass
class SignalOutput:
    score: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    culprits: list[dict] = field(default_factory=list)  # {"layer", "site", "signal", "value", "ratio"}
    steps_to_divergence: float | None = None

    def at(self, step: int) -> SignalOutput:
        """The same conditions reported again at a later step (a tensor signal between reporting steps)."""
        return SignalOutput(self.score, [replace(f, step=step) for f in self.findings], self.culprits,
                            self.steps_to_divergence)


def top_culprits(signal: str, ratio: np.ndarray, value: np.ndarray, names) -> list[dict]:
    """The columns with ratio >= 0.5 (score > 0), worst first, at most MAX_CULPRITS. `names(i)` gives
    (layer, site) of column i."""
    r = ratio
    idx = np.flatnonzero(r >= 0.5)  # NaN compares False
    if idx.size == 0:
        return []
    idx = idx[np.argsort(-r[idx], kind="stable")][:MAX_CULPRITS]
    out = []
    for i in idx.tolist():
        layer, site = names(i)
        out.append({"layer": layer, "site": site, "signal": signal, "value": float(value[i]),
                    "ratio": float(r[i])})
    return out
