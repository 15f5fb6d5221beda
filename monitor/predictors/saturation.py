"""FP8 range signals: amax drifting toward saturation under delayed scaling, and underflow rising.

Saturation (only tensors with a reported `amax_history_max`, i.e. delayed scaling): the headroom
h = log2(format_max / (amax * scale)) in binades is how far this step's amax stays below the value the
scale in use saturates at. Its EWMA is extrapolated at its rate over the trend window to h = 0: the
estimated steps until `overflow_frac` > 0 (it feeds the run's steps-to-divergence estimate).

A scale is *stale* when log2(format_max / (amax_history_max * scale)) has moved by `saturation_stale`
binades since warm-up: while the scale is refreshed from the reported history at every step that quantity
is exactly the margin, so it moves only for a frozen scale or a history that stopped updating.

Findings: the extrapolation reaching overflow within `saturation_horizon` steps (info; twice
`saturation_warning_horizon` for a stale scale); a stale scale's within `saturation_warning_horizon` steps
after warm-up (warning: where casts do not saturate the first overflow is a NaN, so the overflow fraction
gives no warning at all); the EWMA of the overflow fraction at `overflow_frac_info` (info),
`overflow_frac` (warning, after the warm-up), 10x that (critical). Healthy runs with a short amax
history overflow ~1% of a gradient's elements for a few steps whenever gradients grow fast, so only a
sustained overflow is a warning.

Underflow: the EWMA of `underflow_frac` against its running minimum since warm-up; a rise of
`underflow_rise_info` (absolute fraction of the nonzero elements flushed to zero) is info,
`underflow_rise` a warning where `underflow_pages` is set (by default it stays info: healthy wider runs
flush a growing share of their attention gradients). Thresholds: docs/prediction-reference.md.
"""

from __future__ import annotations

import numpy as np

from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.predictors.base import INFO_RATIO_CAP, SignalOutput, score_of, top_culprits
from fp8mon.monitor.predictors.frames import SlotTable, StepFrame
from fp8mon.monitor.predictors.params import PredictorParams
from fp8mon.monitor.predictors.schedule import Warmup
from fp8mon.monitor.predictors.series import LevelTracker, grown


class AmaxSaturation:
    name = "amax_saturation"

    def __init__(self, params: PredictorParams, warmup: Warmup):
        self.p, self.warmup = params, warmup
        a = params.tensor_alpha_steps
        self.headroom = LevelTracker(params.ewma_alpha, params.trend_window, 0, alpha_steps=a,
                                     trend_steps=params.trend_steps)
        self.overflow_level = LevelTracker(params.ewma_alpha, params.trend_window, 0, alpha_steps=a)
        # staleness of the scale, log2(format_max / (amax_history_max * scale)): exactly the margin at every step
        # while the scale is refreshed from the history it is reported with; its range since warm-up, per slot
        self.stale_lo, self.stale_hi = np.full(0, np.nan), np.full(0, np.nan)
        self.last = SignalOutput()

    @property
    def overflow(self) -> np.ndarray:
        """Smoothed overflow fraction per slot (0 where never reported)."""
        return np.nan_to_num(self.overflow_level.level, nan=0.0)

    def update(self, frame: StepFrame, table: SlotTable) -> None:
        hmax, amax, scale = (frame.stats.get(k) for k in ("amax_history_max", "amax", "scale"))
        if hmax is None or amax is None or scale is None:
            return
        delayed = np.isfinite(hmax) & (hmax > 0) & np.isfinite(table.format_max)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = np.log2(table.format_max / (amax * scale))
        h = np.where(delayed & (amax > 0) & (scale > 0), h, np.nan)
        self.headroom.update(frame.step, h)
        with np.errstate(divide="ignore", invalid="ignore"):
            staleness = np.where(delayed & (scale > 0), np.log2(table.format_max / (hmax * scale)), np.nan)
        self.stale_lo, self.stale_hi = grown(self.stale_lo, h.shape[0]), grown(self.stale_hi, h.shape[0])
        if self.warmup.done(frame.step):
            self.stale_lo, self.stale_hi = np.fmin(self.stale_lo, staleness), np.fmax(self.stale_hi, staleness)
        overflow = frame.stats.get("overflow_frac")
        if overflow is not None:
            self.overflow_level.update(frame.step, np.where(delayed, overflow, np.nan))

    def evaluate(self, step: int, table: SlotTable, updated: bool) -> SignalOutput:
        if not updated:
            self.last = self.last.at(step)
            return self.last
        p = self.p
        self.headroom.grow(table.width)  # slots that appeared in a frame without these statistics
        self.overflow_level.grow(table.width)
        self.stale_lo, self.stale_hi = grown(self.stale_lo, table.width), grown(self.stale_hi, table.width)
        level, rate = self.headroom.level, self.headroom.rate()
        stale = (self.stale_hi - self.stale_lo) >= p.saturation_stale  # NaN (not yet seen) compares False
        overflow = self.overflow
        min_rate = np.where(stale, p.saturation_stale_min_rate, p.saturation_min_rate)
        with np.errstate(divide="ignore", invalid="ignore"):
            closing = (rate <= -min_rate) & (level >= p.saturation_min_headroom)
            to_overflow = np.where(closing, level / -rate, np.inf)
        to_overflow = np.where(overflow >= p.overflow_frac_info, 0.0, to_overflow)
        # a stale scale's countdown is info from twice the warning horizon: an info alert already firing
        # escalates at once when it turns into a warning, where a new warning would wait out its holding time
        # again each time the estimate wavers around the horizon
        approaching = to_overflow <= np.where(stale, 2 * p.saturation_warning_horizon, p.saturation_horizon)
        # the score follows the overflow itself: 1 (warning) at overflow_frac, +1 per 10x
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(overflow > 0, 1.0 + np.log10(np.maximum(overflow, 1e-30) / p.overflow_frac), 0.0)
        ratio = np.maximum(ratio, 0.0)
        # a stale scale closing in: 1 (warning) at the warning horizon, 1.5 (full score) at two thirds of it
        with np.errstate(divide="ignore"):
            closing_in = np.where(stale & approaching,
                                  p.saturation_warning_horizon / np.maximum(to_overflow, 1.0), 0.0)
        ratio = np.maximum(ratio, closing_in)
        warm = not self.warmup.done(step)
        if warm:  # overflow while the model leaves its initialisation is info only
            ratio = np.minimum(ratio, INFO_RATIO_CAP)
        findings = []
        for i in np.flatnonzero(approaching).tolist():
            layer, site = table.name(i)
            if overflow[i] >= p.overflow_frac_info:
                severity = ("info" if warm or overflow[i] < p.overflow_frac else
                            "critical" if overflow[i] >= 10 * p.overflow_frac else "warning")
                message = f"{layer} {site}: {overflow[i]:.2%} of the elements saturate (stale delayed scale)"
                value = float(overflow[i])
            else:
                severity = ("warning" if not warm and stale[i]
                            and to_overflow[i] <= p.saturation_warning_horizon else "info")
                message = (f"{layer} {site}: amax {level[i]:.2f} binades below saturation, closing "
                           f"{-rate[i]:.3g}/step: overflow in ~{to_overflow[i]:.0f} steps")
                value = float(to_overflow[i])
            findings.append(Finding(self.name, severity, step, message, layer=layer, site=site, value=value,
                                    for_steps=p.saturation_for_steps))
        culprits = top_culprits(self.name, np.where(approaching, np.maximum(ratio, 0.5), 0.0),
                                np.where(overflow >= p.overflow_frac_info, overflow, to_overflow), table.name)
        finite = to_overflow[approaching]
        steps = float(finite.min()) if finite.size else None
        self.last = SignalOutput(float(score_of(ratio).max(initial=0.0)), findings, culprits, steps)
        return self.last


class UnderflowRise:
    name = "underflow_rise"

    def __init__(self, params: PredictorParams, warmup: Warmup):
        self.p = params
        self.level = LevelTracker(params.ewma_alpha, params.trend_window, warmup,
                                  alpha_steps=params.tensor_alpha_steps)
        self.last = SignalOutput()

    def update(self, frame: StepFrame, table: SlotTable) -> None:
        underflow = frame.stats.get("underflow_frac")
        if underflow is not None:
            self.level.update(frame.step, underflow)

    def evaluate(self, step: int, table: SlotTable, updated: bool) -> SignalOutput:
        if not updated:
            self.last = self.last.at(step)
            return self.last
        self.level.grow(table.width)
        rise = self.level.rise()
        ratio = rise / self.p.underflow_rise
        if not self.p.underflow_pages:  # its findings stay info and its score below a warning's
            ratio = np.minimum(ratio, INFO_RATIO_CAP)
        findings = []
        for i in np.flatnonzero(rise >= self.p.underflow_rise_info).tolist():
            layer, site = table.name(i)
            severity = "warning" if ratio[i] >= 1.0 else "info"
            findings.append(Finding(self.name, severity, step, f"{layer} {site}: underflow fraction up "
                                    f"{rise[i]:.1%} to {self.level.level[i]:.1%}", layer=layer, site=site,
                                    value=float(self.level.level[i]), for_steps=self.p.underflow_for_steps))
        culprits = top_culprits(self.name, ratio, self.level.level, table.name)
        self.last = SignalOutput(float(score_of(ratio).max(initial=0.0)), findings, culprits)
        return self.last
