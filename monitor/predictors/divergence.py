"""THE divergence rule that labels runs (fixtures, benchmark) and that the predictor reports as it happens.

A run diverges at step d when either
  * the loss is non-finite at d (NaN or +-Inf), or
  * the loss exceeds its running minimum (over all earlier logged steps) by more than MARGIN = 1.0 nat at
    M = 10 consecutive logged steps starting at d; d is the first of those steps.

Why these numbers: 1 nat is a factor e in perplexity, several times the step-to-step noise of the loss
of the small-batch runs we label (a few tenths of a nat), and a loss does not come back by a whole nat
within a healthy run once it has reached its minimum, so a stable run never meets it; 10 consecutive
steps rule out a single bad batch. The running minimum includes every earlier finite loss, so a rise
that happens early (before the loss has fallen) is not divergence unless it tops the minimum so far.

The divergence step is the first step of the streak, not the step at which the streak is confirmed: lead
times are counted to the moment the loss left the healthy band.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MARGIN = 1.0
M = 10
RULE = f"first step with a non-finite loss, or loss > running min + {MARGIN} nat for {M} consecutive logged steps"


class DivergenceDetector:
    """The rule, incrementally: feed (step, loss) in step order; `step` is set once divergence is seen."""

    def __init__(self, margin: float = MARGIN, m: int = M):
        self.margin, self.m = margin, m
        self.running_min = math.inf
        self.streak_start: int | None = None
        self.streak = 0
        self.step: int | None = None  # the divergence step, once known

    def observe(self, step: int, loss: float) -> bool:
        """True when the run has diverged at or before `step`. The streak and running minimum keep
        following the loss after that (the predictor reports whether the condition still holds)."""
        if not math.isfinite(loss):
            self.streak, self.streak_start = 0, None
            if self.step is None:
                self.step = step
            return True
        if loss > self.running_min + self.margin:
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
            if self.streak >= self.m and self.step is None:
                self.step = self.streak_start
        else:
            self.streak, self.streak_start = 0, None
            self.running_min = min(self.running_min, loss)
        return self.step is not None

    @property
    def above_margin_for(self) -> int:
        """Consecutive logged steps (so far) with the loss above running min + margin."""
        return self.streak


def divergence_step(losses: Iterable[tuple[int, float]], margin: float = MARGIN, m: int = M) -> int | None:
    """The divergence step of a run's (step, loss) pairs (any order), or None when it did not diverge."""
    detector = DivergenceDetector(margin, m)
    for step, loss in sorted(losses):
        if detector.observe(step, loss):
            return detector.step
    return None
