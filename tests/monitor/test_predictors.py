"""The divergence predictors on synthetic streams (each signal, batching invariance, speed of the
non-finite path), the divergence rule, and the replay of the CPU labelled-run fixtures."""

import dataclasses
import math

import numpy as np
import pytest

from fp8mon.monitor.alerting.lifecycle import ESCALATED, FIRED, AlertTracker
from fp8mon.monitor.fixtures import EARLY_BEFORE, fixture_paths, load_fixture
from fp8mon.monitor.predictors import PredictorParams, RunPredictor, divergence_step
from fp8mon.monitor.predictors.divergence import MARGIN, M
from fp8mon.monitor.wire import IngestBatch

LAYERS = [f"blocks.{i}.{m}" for i in range(4) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
SITES = ("input", "weight", "output", "grad_output", "grad_weight")


def healthy(step, layer, site, rng):
    """Statistics of a well-behaved tensor: kurtosis ~3, a little noise, current scaling."""
    amax = 4.0 * (1 + 0.02 * rng.standard_normal())
    fmax = 448.0 if site in ("input", "weight") else 57344.0
    return {"numel": 4096, "amax": amax, "rms": 1.0, "kurtosis": 3.0 * (1 + 0.03 * rng.standard_normal()),
            "underflow_frac": 0.01 * (1 + 0.05 * rng.standard_normal()), "overflow_frac": 0.0, "nonfinite": 0,
            "scale": None if site == "output" else fmax / amax, "amax_history_max": None}


def stream(steps, tensor_fn=healthy, scalar_fn=None, every=1, seed=0, layers=LAYERS):
    """One wire batch dict per step: tensors on reporting steps, loss/grad_norm on every step."""
    rng = np.random.default_rng(seed)
    scalar_fn = scalar_fn or (lambda step, rng: {"loss": 3.0 + 0.05 * rng.standard_normal(),
                                                 "grad_norm": 1.0 + 0.05 * rng.standard_normal()})
    batches = []
    for step in range(steps):
        batch = {"version": 1, "batch_id": f"b{step}", "run": "synthetic"}
        if step % every == 0:
            names = layers(step) if callable(layers) else layers
            keys = [(layer, site) for layer in names for site in SITES]
            records = [tensor_fn(step, layer, site, rng) for layer, site in keys]
            batch["tensors"] = {"step": step, "layer": [k[0] for k in keys], "site": [k[1] for k in keys],
                                "stats": {name: [r[name] for r in records] for name in records[0]}}
        scalars = scalar_fn(step, rng)
        batch["scalars"] = {"step": step, "name": list(scalars), "value": list(scalars.values())}
        batches.append(batch)
    return batches


def merge(batches):
    """Several one-step batch dicts as one batch of several steps (columns concatenated, steps as lists)."""
    out = {"version": 1, "batch_id": batches[0]["batch_id"] + "+", "run": batches[0]["run"]}
    tensors = [b["tensors"] for b in batches if "tensors" in b]
    if tensors:
        out["tensors"] = {"step": [t["step"] for t in tensors for _ in t["layer"]],
                          "layer": [x for t in tensors for x in t["layer"]],
                          "site": [x for t in tensors for x in t["site"]],
                          "stats": {k: [x for t in tensors for x in t["stats"][k]] for k in tensors[0]["stats"]}}
    scalars = [b["scalars"] for b in batches]
    out["scalars"] = {"step": [s["step"] for s in scalars for _ in s["name"]],
                      "name": [x for s in scalars for x in s["name"]],
                      "value": [x for s in scalars for x in s["value"]]}
    return out


def replay(batches, params=None):
    predictor = RunPredictor(batches[0]["run"] if batches else "synthetic", params=params)
    return [a for b in batches for a in predictor.observe(IngestBatch.model_validate(b))]


def first_fired(assessments, rule=None):
    """(step, alert) of the first alert of severity warning/critical that fires (optionally of one rule)."""
    tracker = AlertTracker()
    for a in assessments:
        for event in tracker.update(a.run, a.step, a.findings):
            if event.kind in (FIRED, ESCALATED) and event.alert.severity in ("warning", "critical") \
                    and (rule is None or event.alert.rule == rule):
                return a.step, event.alert
    return None, None


def test_a_flat_healthy_stream_has_no_risk_and_no_findings():
    assessments = replay(stream(300))
    assert [a.step for a in assessments] == list(range(300))
    assert max(a.risk for a in assessments) < 0.05
    assert not [f for a in assessments for f in a.findings]
    assert assessments[-1].gauges["worst_kurtosis"] == pytest.approx(3.0, rel=0.2)
    assert set(assessments[-1].gauges) >= {"worst_kurtosis", "worst_underflow_frac", "worst_overflow_frac", "loss",
                                           "grad_norm"}


def test_a_kurtosis_ramp_fires_kurtosis_growth_naming_the_layer():
    def ramp(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.2.mlp.fc2" and site == "output" and step > 100:
            stats["kurtosis"] *= math.exp(0.04 * (step - 100))  # doubles every ~17 steps
        return stats

    assessments = replay(stream(300, ramp, every=2))
    step, alert = first_fired(assessments)
    assert alert is not None and alert.rule == "kurtosis_growth"
    assert (alert.layer, alert.site) == ("blocks.2.mlp.fc2", "output")
    assert 100 < step < 220
    at = next(a for a in assessments if a.step == step)
    assert at.culprits[0]["layer"] == "blocks.2.mlp.fc2" and at.risk >= 0.5
    assert at.steps_to_divergence is not None and at.steps_to_divergence > 0


def _kurtosis_growth(factor, start, steps):
    """healthy() with blocks.1.mlp.fc2's output kurtosis growing `factor`-fold over `steps` steps from `start`."""
    def grow(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.1.mlp.fc2" and site == "output":
            stats["kurtosis"] *= factor ** min(1.0, max(0.0, (step - start) / steps))
        return stats
    return grow


def test_a_fast_kurtosis_rise_below_the_10x_warning_warns_but_the_same_rise_spread_over_300_steps_does_not():
    # pass Q: 6x within 30 steps (rise 1.8, under the 10x = 2.3 of the 200-step rule), reported every 5 steps as
    # the GPU profile does: the learning-rate ramps' kurtosis jumps like this 100+ steps before they diverge
    fast = replay(stream(300, _kurtosis_growth(6.0, 100, 30), every=5))
    step, alert = first_fired(fast)
    assert alert is not None and alert.rule == "kurtosis_growth" and alert.severity == "warning"
    assert (alert.layer, alert.site) == ("blocks.1.mlp.fc2", "output")
    assert 110 < step < 170
    at = next(a for a in fast if a.step == step)
    assert at.risk >= 0.5 and at.steps_to_divergence is not None
    assert "within 50 steps" in next(f.message for f in at.findings if f.layer == "blocks.1.mlp.fc2")
    without = replay(stream(300, _kurtosis_growth(6.0, 100, 30), every=5),
                     dataclasses.replace(PredictorParams(), kurtosis_fast_steps=None))
    assert first_fired(without) == (None, None)  # the 200-step rule alone: info
    # healthy runs grow their kurtosis as much, slowly (up to 3.1x within 50 steps on the corpus)
    slow = replay(stream(400, _kurtosis_growth(6.0, 80, 300), every=5))
    assert first_fired(slow) == (None, None)
    assert max(a.risk for a in slow) < 0.5
    assert any(f.rule == "kurtosis_growth" and f.severity == "info" for a in slow for f in a.findings)


def test_kurtosis_is_smoothed_over_training_steps_whatever_the_reporting_interval():
    from fp8mon.monitor.predictors.series import LevelTracker

    levels = {}
    for every in (1, 2, 5):
        per_step, per_report = LevelTracker(0.1, 4, 0, alpha_steps=2), LevelTracker(0.1, 4, 0)
        for step in range(0, 161, every):
            value = np.array([0.0 if step < 100 else 2.0])
            per_step.update(step, value)
            per_report.update(step, value)
        levels[every] = (per_step.level[0], per_report.level[0])
    # the same up to the first interval after the jump, which weighs as the steps since the report before
    assert levels[1][0] == pytest.approx(levels[2][0], abs=0.02) == pytest.approx(levels[5][0], abs=0.02)
    assert levels[2][0] == pytest.approx(levels[2][1])  # 0.1 per 2 steps: the CPU profile's smoothing, as before
    assert levels[5][1] < levels[5][0] - 0.3  # per report, a 5-step interval smoothed over 2.5x as many steps


def test_a_nan_fires_a_critical_nonfinite_finding_at_once_naming_the_first_layer_and_site():
    def nan_late(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if step >= 150 and layer in ("blocks.1.mlp.fc1", "blocks.3.attn.qkv") and site == "grad_output":
            stats.update(kurtosis=float("nan"), nonfinite=7)
        return stats

    assessments = replay(stream(200, nan_late))
    step, alert = first_fired(assessments)
    assert step == 150 and alert.rule == "nonfinite" and alert.severity == "critical"
    assert (alert.layer, alert.site) == ("blocks.1.mlp.fc1", "grad_output")
    at = assessments[150]
    assert at.risk == 1.0 and at.steps_to_divergence == 0
    assert [f.for_steps for f in at.findings if f.rule == "nonfinite"] == [0]


def test_the_nan_kurtosis_of_a_tensor_of_zeros_is_not_a_nonfinite_value_but_one_with_an_amax_is():
    # delayed scaling's first step: with no amax in the history yet, a small gradient underflows to zeros only
    def zeros_then_nan(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.3.mlp.fc1" and site == "grad_weight":
            if step == 0:
                stats.update(amax=0.0, rms=0.0, kurtosis=float("nan"), underflow_frac=0.0)
            elif step == 150:
                stats.update(kurtosis=float("nan"))  # NaN moments of a tensor that has values: a real signal
        return stats

    step, alert = first_fired(replay(stream(200, zeros_then_nan)))
    assert step == 150 and alert.rule == "nonfinite"
    assert (alert.layer, alert.site) == ("blocks.3.mlp.fc1", "grad_weight")


def test_a_nan_loss_alone_is_nonfinite_too():
    scalars = lambda step, rng: {"loss": float("nan") if step == 120 else 3.0, "grad_norm": 1.0}  # noqa: E731
    step, alert = first_fired(replay(stream(130, scalar_fn=scalars)), rule="nonfinite")
    assert step == 120 and alert.layer is None and alert.severity == "critical"


def test_a_loss_spike_fires_loss_spike():
    def spike(step, rng):
        return {"loss": 3.0 + 0.05 * rng.standard_normal() + (2.0 if 150 <= step < 160 else 0.0),
                "grad_norm": 1.0 + 0.05 * rng.standard_normal()}

    assessments = replay(stream(200, scalar_fn=spike))
    step, alert = first_fired(assessments)
    assert alert.rule == "loss_spike" and 150 <= step <= 155
    assert not [f for a in assessments[:150] for f in a.findings]


def test_a_slowly_rising_loss_fires_loss_drift_long_before_the_divergence_rule():
    def creep(step, rng):  # falls to 2.5, then climbs 0.004 nat/step: 1 nat above the minimum at step ~450
        base = 3.0 - 0.5 * min(step, 200) / 200 + 0.004 * max(0, step - 200)
        return {"loss": base + 0.05 * rng.standard_normal(), "grad_norm": 1.0}

    assessments = replay(stream(520, scalar_fn=creep))
    step, alert = first_fired(assessments)
    label = divergence_step([(a.step, a.gauges["loss"]) for a in assessments])
    assert alert.rule == "loss_drift" and label is not None and label - step >= 100


def test_amax_drifting_to_saturation_under_delayed_scaling_counts_down_to_overflow():
    history_max = 100.0

    def drift(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if site != "output":
            fmax = 448.0 if site in ("input", "weight") else 57344.0
            amax = 25.0 * (1 + 0.01 * rng.standard_normal())
            if layer == "blocks.0.attn.qkv" and site == "input":
                amax = 25.0 * 2 ** (0.01 * step)  # closes 2 binades of headroom in 200 steps
            stats.update(amax=amax, amax_history_max=history_max, scale=fmax / history_max)
        return stats

    assessments = replay(stream(200, drift))
    step = next(a.step for a in assessments if a.findings)
    named = {(f.rule, f.layer, f.site) for a in assessments for f in a.findings}
    assert named == {("amax_saturation", "blocks.0.attn.qkv", "input")}  # an info finding: no page yet
    assert assessments[step].culprits[0]["layer"] == "blocks.0.attn.qkv"
    estimates = [a.steps_to_divergence for a in assessments[step:190]]
    assert all(e is not None and math.isfinite(e) for e in estimates)
    assert estimates[-1] < estimates[0]  # counts down as the overflow nears
    assert abs(assessments[100].steps_to_divergence - 100) < 30  # the amax reaches the history max at step 200


def _frozen_scale_stream(freeze_at: int | None):
    """fc1's input amax grows 0.8%/step; its delayed scale is refreshed from the history (margin 2) at every
    step, or frozen at `freeze_at` (the history max keeps following the amax)."""
    frozen = {}

    def stats_fn(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.2.mlp.fc1" and site == "input":
            amax = 4.0 * 2 ** (0.008 * step) * (1 + 0.01 * rng.standard_normal())
            history_max = amax / (1 + 0.01 * abs(rng.standard_normal()))
            scale = 448.0 / (history_max * 4)
            if freeze_at is not None and step >= freeze_at:
                scale = frozen.setdefault("scale", scale)
            stats.update(amax=amax, amax_history_max=history_max, scale=scale)
        return stats

    return stats_fn


def test_a_tensor_outgrowing_its_frozen_scale_warns_hundreds_of_steps_before_it_overflows():
    assessments = replay(stream(400, _frozen_scale_stream(freeze_at=100)))  # 2 binades closed by step ~350
    step, alert = first_fired(assessments)
    assert (alert.rule, alert.layer, alert.site, alert.severity) == ("amax_saturation", "blocks.2.mlp.fc1", "input",
                                                                      "warning")
    assert 100 < step <= 350 - 100  # a page at least 100 steps before the first overflow
    assert abs(assessments[250].steps_to_divergence - 100) < 40


def test_a_scale_refreshed_at_every_step_never_warns_however_fast_its_tensor_grows():
    assessments = replay(stream(400, _frozen_scale_stream(freeze_at=None)))
    assert first_fired(assessments) == (None, None)
    assert not [f for a in assessments for f in a.findings if f.rule == "amax_saturation"]


def test_overflow_already_happening_is_a_finding():
    def stale(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if site == "weight":
            stats.update(amax_history_max=4.0, scale=448.0 / 4.0,
                         overflow_frac=0.2 if (layer == "blocks.3.mlp.fc1" and step >= 50) else 0.0)
        return stats

    step, alert = first_fired(replay(stream(120, stale)))
    assert alert.rule == "amax_saturation" and alert.layer == "blocks.3.mlp.fc1" and alert.severity == "critical"
    assert 50 <= step <= 50 + PredictorParams().saturation_for_steps


def test_underflow_rising_is_an_info_finding_that_pages_only_when_asked():
    def flush(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.1.attn.proj" and site == "grad_output" and step > 100:
            stats["underflow_frac"] = 0.01 + 0.002 * (step - 100)
        return stats

    assessments = replay(stream(250, flush))
    assert first_fired(assessments) == (None, None)  # info only by default (pass K): healthy wide runs flush too
    info = [f for f in assessments[-1].findings if f.rule == "underflow_rise"]
    assert [(f.layer, f.site, f.severity) for f in info] == [("blocks.1.attn.proj", "grad_output", "info")]
    assert assessments[-1].risk < 0.5
    step, alert = first_fired(replay(stream(250, flush), PredictorParams(underflow_pages=True)))
    assert alert.rule == "underflow_rise" and (alert.layer, alert.site) == ("blocks.1.attn.proj", "grad_output")


def test_attention_max_logit_growth_is_a_finding():
    def logits(step, rng):
        return {"loss": 3.0, "grad_norm": 1.0, "attn_max_logit": 10.0 * (1.0 if step < 100 else 1.03 ** (step - 100))}

    step, alert = first_fired(replay(stream(250, scalar_fn=logits)))
    assert alert.rule == "attn_logit_growth" and 150 < step < 250


def test_a_trailing_baseline_forgets_slow_drift_but_keeps_a_fast_rise():
    from fp8mon.monitor.predictors.series import LevelTracker

    drift, since_warmup = LevelTracker(1.0, 4, 0, baseline_steps=400), LevelTracker(1.0, 4, 0)
    for step in range(1200):  # +3 over 1200 steps: 0.1 per 40 steps
        value = np.array([0.0025 * step])
        drift.update(step, value)
        since_warmup.update(step, value)
    assert since_warmup.rise()[0] == pytest.approx(3.0, abs=0.01)
    assert 0.99 <= drift.rise()[0] <= 1.15  # only the last 400-450 steps count
    for step in range(1200, 1300):  # then +2 within 100 steps
        drift.update(step, np.array([3.0 + 0.02 * (step - 1200)]))
    assert drift.rise()[0] >= 2.0  # the fast +2 shows in full (on top of the last 400 steps of drift)


def test_log_z_drift_is_shown_but_never_pages():
    def drift(step, rng):  # log Z falls 5 nats after warm-up, as in long healthy runs
        return {"loss": 3.0, "grad_norm": 1.0, "logit_logsumexp": 8.0 + 0.02 * max(0, step - 100)}

    assessments = replay(stream(400, scalar_fn=drift))
    assert first_fired(assessments) == (None, None)
    shown = [f for a in assessments for f in a.findings if f.rule == "logsumexp_drift"]
    assert shown and {f.severity for f in shown} == {"info"}
    assert max(a.risk for a in assessments) < 0.5


def test_gradient_kurtosis_growth_is_only_info():
    def ramp(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.2.mlp.fc2" and site == "grad_output" and step > 100:
            stats["kurtosis"] *= math.exp(0.04 * (step - 100))
        return stats

    assessments = replay(stream(300, ramp, every=2))
    assert first_fired(assessments) == (None, None)
    assert any(f.rule == "kurtosis_growth" and f.site == "grad_output" and f.severity == "info"
               for f in assessments[-1].findings)


def test_splitting_batches_differently_gives_the_same_assessments():
    def ramp(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.0.mlp.fc1" and step > 60:
            stats["kurtosis"] *= 1.03 ** (step - 60)
        return stats

    one_by_one = stream(160, ramp, every=2)
    merged = [merge(one_by_one[i:i + 7]) for i in range(0, len(one_by_one), 7)]
    whole = [merge(one_by_one)]
    a, b, c = replay(one_by_one), replay(merged), replay(whole)
    assert [x.step for x in a] == [x.step for x in b] == [x.step for x in c] == list(range(160))
    for x, y, z in zip(a, b, c):
        assert dataclasses.asdict(x) == dataclasses.asdict(y) == dataclasses.asdict(z)
    assert any(x.findings for x in a)


def test_rank_minus_one_is_preferred_and_other_ranks_ignored():
    batches = stream(40)
    for b in batches:
        t = b["tensors"]
        n = len(t["layer"])
        bad = {k: list(v) for k, v in t["stats"].items()}
        bad["nonfinite"] = [5] * n  # rank 1 saw NaN: not this predictor's concern, rank 0 did not
        merged = {k: v + bad[k] for k, v in t["stats"].items()}
        b["tensors"] = {"step": t["step"], "layer": t["layer"] * 2, "site": t["site"] * 2,
                        "rank": [0] * n + [1] * n, "stats": merged}
    assert not [f for a in replay(batches) for f in a.findings]
    for b in batches:  # now the reduced records carry the NaN and rank 0 does not: rank -1 wins
        b["tensors"]["rank"] = [0] * (len(b["tensors"]["layer"]) // 2) + [-1] * (len(b["tensors"]["layer"]) // 2)
    assert all(any(f.rule == "nonfinite" for f in a.findings) for a in replay(batches))


def test_a_layer_appearing_late_and_nulls_are_tolerated():
    def grows(step):
        return LAYERS[:4] if step < 50 else LAYERS

    def with_nulls(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if site == "output":
            stats.update(underflow_frac=None, overflow_frac=None, kurtosis=None)
        return stats

    assessments = replay(stream(120, with_nulls, layers=grows))
    assert len(assessments) == 120 and not [f for a in assessments for f in a.findings]

    # a layer whose first record carries only amax, then the usual records again
    later = [dict(b, tensors=dict(b["tensors"], step=b["tensors"]["step"] + 81),
                  scalars=dict(b["scalars"], step=b["scalars"]["step"] + 81)) for b in stream(30)]
    odd = {"version": 1, "batch_id": "odd", "run": "synthetic",
           "tensors": {"step": 80, "layer": ["late.layer"], "site": ["input"], "stats": {"amax": [1.0]}}}
    assessments = replay(stream(80) + [odd] + later)
    assert [a.step for a in assessments] == list(range(111)) and assessments[-1].risk < 0.05


def test_late_steps_are_not_evaluated_twice():
    batches = stream(30)
    predictor = RunPredictor("synthetic")
    steps = [a.step for b in batches + batches[10:12] for a in predictor.observe(IngestBatch.model_validate(b))]
    assert steps == list(range(30)) and predictor.late_steps == 2


def test_a_step_of_100_layers_by_5_sites_takes_well_under_a_millisecond():
    import time

    layers = [f"blocks.{i}.x" for i in range(100)]
    batches = [IngestBatch.model_validate(b) for b in stream(150, layers=layers)]
    predictor = RunPredictor("synthetic")
    for b in batches[:50]:
        predictor.observe(b)
    t0 = time.process_time()  # this process's CPU time: other processes on a busy machine do not count
    for b in batches[50:]:
        predictor.observe(b)
    per_step = (time.process_time() - t0) / 100
    assert per_step < 5e-3, f"{per_step * 1e3:.2f} ms per step"  # bench/predict.py measures it; slack for loaded CI


# -- the divergence rule ---------------------------------------------------------------------------

def test_divergence_rule_non_finite_loss():
    assert divergence_step([(0, 3.0), (1, 2.5), (2, float("nan")), (3, 2.0)]) == 2


def test_divergence_rule_needs_m_consecutive_steps_above_the_margin():
    losses = [(s, 3.0 - 0.01 * s) for s in range(100)]  # minimum 2.01 at step 99
    high = 2.01 + MARGIN + 0.1
    blip = losses + [(100 + s, high) for s in range(M - 1)] + [(100 + M - 1, 2.2)]
    assert divergence_step(blip) is None
    blowup = losses + [(100 + s, high) for s in range(M)]
    assert divergence_step(blowup) == 100
    assert divergence_step(losses + [(100 + s, 2.01 + MARGIN - 0.05) for s in range(50)]) is None


# -- the labelled runs (tests/fixtures/runs: CPU runs at the top, GPU runs under gpu/) ----------------------

CPU_FIXTURES = fixture_paths(profile="cpu")


def test_the_cpu_corpus_has_stable_and_diverging_runs_labelled_by_the_rule():
    fixtures = [load_fixture(p) for p in CPU_FIXTURES]
    diverging = [f for f in fixtures if f.outcome == "diverged"]
    stable = [f for f in fixtures if f.outcome == "stable"]
    early = [f for f in fixtures if f.outcome == "early"]  # diverged before any 100-step lead was possible
    # chosen to diverge, not diverged by the rule (which reads losses) when the trainer stopped: a NaN gradient
    censored = [f for f in fixtures if f.outcome == "censored"]
    assert len(diverging) >= 2 and len(stable) >= 2
    assert len(diverging) + len(stable) + len(early) + len(censored) == len(fixtures)
    assert all(f.divergence_step < EARLY_BEFORE for f in early)
    for f in fixtures:  # the stored label is the rule applied to the stored losses
        assert f.divergence_step == divergence_step(f.losses())


def test_a_run_chosen_to_diverge_that_did_not_is_censored_not_stable():
    fx = load_fixture(CPU_FIXTURES[0])
    censored = dataclasses.replace(fx, diverged=False, divergence_step=None, extra={"expect": "diverging"})
    assert censored.outcome == "censored" and not censored.stable and not censored.diverged
    assert dataclasses.replace(censored, extra={"expect": "stable"}).outcome == "stable"


# Runs on which the predictor misses its target (docs/prediction-evaluation.md). Strict: a change that fixes one
# must take it off this list, and it must then stay fixed.
# (pass D's miss, cpu-fog-fp8-delayed16-s3-stable, was fixed by pass E; pass E's, cpu-llama-bf16-long-s4-stable,
# by pass F; pass Q's kurtosis rules fixed six learning-rate ramps warned 46-87 ahead: gpu-fog-fp8-hot-div,
# gpu-fog-fp8-delayed-ramp-s9-triton-div, gpu-wide-fog-{fp8,bf16}-ramp-s10-div, gpu-wide-fog-fp8-ramp-s12-div,
# gpu-wide-fog-fp8-delayed-ramp-s12-div)
KNOWN_MISSES = {
    "cpu-fog-fp8-frozen-s5-div": "pass F held-out: a cast without saturation overflowed at step 166, before its "
                                 "scales froze (an early amax jump past the margin); paged only at the NaN",
    "cpu-fog-fp8-frozen-s6-div": "pass G held-out: diverged 104 steps after its scales froze (step 300); the "
                                 "stale-scale warning came 14 steps after the freeze, 90 ahead",
    "cpu-fog-fp8-frozen-s7-div": "pass H held-out: as pass F's miss, a cast without saturation overflowed at step "
                                 "221, before its scales froze; paged only at the NaN",
}


def _corpus_params():
    out = []
    for p in fixture_paths():
        name = p.name.split(".")[0]
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name])] if name in KNOWN_MISSES else []
        out.append(pytest.param(p, id=name, marks=marks))
    return out


def _has_nonfinite_scalar(fixture) -> bool:
    return any(v is not None and not math.isfinite(v) for b in fixture.batches if b.get("scalars")
               for v in b["scalars"]["value"])


@pytest.mark.parametrize("path", _corpus_params())
def test_replaying_a_labelled_run_alerts_100_steps_before_divergence_and_never_on_a_stable_run(path):
    fixture = load_fixture(path)
    if fixture.censored and not _has_nonfinite_scalar(fixture):
        pytest.skip("censored by the time limit with finite values: no target either way")
    assessments = replay(fixture.batches)
    step, alert = first_fired(assessments)
    if fixture.early:  # no lead is possible; the divergence pages as soon as the rule can tell it
        losses = dict(fixture.losses())
        if not math.isfinite(losses[fixture.divergence_step]):  # the first non-finite value pages at once
            step, alert = first_fired(assessments, rule="nonfinite")
            assert alert.severity == "critical" and step <= fixture.divergence_step
        else:  # the loss left its minimum by the margin: the rule holds after M logged steps
            step, alert = first_fired(assessments, rule="loss_divergence")
            assert alert.severity == "critical" and step <= fixture.divergence_step + M - 1
    elif fixture.censored:  # no target (bench/predict.py reports it apart); its NaN gradient norm still pages
        step, alert = first_fired(assessments, rule="nonfinite")
        assert alert.severity == "critical" and step <= fixture.last_step()
    elif fixture.diverged:
        assert step is not None and fixture.divergence_step - step >= 100, (step, fixture.divergence_step)
        assert fixture.divergence_step - next(a.step for a in assessments if a.risk >= 0.5) >= 100
        assert assessments[-1].risk == 1.0
    else:
        assert alert is None, alert
        assert max(a.risk for a in assessments) < 0.5  # what Prometheus's risk rules read
