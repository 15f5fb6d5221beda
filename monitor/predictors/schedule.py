"""The run's learning-rate schedule as it reports it (the `lr` scalar): where its warm-up ends, and whether the
learning rate has left its schedule.

* `Warmup`: the predictors take their baselines (running minima) only after the warm-up, while statistics move
  because the model leaves its initialisation and the learning rate climbs. Its end is the step after the reported
  `lr`'s peak (known once the lr has not passed it for 10 logged steps), at least `warmup_min_steps` and at most
  `warmup_max_steps`; a run that reports no `lr` ends it at `warmup_steps`. An event (the loss above its band, the
  lr off its schedule) is a warm-up again: every baseline is forgotten when it begins and taken anew from
  `event_settle_steps` after it ended, so a rise is measured from where the run landed, not from before the event.
* `LrSchedule` (rule `lr_schedule`): after the lr's own warm-up (uncapped) a schedule only holds or decays the learning rate (cosine,
  linear, constant, WSD). A learning rate `lr_jump` times the lowest of the last `lr_window` steps (a jump, a
  restart at the peak) is a warning at once, before the loss reacts; it resolves once the new rate has been the
  run's for `lr_window` steps.
* `WarmupStall` (rule `warmup_stall`): while the reported lr still climbs in its warm-up, the loss has stopped
  falling. Over the last stretch of at least `warmup_stall_steps` steps in which the lr grew `warmup_stall_lr`
  times, the smoothed loss fell less than `warmup_stall_progress` nats and less than `warmup_stall_fraction` of
  its fall since the run's first step (which must be `warmup_stall_progress` at least: the run has learnt
  something): a warning. This is the learning-rate range test (Smith, 2017) read online:
  past the largest stable learning rate the loss stops improving as the lr rises, and a warm-up that climbs on
  takes the run into a stall or a divergence. It resolves when the lr stops climbing.
"""

from __future__ import annotations

import math
from collections import deque

from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.predictors.base import SignalOutput, scalar_score
from fp8mon.monitor.predictors.params import PredictorParams


class Warmup:
    """`end`: the first step after the warm-up for the baselines (math.inf while it lasts and its end is unknown);
    `lr_end`: the step after the reported lr's peak, uncapped (math.inf until then). The peak is known once the lr
    has not passed it for SETTLE logged steps, so a warm-up that repeats a value (a scheduler stepped every few
    steps) is not taken for its end."""

    SETTLE = 10

    def __init__(self, params: PredictorParams | None = None, fixed: int | None = None):
        p = params or PredictorParams()
        self.min_steps, self.max_steps, self.default = p.warmup_min_steps, p.warmup_max_steps, p.warmup_steps
        self.end = float(fixed) if fixed is not None else math.inf
        self.lr_end = math.inf
        self._fixed = fixed is not None
        self._peak: tuple[float, int] | None = None  # (lr, step) of the highest lr so far
        self._since_peak = 0
        self.settle_steps = p.event_settle_steps
        self.epoch = 0  # events begun so far: a baseline older than the last one's start is forgotten
        self._in_event = False
        self._settled_at = -math.inf  # the step from which baselines are taken again after the last event

    def observe(self, step: int, lr: float | None) -> None:
        if self._fixed or self.lr_end != math.inf:
            return
        if lr is not None and math.isfinite(lr):
            if self._peak is None or lr > self._peak[0]:
                self._peak, self._since_peak = (lr, step), 0
            else:
                self._since_peak += 1
                if self._since_peak >= self.SETTLE:  # the lr stopped rising (or never rose: no warm-up)
                    self.lr_end = float(self._peak[1] + 1)
                    if self.end == math.inf:
                        self.end = float(min(max(self.lr_end, self.min_steps), self.max_steps))
                    return
            if step >= self.max_steps and self.end == math.inf:
                self.end = float(self.max_steps)
        elif self._peak is None and step >= self.default and self.end == math.inf:  # no lr: the default
            self.end = float(self.default)

    def done(self, step: int) -> bool:
        return step >= self.end

    def observe_event(self, step: int, holding: bool) -> None:
        """Whether an event holds at `step` (called once per evaluated step, after its signals)."""
        if holding and not self._in_event:
            self.epoch += 1
            self._in_event = True
        elif not holding and self._in_event:
            self._in_event = False
            self._settled_at = step + self.settle_steps

    def baselines_open(self, step: int) -> bool:
        """Baselines take minima at `step`: after the warm-up, outside an event and its settling steps."""
        return self.done(step) and not self._in_event and step >= self._settled_at


def as_warmup(warmup) -> Warmup:
    """A Warmup from a Warmup or a fixed step."""
    return warmup if isinstance(warmup, Warmup) else Warmup(fixed=int(warmup))


class LrSchedule:
    name = "lr_schedule"

    def __init__(self, params: PredictorParams, warmup: Warmup):
        self.p, self.warmup = params, warmup
        self._recent: deque[tuple[int, float]] = deque()  # (step, lr) after warm-up, monotone minima
        self.holding = False  # the lr is off its schedule now (an event: monitor.predictors.schedule.Warmup)
        self.last = SignalOutput()

    def observe(self, step: int, scalars: dict[str, float]) -> SignalOutput:
        lr = scalars.get("lr")
        if lr is None or not math.isfinite(lr) or lr <= 0:
            self.last = self.last.at(step)
            return self.last
        if step < self.warmup.lr_end:  # the schedule's own warm-up: the lr climbs
            self.last = SignalOutput()
            return self.last
        recent, window = self._recent, self.p.lr_window
        while recent and recent[0][0] < step - window:
            recent.popleft()
        low = recent[0][1] if recent else lr  # the lowest lr of the window (monotone deque)
        while recent and recent[-1][1] >= lr:
            recent.pop()
        recent.append((step, lr))
        ratio = (lr / low) / self.p.lr_jump
        self.holding = ratio >= 1.0
        findings, culprits = [], []
        if ratio >= 1.0:
            findings.append(Finding(self.name, "warning", step, f"learning rate {lr:.3g} is {lr / low:.1f}x its "
                                    f"lowest of the last {window} steps: it left its schedule", value=float(lr)))
            culprits.append({"layer": None, "site": None, "signal": self.name, "value": float(lr),
                             "ratio": float(ratio)})
        self.last = SignalOutput(scalar_score(ratio) if ratio >= 1.0 else 0.0, findings, culprits)
        return self.last


class WarmupStall:
    name = "warmup_stall"

    def __init__(self, params: PredictorParams, warmup: Warmup):
        self.p, self.warmup = params, warmup
        self._level = math.nan  # EWMA of the loss, weight `slow_alpha` per training step
        self._first = math.nan  # its first value: the loss the run started from
        self._step: int | None = None
        self._climb: deque[tuple[int, float, float]] = deque()  # (step, lr, level) while the lr climbs
        self.last = SignalOutput()

    def observe(self, step: int, scalars: dict[str, float]) -> SignalOutput:
        loss, lr = scalars.get("loss"), scalars.get("lr")
        if loss is None or not math.isfinite(loss):
            self.last = self.last.at(step)
            return self.last
        alpha = self.p.slow_alpha
        if self._step is None:
            self._level = self._first = loss
        else:
            self._level += (1.0 - (1.0 - alpha) ** (step - self._step)) * (loss - self._level)
        self._step = step
        if lr is None or not math.isfinite(lr) or step >= self.warmup.lr_end:  # no lr, or its warm-up is over
            self._climb.clear()
            self.last = SignalOutput()
            return self.last
        climb = self._climb
        climb.append((step, lr, self._level))
        reach = lr / self.p.warmup_stall_lr
        start = step - self.p.warmup_stall_steps
        # the start of the stretch: the latest step with the lr `warmup_stall_lr` times lower, `warmup_stall_steps`
        # ago or more (both hold for a prefix of the climb, and go on holding as the lr and the step grow)
        while len(climb) > 1 and climb[1][1] <= reach and climb[1][0] <= start:
            climb.popleft()
        then, lr_then, level_then = climb[0]
        progress, fallen = level_then - self._level, self._first - self._level
        # armed once the run has learnt something (a loss flat from its first step is no warm-up to judge)
        if not (lr_then <= reach and then <= start and fallen >= self.p.warmup_stall_progress):
            self.last = SignalOutput()
            return self.last
        ratio = max(progress / self.p.warmup_stall_progress,  # both under their thresholds: < 1
                    progress / (self.p.warmup_stall_fraction * fallen))
        findings, culprits = [], []
        if ratio < 1.0:
            findings.append(Finding(self.name, "warning", step, f"the lr climbed {lr / lr_then:.1f}x since step "
                                    f"{then} while the loss fell only {progress:.2f} (of {fallen:.2f} since the "
                                    "start): past its stable learning rate", value=float(progress),
                                    for_steps=self.p.warmup_stall_for_steps))
            culprits.append({"layer": None, "site": None, "signal": self.name, "value": float(progress),
                             "ratio": 1.0})
        self.last = SignalOutput(scalar_score(1.0) if ratio < 1.0 else 0.0, findings, culprits)
        return self.last
