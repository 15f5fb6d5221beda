"""Signals on the model-level scalars of each logged step.

* `loss_spike`, `grad_norm_spike`: robust z-score (median/MAD of the previous `spike_window` values) of
  the loss and of ln(grad_norm), a warning from `loss_spike_z` / `grad_norm_spike_z` on.
* `loss_drift`, `grad_norm_growth`: the slowly smoothed loss (EWMA weight `slow_alpha`) and ln(grad_norm)
  climbing above their running minimum since warm-up (a healthy run's loss only falls, a diverging run's
  creeps up long before it blows up).
* `attn_logit_growth`, `adam_update_growth`, `logsumexp_drift` (when the trainer reports them):
  the EWMA of ln(attn_max_logit), ln(adam_update_rms) and of logit_logsumexp (already a log) against
  its running minimum since warm-up, a warning at the configured rise; the smoothed attention max-logit
  is also a warning from the absolute level `attn_logit_level` on.
* `loss_divergence`: the divergence rule's condition (monitor.predictors.divergence) holding now, critical;
  reactive by definition, it is what the labels call divergence.
"""

from __future__ import annotations

import math

from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.predictors.base import INFO_RATIO_CAP, SignalOutput, scalar_score
from fp8mon.monitor.predictors.divergence import DivergenceDetector
from fp8mon.monitor.predictors.params import PredictorParams
from fp8mon.monitor.predictors.schedule import Warmup
from fp8mon.monitor.predictors.series import RobustZ, ScalarLevel


class Spike:
    def __init__(self, name: str, scalar: str, threshold: float, params: PredictorParams, log: bool):
        self.name, self.scalar, self.threshold, self.log, self.p = name, scalar, threshold, log, params
        self.z = RobustZ(params.spike_window, params.spike_min_history)
        self.since: int | None = None  # first step of the current run of steps above the threshold
        self.last = SignalOutput()

    def observe(self, step: int, scalars: dict[str, float]) -> SignalOutput:
        value = scalars.get(self.scalar)
        if value is None:
            self.last = self.last.at(step)
            return self.last
        x = math.log(value) if self.log and value > 0 else (value if not self.log else math.nan)
        z = self.z.score(x)
        ratio = z / self.threshold if math.isfinite(z) else 0.0
        if ratio < 1.0:
            self.since = None
        elif self.since is None:
            self.since = step
        findings, culprits = [], []
        if ratio >= 1.0:
            findings.append(Finding(self.name, "warning", step, f"{self.scalar} {value:.4g} is a spike: robust z "
                                    f"{z:.1f} over the last {self.p.spike_window} steps", value=float(value),
                                    for_steps=self.p.spike_for_steps))
        if ratio >= 0.5:
            culprits.append({"layer": None, "site": None, "signal": self.name, "value": float(value),
                             "ratio": float(ratio)})
        # a spike weighs in the risk once it has lasted as long as its alert needs: one bad batch is not risk
        held = self.since is not None and step - self.since >= self.p.spike_for_steps
        self.last = SignalOutput(scalar_score(ratio if held else min(ratio, INFO_RATIO_CAP)), findings, culprits)
        return self.last


class Growth:
    """A positive scalar (or a log already, `log=False`) rising above its running minimum since the warm-up,
    smoothed with a weight per `alpha_steps` training steps. With `level`, its smoothed value reaching that
    absolute level warns too (an attention max-logit of 100, whatever it grew from)."""

    def __init__(self, name: str, scalar: str, rise: float, params: PredictorParams, log: bool, warmup: Warmup,
                 alpha: float | None = None, for_steps: int | None = None, pages: bool = True,
                 alpha_steps: int | None = None, level: float | None = None, clip_rise: float | None = None):
        self.name, self.scalar, self.threshold, self.log, self.p = name, scalar, rise, log, params
        self.pages = pages  # False: its findings stay info and its score below a warning's
        self.for_steps = params.scalar_growth_for_steps if for_steps is None else for_steps
        self.level = ScalarLevel(alpha or params.ewma_alpha, warmup, alpha_steps)
        self.danger = level
        # each value enters the EWMA at most this far above the baseline, so a burst that recovers leaves the
        # level (and its alert) within a few of the EWMA's time constants, while a sustained rise still crosses
        self.clip_rise = clip_rise
        self.last = SignalOutput()

    def observe(self, step: int, scalars: dict[str, float]) -> SignalOutput:
        value = scalars.get(self.scalar)
        if value is None:
            self.last = self.last.at(step)
            return self.last
        x = (math.log(value) if value > 0 else math.nan) if self.log else value
        if self.clip_rise is not None and x > self.level.baseline + self.clip_rise:  # NaN baseline: False
            x = self.level.baseline + self.clip_rise
        self.level.update(step, x)
        rise = self.level.rise()
        ratio = rise / self.threshold if math.isfinite(rise) else 0.0
        level_ratio = 0.0
        if self.danger is not None and math.isfinite(self.level.level):
            smooth = math.exp(self.level.level) if self.log else self.level.level
            level_ratio = smooth / self.danger
        findings, culprits = [], []
        if level_ratio >= 1.0:
            findings.append(Finding(self.name, "warning" if self.pages else "info", step,
                                    f"{self.scalar} at {smooth:.4g}, past the danger level {self.danger:.4g}",
                                    value=float(value), for_steps=self.for_steps))
        elif ratio >= self.p.growth_info_fraction:
            how = f"{math.exp(rise):.1f}x" if self.log else f"+{rise:.2f}"
            severity = "warning" if ratio >= 1.0 and self.pages else "info"
            findings.append(Finding(self.name, severity, step, f"{self.scalar} grew {how} over its minimum to "
                                    f"{value:.4g}", value=float(value), for_steps=self.for_steps))
        ratio = max(ratio, level_ratio)
        if ratio >= 0.5:
            culprits.append({"layer": None, "site": None, "signal": self.name, "value": float(value),
                             "ratio": float(ratio)})
        self.last = SignalOutput(scalar_score(ratio if self.pages else min(ratio, INFO_RATIO_CAP)), findings, culprits)
        return self.last


class LossDivergence:
    name = "loss_divergence"

    def __init__(self, params: PredictorParams):
        self.p = params
        self.detector = DivergenceDetector(params.loss_margin, params.loss_margin_steps)
        self.holding = False  # the loss is above its band now (an event: monitor.predictors.schedule.Warmup)
        self.last = SignalOutput()

    def observe(self, step: int, scalars: dict[str, float]) -> SignalOutput:
        loss = scalars.get("loss")
        if loss is None:
            self.last = self.last.at(step)
            return self.last
        d = self.detector
        d.observe(step, loss)
        # level-triggered: holds while the loss stays above the band (or once it went non-finite)
        holding = self.holding = d.streak >= d.m or not math.isfinite(loss)
        findings = []
        if holding:
            findings.append(Finding(self.name, "critical", step, f"loss {loss:.4g} has been above its minimum "
                                    f"{d.running_min:.4g} + {d.margin} for {d.streak} steps", value=float(loss)))
        self.last = SignalOutput(1.0 if holding else 0.0, findings, [],
                                 0.0 if holding else None)
        return self.last
