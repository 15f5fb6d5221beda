"""What failure means for a labelled run: the kind of failure and the step it began, read from its losses
(docs/prediction-reference.md, "What failure means").

Kinds, the earliest that holds is the run's failure:

* ``blowup``: a non-finite loss or gradient norm, or the loss above its running minimum by more than MARGIN (1 nat) at M (10)
  consecutive logged steps (monitor.predictors.divergence), that does not recover. The step is the first step of
  the excursion.
* ``drift``: a sustained rise: the smoothed loss (EWMA over about SMOOTH_STEPS training steps) above its running
  minimum by DRIFT (0.5 nat), never back below half of that for the rest of the run, for at least HOLD steps (or
  until a blow-up ends it).
* ``stall``: no progress: the smoothed loss above a healthy reference's (the mean smoothed loss of healthy runs of
  the same model and schedule, at the same step) by more than STALL nats for at least HOLD consecutive steps (or
  until a blow-up ends it), whether or not the run catches up later: those steps of the schedule are lost. The raised
  loss of a transient (below), until SMOOTH_STEPS after its recovery, is that event, not a stall. Without a reference
  no stall is labelled.
* ``quality_gap``: an FP8 run whose smoothed loss is above its BF16 twin's (same model, data and schedule) by more
  than GAP_TOL to the end of the run, for at least HOLD steps.

A blow-up excursion after which the loss (its running median of MEDIAN_OF logged steps) comes back within MARGIN / 2
of its earlier minimum and stays there for RECOVER_STEPS logged steps is ``transient`` (a burst of bad data, a single spike): not a failure. Its ``step`` is
where it began and ``recovered`` where the loss was back. A run with neither is ``none`` (healthy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from fp8mon.monitor.predictors.divergence import MARGIN, M

FAILING = ("blowup", "drift", "stall", "quality_gap")
SMOOTH_STEPS = 50
DRIFT = 0.5
STALL = 0.3
GAP_TOL = 0.05
HOLD = 100
RECOVER_STEPS = 50
MEDIAN_OF = 11


@dataclass(frozen=True)
class Failure:
    kind: str = "none"  # one of FAILING, "transient" or "none"
    step: int | None = None
    recovered: int | None = None  # transient: first step of the loss's stay back in its band

    @property
    def failed(self) -> bool:
        return self.kind in FAILING

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Failure:
        return cls(data.get("kind", "none"), data.get("step"), data.get("recovered"))


def smoothed(losses: Sequence[tuple[int, float]], span: int = SMOOTH_STEPS) -> list[tuple[int, float]]:
    """EWMA of the finite losses with a weight per training step (the same curve whatever the logging interval)."""
    out, level, last = [], math.nan, None
    alpha = 2.0 / (span + 1)
    for step, loss in losses:
        if not math.isfinite(loss):
            continue
        if last is None:
            level = loss
        else:
            level += (1.0 - (1.0 - alpha) ** (step - last)) * (loss - level)
        last = step
        out.append((step, level))
    return out


def _excursions(losses: Sequence[tuple[int, float]]) -> tuple[int | None, int | None, bool]:
    """(first unrecovered blow-up step, first recovered excursion's start, its recovery step) of the losses."""
    transient_at = recovered_at = None
    running_min, streak_start, streak = math.inf, None, 0
    i, n = 0, len(losses)
    while i < n:
        step, loss = losses[i]
        if not math.isfinite(loss):
            return step, transient_at, recovered_at
        if loss > running_min + MARGIN:
            if streak == 0:
                streak_start = step
            streak += 1
            if streak >= M:
                back = _recovery(losses, i + 1, running_min)
                if back is None:
                    return streak_start, transient_at, recovered_at
                if transient_at is None:
                    transient_at, recovered_at = streak_start, losses[back][0]
                streak, streak_start, i = 0, None, back
                continue
        else:
            streak, streak_start = 0, None
            running_min = min(running_min, loss)
        i += 1
    return None, transient_at, recovered_at


def _recovery(losses, start: int, running_min: float) -> int | None:
    """Index of the first loss from `start` on that begins RECOVER_STEPS logged steps whose running median of
    MEDIAN_OF losses is within MARGIN / 2 of the minimum (a median: one batch's noise is not a relapse); None when
    the run never comes back."""
    band, run, recent = running_min + MARGIN / 2, 0, []
    for j in range(start, len(losses)):
        loss = losses[j][1]
        if not math.isfinite(loss):
            return None
        recent = (recent + [loss])[-MEDIAN_OF:]
        if len(recent) == MEDIAN_OF and sorted(recent)[MEDIAN_OF // 2] <= band:
            run += 1
            if run >= RECOVER_STEPS:
                return j - RECOVER_STEPS + 1
        else:
            run = 0
    return None


def _final_excursion(gap: Sequence[tuple[int, float]], above: float, below: float, end: int,
                     ends_in_blowup: bool) -> int | None:
    """The first step of the excursion of `gap` above `above` that never goes back below `below` until the end,
    held HOLD steps (or ended by a blow-up); None when there is none."""
    start = None
    for step, value in gap:
        if value < below:
            start = None
        elif value > above and start is None:
            start = step
    if start is None or (end - start < HOLD and not ends_in_blowup):
        return None
    return start


def _drift(smooth: Sequence[tuple[int, float]], end: int, ends_in_blowup: bool) -> int | None:
    rise, low = [], math.inf
    for step, level in smooth:
        low = min(low, level)
        rise.append((step, level - low))
    return _final_excursion(rise, DRIFT, DRIFT / 2, end, ends_in_blowup)


def _held_excursion(gap: Sequence[tuple[int, float]], above: float, end: int, ends_in_blowup: bool) -> int | None:
    """The first step of the first excursion of `gap` above `above` that lasts HOLD steps (or is ended by a blow-up),
    whatever follows it; None when there is none."""
    start = None
    for step, value in gap:
        if value <= above:
            start = None
            continue
        if start is None:
            start = step
        if step - start >= HOLD:
            return start
    return start if start is not None and ends_in_blowup else None


def _gap(smooth: Sequence[tuple[int, float]], other: dict[int, float]) -> list[tuple[int, float]]:
    return [(s, v - other[s]) for s, v in smooth if s in other]


def reference_curve(runs: Iterable[Sequence[tuple[int, float]]]) -> dict[int, float]:
    """The mean smoothed loss of healthy runs at every step they all logged."""
    curves = [dict(smoothed(run)) for run in runs]
    if not curves:
        return {}
    steps = set.intersection(*(set(c) for c in curves))
    return {s: sum(c[s] for c in curves) / len(curves) for s in sorted(steps)}


def label(losses: Iterable[tuple[int, float]], reference: dict[int, float] | None = None,
          twin: dict[int, float] | None = None, nonfinite_at: int | None = None) -> Failure:
    """The failure of a run from its (step, loss) pairs; `reference` (reference_curve of healthy runs of the same
    model and schedule) enables stalls, `twin` (the smoothed losses of the BF16 twin of an FP8 run) the quality gap;
    `nonfinite_at`: the first step with a non-finite gradient norm (a blow-up the loss may not show: a trainer
    stops there)."""
    losses = sorted(losses)
    if not losses:
        return Failure()
    end = losses[-1][0]
    blowup, transient_at, recovered_at = _excursions(losses)
    if nonfinite_at is not None and (blowup is None or nonfinite_at < blowup):
        blowup = nonfinite_at
    smooth = smoothed(losses if blowup is None else [x for x in losses if x[0] < blowup])
    found = []
    if blowup is not None:
        found.append((blowup, "blowup"))
    ends = blowup is not None
    drift = _drift(smooth, end, ends)
    if drift is not None:
        found.append((drift, "drift"))
    if reference:
        gap = _gap(smooth, reference)
        if transient_at is not None:  # a spike's raised loss is that event, not a plateau (the EWMA settles after it)
            settled = (end if recovered_at is None else recovered_at) + SMOOTH_STEPS
            gap = [(s, v) for s, v in gap if not transient_at <= s < settled]
        stall = _held_excursion(gap, STALL, end, ends)
        if stall is not None:
            found.append((stall, "stall"))
    if twin:
        gap = _final_excursion(_gap(smooth, twin), GAP_TOL, GAP_TOL, end, ends)
        if gap is not None:
            found.append((gap, "quality_gap"))
    if found:
        step, kind = min(found)
        if transient_at is not None and transient_at < step:
            return Failure(kind, step, recovered_at)
        return Failure(kind, step)
    if transient_at is not None:
        return Failure("transient", transient_at, recovered_at)
    return Failure()
