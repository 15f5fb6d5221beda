"""Thresholds and windows of the divergence predictors, in one place (docs/prediction.md explains them).

Windows are counted in *evaluations* of a series (a tensor statistic is evaluated at each reporting step,
a scalar at each logged step); holding times (`*_for_steps`) and horizons in *training steps*, so that
alerts fire at the same step whatever the reporting interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8mon.monitor.predictors.divergence import MARGIN, M


@dataclass(frozen=True)
class PredictorParams:
    # -- warm-up: statistics move a lot while the model leaves its initialisation; no baseline before this
    warmup_steps: int = 60
    # smoothing of per-tensor statistics: EWMA weight of the newest report
    ewma_alpha: float = 0.2
    # trend window (reports) for rates of change and the steps-to-threshold extrapolations
    trend_window: int = 16

    # -- kurtosis growth: rise of smoothed ln(kurtosis) above its own running minimum (after warm-up).
    # Healthy small runs grow kurtosis up to ~4x while they learn, so 2x is only "info".
    kurtosis_alpha: float = 0.1         # EWMA weight of ln(kurtosis): slower than the others, it is noisy
    # pass Q: that weight is per 2 training steps, not per report (the CPU profile's interval, so its runs are
    # smoothed as before; the GPU profile reports every 5 steps and was smoothed over 2.5x as many steps)
    kurtosis_alpha_steps: int | None = 2
    kurtosis_rise_info: float = 0.7     # ln units: 2x the kurtosis minimum
    # The level that warns. Was 2.1 (8x) until the second corpus, then 2.3 (10x) until pass R: a healthy wide Llama
    # bf16 run (gpu-wide-llama-bf16-long-s14-stable, pass Q held out) grew its blocks.1.mlp.fc2 output kurtosis
    # 12-13x, slowly. With pass Q's fast-rise warning the level warning led by 10 steps in total over the 62
    # diverging runs of passes A-Q; 2.6-2.8 warn as many >= 100 steps ahead with no alert on a stable run. Pass R:
    # 2.8, the critical level, i.e. a slow rise is info until it is critical (docs/prediction.md)
    kurtosis_rise: float = 2.8
    kurtosis_rise_critical: float = 2.8  # 16x -> critical
    kurtosis_mean_rise_info: float = 0.4  # layer-average (per site) of ln(kurtosis): 1.5x -> info
    kurtosis_mean_rise: float = 1.1     # 3x -> warning
    kurtosis_for_steps: int = 20
    # pass E: the minimum of ln(kurtosis) over only the last 500 steps, not since warm-up: a healthy 1200-step
    # FOG run's mlp.fc2 output kurtosis drifted 10x over its minimum by step 680 (pass D, held out); diverging
    # runs rise within 100-200 steps. Pass H: 200. Two more healthy 1200-step FOG runs (pass G, held out) drifted
    # 10x within 500 steps (blocks.0.mlp.fc2 output, steps 554 and 598). On every run of passes A-G, windows of
    # 150-300 steps give the same leads with no alert on a stable run (100 and 60 lose lead, 400 and 500 keep a
    # false alert): 200 is the middle of that range
    kurtosis_baseline_steps: int | None = 200
    # pass Q: a fast rise is a warning too: the same smoothed ln(kurtosis) above its minimum over only the last
    # 50 training steps (from warm-up on), 1.2 (3.3x), output/weight sites. Healthy runs grow their kurtosis by
    # up to 3.1x within 50 steps (rise 1.12, cpu-fog-fp8-long-s13-stable at step 142; 1.02 on the GPU,
    # gpu-wide-llama-bf16-long-s10-stable at step 125); the six learning-rate ramps it was chosen for reach 1.30-2.42
    # by 100 steps before they diverge. Chosen on every run of passes A-P (docs/prediction.md, pass Q): 1.2 and 1.3
    # warn all six >= 100 steps ahead with no alert on a stable run, 1.1 pages that CPU run, 1.4 loses two ramps
    kurtosis_fast_steps: int | None = 50
    kurtosis_fast_rise: float = 1.2

    # -- amax drift toward saturation (delayed scaling only: a reported amax_history_max)
    # Short histories overflow by ~1% for a few steps whenever gradients grow fast (early training), in
    # healthy runs too: that is info; a sustained 1% is a warning, 10% critical.
    overflow_frac_info: float = 1e-3     # EWMA of the overflow fraction
    overflow_frac: float = 1e-2
    saturation_horizon: int = 300        # info when the headroom trend reaches overflow within this many steps
    saturation_for_steps: int = 10
    saturation_min_rate: float = 0.005   # binades/step: slower closing is noise (1 binade in 200 steps)
    # A stale scale: log2(fmt_max / (amax_history_max * scale)) has moved this many binades since warm-up (it is
    # exactly the margin while the scale is refreshed from the history at every step). Its tensor's headroom
    # closing at >= `saturation_stale_min_rate` toward overflow within `saturation_warning_horizon` steps is a
    # warning: with casts that do not saturate the first overflow is a NaN, so the overflow fraction never
    # warns. A frozen scale under a steadily growing amax closes at ~0.004-0.01 binades/step.
    saturation_stale: float = 0.5
    saturation_stale_min_rate: float = 0.002
    saturation_warning_horizon: int = 500
    saturation_min_headroom: float = 0.05  # binades: below it the tensor sits at its scale (overflow_frac decides)

    # -- underflow fraction rising above its running minimum (after warm-up), absolute fraction; high-lr
    # runs that survive flush 5-10% more too, so only a fifth of the nonzero elements lost is a warning
    underflow_rise_info: float = 0.05
    underflow_rise: float = 0.2
    underflow_for_steps: int = 20
    # pass K: info only. The two held-out 8-layer x d 1024 Llama runs of pass J, healthy for 1500 steps, flushed up
    # to 35% more of an attention grad_output as they went on (9 warnings); the three FOG ramps without QK-norm it
    # had warned first (rise 0.28-0.31) are warned 139-196 steps ahead by attention max-logit growth without it
    underflow_pages: bool = False

    # -- robust spikes of loss and ln(grad_norm): median/MAD over the last `spike_window` logged values
    spike_window: int = 50
    spike_min_history: int = 20
    loss_spike_z: float = 8.0
    grad_norm_spike_z: float = 8.0
    spike_for_steps: int = 3

    # -- slow drifts of the loss (nats) and ln(grad_norm) above their running minimum (after warm-up)
    slow_alpha: float = 0.05
    loss_drift: float = 0.3
    # 0.7 = 2x (was 0.5 = 1.65x until the third corpus: a 1500-step healthy FOG run's grad norm grew 1.65x as
    # its cosine schedule decayed; 0.7 changes no diverging run's first alert)
    grad_norm_rise: float = 0.7
    drift_for_steps: int = 20

    # -- growth of ln(optimizer / attention scalars) above their running minimum (after warm-up)
    growth_info_fraction: float = 0.35   # info finding from this fraction of the warning rise on
    # 33x the minimum max-logit. Was 2.1 (8x) until pass F: healthy 1200-step CPU Llama runs sharpen their
    # attention 7-8.5x (rises 1.95 and 2.14; pass E's held-out false alert); 3.0 and 3.5 gave the same leads on
    # the tune runs, 3.5 leaves more room. A run without QK-norm grew it 5000x (rise 8.6) before diverging
    attn_logit_rise: float = 3.5
    adam_update_rise: float = 0.7        # 2x
    # log Z drifts by 3 nats (was 2 until the third corpus: a 1500-step healthy FOG run drifted by 2; healthy
    # 300-700-step runs sharpen by ~1 nat; no diverging run's first alert is this one)
    logsumexp_rise: float = 3.0
    # pass D: info only. Over 19 diverging runs it was never the first alert, and healthy 1500-step runs drift
    # past 2 and 3 nats (gpu-fog-fp8-long-stable, gpu-llama-fp8-long-stable)
    logsumexp_pages: bool = False
    scalar_growth_for_steps: int = 20

    # -- the loss has left its running minimum (the divergence rule's condition, reported as it happens)
    loss_margin: float = MARGIN
    loss_margin_steps: int = M
