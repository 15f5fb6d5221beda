"""Kurtosis growth (FOG): a sustained rise of ln(kurtosis) of a tensor against its own history.

Per (layer, site): the EWMA of ln(kurtosis) (its weight per `kurtosis_alpha_steps` training steps) is
compared with its minimum over the last `kurtosis_baseline_steps` steps since warm-up; a rise of
`kurtosis_rise_info` (ln units) is reported as info, `kurtosis_rise` a warning, `kurtosis_rise_critical`
critical (sites other than WARNING_SITES: info only). A fast rise is a warning too: the same level above its
minimum over only the last `kurtosis_fast_steps` steps by `kurtosis_fast_rise`. By default `kurtosis_rise` is
the critical level, so a slow rise is info until it is critical: healthy runs grow their kurtosis 10x and more,
but slowly, and diverging runs are told apart by how fast it rises. Per site, the same on the layer-average
of ln(kurtosis) (finding with layer=None). The estimated steps to divergence extrapolate the worst warning
tensor's rise at its current rate up to the critical level. Thresholds: docs/prediction-reference.md.
"""

from __future__ import annotations

import numpy as np

from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.predictors.base import INFO_RATIO_CAP, SignalOutput, score_of, top_culprits
from fp8mon.monitor.predictors.frames import SlotTable, StepFrame
from fp8mon.monitor.predictors.params import PredictorParams
from fp8mon.monitor.predictors.schedule import Warmup
from fp8mon.monitor.predictors.series import LevelTracker

RULE = "kurtosis_growth"
# Gradient kurtosis is heavy-tailed and jumps from batch to batch (small runs: 50-400, minimum by luck), and
# post-activation inputs (mlp.fc2 input) grow more than 16x in healthy runs, so growth at those sites is
# info only; warnings come from the GEMM outputs and the weights, where FOG looks.
WARNING_SITES = ("output", "weight")


class KurtosisGrowth:
    name = RULE

    def __init__(self, params: PredictorParams, warmup: Warmup):
        self.p = params
        def tracker(baseline_steps, long_baseline=False):
            return LevelTracker(params.kurtosis_alpha, params.trend_window, warmup, trend_steps=params.trend_steps,
                                baseline_steps=baseline_steps, alpha_steps=params.kurtosis_alpha_steps,
                                long_baseline=long_baseline)

        self.slots = tracker(params.kurtosis_baseline_steps, long_baseline=True)
        # the same levels against a short trailing minimum (None: no fast-rise rule)
        self.fast = tracker(params.kurtosis_fast_steps) if params.kurtosis_fast_steps else None
        self.means = tracker(params.kurtosis_baseline_steps)
        self.last = SignalOutput()

    def update(self, frame: StepFrame, table: SlotTable) -> None:
        kurt = frame.stats.get("kurtosis")
        if kurt is None:
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            logk = np.log(np.where(kurt > 0, kurt, np.nan))
        self.slots.update(frame.step, logk)
        if self.fast is not None:
            self.fast.update(frame.step, logk)
        self.means.update(frame.step, self._site_means(logk, table))

    @staticmethod
    def _site_means(logk: np.ndarray, table: SlotTable) -> np.ndarray:
        """Mean ln(kurtosis) over the layers of each site (columns: table.site_list)."""
        ok = np.isfinite(logk)
        n = len(table.site_list)
        total = np.bincount(table.site_code[ok], weights=logk[ok], minlength=n)
        count = np.bincount(table.site_code[ok], minlength=n)
        with np.errstate(invalid="ignore"):
            return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    def evaluate(self, step: int, table: SlotTable, updated: bool) -> SignalOutput:
        if not updated:
            self.last = self.last.at(step)
            return self.last
        p = self.p
        self.slots.grow(table.width)  # slots that appeared in a frame without kurtosis
        self.means.grow(len(table.site_list))
        rise = self.slots.rise()
        ratio = rise / p.kurtosis_rise
        if self.fast is not None:
            self.fast.grow(table.width)
            fast = self.fast.rise()
            ratio = np.fmax(ratio, fast / p.kurtosis_fast_rise)
        else:
            fast = np.full(table.width, np.nan)
        long_rise = self.slots.long_rise()  # a slow creep since the warm-up (NaN without a trailing window)
        long_warns = long_rise >= p.kurtosis_long_rise
        ratio = np.fmax(ratio, long_rise / p.kurtosis_long_rise)
        kurt = np.exp(self.slots.level)
        findings = []
        warns = table.site_mask(WARNING_SITES)
        long_warns &= warns
        ratio = np.where(warns, ratio, np.minimum(ratio, INFO_RATIO_CAP))  # gradient/input sites: info only
        fast_warns = warns & (fast >= p.kurtosis_fast_rise)  # NaN compares False
        # the fast rise is never above the rise against the longer window, so its slots are among these
        for i in np.flatnonzero((rise >= p.kurtosis_rise_info) | fast_warns | long_warns).tolist():
            layer, site = table.name(i)
            severity = "info" if not warns[i] else ("critical" if rise[i] >= p.kurtosis_rise_critical else
                                                    "warning" if rise[i] >= p.kurtosis_rise or fast_warns[i]
                                                    or long_warns[i] else "info")
            within = f", {np.exp(fast[i]):.1f}x within {p.kurtosis_fast_steps} steps" if fast_warns[i] else ""
            if long_warns[i]:
                within += f", {np.exp(long_rise[i]):.1f}x since the warm-up"
            findings.append(Finding(RULE, severity, step, f"kurtosis of {layer} {site} grew {np.exp(rise[i]):.1f}x "
                                    f"over its minimum to {kurt[i]:.3g}{within}", layer=layer, site=site,
                                    value=float(kurt[i]), for_steps=p.kurtosis_for_steps))
        mean_rise = self.means.rise()
        mean_ratio = mean_rise / p.kurtosis_mean_rise
        mean_warns = np.isin(np.array(table.site_list, dtype=object), WARNING_SITES)
        mean_ratio = np.where(mean_warns, mean_ratio, np.minimum(mean_ratio, INFO_RATIO_CAP))
        for i in np.flatnonzero(mean_rise >= p.kurtosis_mean_rise_info).tolist():
            site = table.site_list[i]
            severity = "warning" if mean_rise[i] >= p.kurtosis_mean_rise and site in WARNING_SITES else "info"
            findings.append(Finding(RULE, severity, step, f"layer-average kurtosis of {site} grew "
                                    f"{np.exp(mean_rise[i]):.1f}x over its minimum", site=site,
                                    value=float(np.exp(self.means.level[i])), for_steps=p.kurtosis_for_steps))
        culprits = top_culprits(RULE, ratio, kurt, table.name)
        worst = max(float(score_of(ratio).max(initial=0.0)), float(score_of(mean_ratio).max(initial=0.0)))
        self.last = SignalOutput(worst, findings, culprits, self._steps_to_critical(rise, warns, fast_warns | long_warns))
        return self.last

    def _steps_to_critical(self, rise: np.ndarray, warns: np.ndarray, fast_warns: np.ndarray) -> float | None:
        """Steps until the worst warning tensor reaches the critical rise at its current rate."""
        rate = self.slots.rate()
        warning = ((rise >= self.p.kurtosis_rise) & warns) | fast_warns
        valid = np.isfinite(rise) & np.isfinite(rate) & (rate > 0) & warning
        if not valid.any():
            return None
        steps = np.maximum(0.0, (self.p.kurtosis_rise_critical - rise[valid]) / rate[valid])
        return float(steps.min())
