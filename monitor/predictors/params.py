"""Thresholds and windows of the divergence predictors, in one place (docs/prediction-reference.md explains
them, signal by signal).

Windows are counted in *evaluations* of a series (a tensor statistic is evaluated at each reporting step,
a scalar at each logged step), except the kurtosis baselines and smoothing, which are in training steps;
holding times (`*_for_steps`) and horizons are in *training steps*, so that alerts fire at the same step
whatever the reporting interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8mon.monitor.predictors.divergence import MARGIN, M


@dataclass(frozen=True)
class PredictorParams:
    # -- warm-up: statistics move a lot while the model leaves its initialisation and the learning rate climbs;
    # no baseline before its end: the step at which the reported lr stopped rising, within [warmup_min_steps,
    # warmup_max_steps]; `warmup_steps` for a run that reports no lr (monitor.predictors.schedule)
    warmup_steps: int = 60
    warmup_min_steps: int = 20
    warmup_max_steps: int = 60
    # after an event (the loss above its divergence band, the lr off its schedule) baselines are taken again from
    # this many steps after it ended: 2.5 time constants of the slowest EWMA (kurtosis, loss drift: ~20 steps), so a
    # statistic that dipped during the event is back near its level before the minima resume
    event_settle_steps: int = 50
    # smoothing of per-tensor statistics: EWMA weight of the newest report
    ewma_alpha: float = 0.2
    # trend window (reports) for rates of change and the steps-to-threshold extrapolations
    trend_window: int = 16
    # ... over this many training steps instead, where it matters (the headroom of saturation, the kurtosis
    # countdown): the same rate whatever the reporting interval (32 = 16 reports of the CPU corpus)
    trend_steps: int = 32
    # the EWMA weights `ewma_alpha` of tensor statistics and of the attention / optimizer / log Z scalars are per
    # this many training steps, not per report, so a signal smooths over the same training steps whatever the
    # reporting interval (2: the CPU corpus' interval, where one report weighs exactly `ewma_alpha`)
    tensor_alpha_steps: int = 2
    scalar_alpha_steps: int = 2

    # -- kurtosis growth: rise of smoothed ln(kurtosis) above its own running minimum (after warm-up).
    # Kurtosis grows in every run while the model learns, healthy runs included, so 2x is only "info".
    kurtosis_alpha: float = 0.1         # EWMA weight of ln(kurtosis): slower than the others, it is noisy
    # that weight is per 2 training steps, not per report, so the smoothing spans the same training steps
    # whatever the reporting interval (2 steps is the CPU profile's interval: there one report gets exactly 0.1)
    kurtosis_alpha_steps: int | None = 2
    kurtosis_rise_info: float = 0.7     # ln units: 2x the kurtosis minimum
    # The level at which a slow rise warns: 16x, the critical level, so a slow rise is info until it is critical.
    # Healthy runs grow the kurtosis of their branch outputs 10x and more, slowly (a wide Llama bf16 run: 12-13x
    # at an mlp.fc2 output), while the diverging runs are warned earlier by the fast rise below, so a lower level
    # would page healthy runs and win almost no lead (docs/prediction-reference.md, "Kurtosis")
    kurtosis_rise: float = 2.8
    kurtosis_rise_critical: float = 2.8  # 16x -> critical
    kurtosis_mean_rise_info: float = 0.4  # layer-average (per site) of ln(kurtosis): 1.5x -> info
    kurtosis_mean_rise: float = 1.1     # 3x -> warning
    kurtosis_for_steps: int = 20
    # The minimum of ln(kurtosis) is taken over only the last 200 training steps, not since warm-up: healthy long
    # runs drift slowly (healthy 1200-step FOG runs' mlp.fc2 output kurtosis grows 10x within 500 steps), while
    # diverging ones rise within 100-200 steps. Windows of 150-300 steps give the same leads with no alert on a
    # stable run (100 and 60 lose lead, 400 and 500 page a healthy run): 200 is the middle of that range
    kurtosis_baseline_steps: int | None = 200
    # A fast rise is a warning too: the same smoothed ln(kurtosis) above its minimum over only the last 50
    # training steps (from warm-up on), by 1.2 (3.3x), on output/weight sites. Healthy runs grow their kurtosis
    # by at most 3.1x within 50 steps (rise 1.12 on a CPU run, 1.02 on the GPU), while learning-rate ramps reach
    # a rise of 1.3-2.4 100 steps before they diverge: 1.2 and 1.3 warn every ramp >= 100 steps ahead with no
    # alert on a stable run, 1.1 pages a healthy run, 1.4 warns some ramps too late
    kurtosis_fast_steps: int | None = 50
    kurtosis_fast_rise: float = 1.2
    # A slow creep warns too: the same level above its minimum since the warm-up (output/weight sites), from 55x:
    # healthy runs of the corpus creep up to 24x (CPU FOG) and 27x (a wide GPU Llama) since their warm-up
    kurtosis_long_rise: float = 4.0

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
    # Info only by default: healthy 8-layer x d 1024 Llama runs flush up to 35% more of an attention grad_output
    # over 1500 steps, and the diverging runs it would warn first (FOG ramps without QK-norm, rise 0.28-0.31) are
    # warned 139-196 steps ahead by attention max-logit growth anyway
    underflow_pages: bool = False

    # -- robust spikes of loss and ln(grad_norm): median/MAD over the last `spike_window` logged values
    spike_window: int = 50
    spike_min_history: int = 20
    loss_spike_z: float = 8.0
    grad_norm_spike_z: float = 8.0
    spike_for_steps: int = 3

    # -- slow drifts of the loss (nats) and ln(grad_norm) above their running minimum (after warm-up)
    slow_alpha: float = 0.05
    # 0.3 nat: a healthy run's smoothed loss only falls, and runs pushed past their stable learning rate creep
    # up 0.3 nat 100-180 steps before they meet the divergence rule
    loss_drift: float = 0.3
    # a loss enters the drift's EWMA at most this many times `loss_drift` above its minimum: a burst of bad data
    # (+3 nat for 40 steps) would otherwise hold the drift's finding for 100 steps after the loss recovered
    drift_clip: float = 2.0
    # 0.7 = 2x: a healthy 1500-step FOG run's grad norm grows 1.65x as its cosine schedule decays, and 2x
    # rather than 1.65x makes no diverging run's first alert later
    grad_norm_rise: float = 0.7
    drift_for_steps: int = 20

    # -- growth of ln(optimizer / attention scalars) above their running minimum (after warm-up)
    growth_info_fraction: float = 0.35   # info finding from this fraction of the warning rise on
    # 33x the minimum max-logit: healthy 1200-step CPU Llama runs sharpen their attention 7-8.5x (rises 1.95 and
    # 2.14), and 3.0 and 3.5 give the same leads on the labelled runs, so 3.5 leaves more room. A run without
    # QK-norm grows it 5000x (rise 8.6) before it diverges
    attn_logit_rise: float = 3.5
    # An absolute danger level of the smoothed attention max-logit, whatever it grew from (Wortsman et al., small-
    # scale proxies: attention-logit growth precedes instability). QK-Clip (Kimi K2) caps logits at 100, but healthy
    # wide GPU Llama runs of the corpus reach 355-637 without QK-norm, while the runs that failed without QK-norm
    # passed 10^6: hence 1000
    attn_logit_level: float | None = 1000.0
    adam_update_rise: float = 0.7        # 2x
    # log Z drifts by 3 nats: healthy 300-700-step runs sharpen by ~1 nat and a healthy 1500-step FOG run
    # drifts by 2
    logsumexp_rise: float = 3.0
    # Info only by default: it is no diverging run's first alert, and healthy 1500-step runs drift by 2-3 nats
    # and more
    logsumexp_pages: bool = False
    scalar_growth_for_steps: int = 20

    # -- the learning rate leaving its schedule after the warm-up: `lr_jump` times its lowest of the last
    # `lr_window` steps (monitor.predictors.schedule)
    lr_jump: float = 1.5
    lr_window: int = 100
    # -- the loss no longer falling while the lr climbs in its warm-up (monitor.predictors.schedule.WarmupStall):
    # over the last >= `warmup_stall_steps` steps in which the lr grew `warmup_stall_lr` times, the smoothed loss
    # (EWMA weight `slow_alpha` per step) fell less than `warmup_stall_progress` nats and less than
    # `warmup_stall_fraction` of its fall since the first step (the fraction spares a fine-tuning run, which starts
    # near its floor; a loss that never fell by `warmup_stall_progress` arms nothing). Healthy warm-ups of fp8mon's
    # corpus and of the tuning split stay >= 1.56x above the nearer of the two thresholds (fp8mon's healthy runs
    # fall >= 0.45 nat over the last 1.5x of their lr); the tuning split's hot GPT-2 crosses both at step 117 and
    # holds from 143: warned at 153, 129 steps before it stalls (at 0.2 nat: 166, 116 ahead)
    warmup_stall_lr: float = 1.5
    warmup_stall_steps: int = 40
    warmup_stall_progress: float = 0.25
    warmup_stall_fraction: float = 0.1
    warmup_stall_for_steps: int = 10

    # -- the loss has left its running minimum (the divergence rule's condition, reported as it happens)
    loss_margin: float = MARGIN
    loss_margin_steps: int = M
