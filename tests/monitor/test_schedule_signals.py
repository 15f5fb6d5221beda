"""The predictors' reading of the learning-rate schedule (warm-up end, an lr that leaves its schedule), absolute
attention max-logit levels, slow kurtosis creep since the warm-up, and a transient burst that resolves, on
synthetic streams."""

import math

from fp8mon.monitor.alerting.lifecycle import ESCALATED, FIRED, RESOLVED, AlertTracker
from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS
from fp8mon.monitor.predictors import RunPredictor
from fp8mon.monitor.predictors.schedule import Warmup
from fp8mon.monitor.wire import IngestBatch
from tests.monitor.test_predictors import LAYERS, first_fired, healthy, merge, replay, stream

FEW = LAYERS[:4]


def cosine(step, warmup=100, steps=1500, peak=3e-3):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))


def scalars_with(lr_fn, extra=None):
    def fn(step, rng):
        out = {"loss": 3.0 + 0.05 * rng.standard_normal(), "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
               "lr": lr_fn(step)}
        out.update(extra(step) if extra else {})
        return out
    return fn


def _stream(steps, scalar_fn, **kw):
    return stream(steps, scalar_fn=scalar_fn, layers=FEW, **kw)


def test_the_warm_up_ends_where_the_reported_lr_stops_rising_within_its_bounds():
    def ended(lrs):
        w = Warmup()
        for step, lr in enumerate(lrs):
            w.observe(step, lr)
        return w.end, w.lr_end

    assert ended([cosine(s, warmup=40) for s in range(100)]) == (40, 40)
    stepped = [cosine(s - s % 5, warmup=200, steps=400) for s in range(400)]  # a warm-up stepped every 5 steps
    assert ended(stepped) == (60, 201)  # the peak: cosine(200), the first step of the decay
    assert ended([1e-3] * 100) == (20, 1)  # no warm-up: the baselines still wait for warmup_min_steps
    assert ended([cosine(s, warmup=400, steps=500) for s in range(500)]) == (60, 400)  # capped for the baselines
    assert ended([None] * 100) == (60, math.inf)  # no lr reported: the default


def test_an_lr_jump_pages_at_once_and_a_cosine_schedule_never_does():
    jump = scalars_with(lambda s: cosine(s) * (20.0 if s >= 700 else 1.0))
    step, alert = first_fired(replay(_stream(800, jump)))
    assert alert is not None and alert.rule == "lr_schedule" and step == 700
    restart = scalars_with(lambda s: cosine(s) if s < 700 else cosine(s - 600))  # back at the peak at 700
    step, alert = first_fired(replay(_stream(800, restart)))
    assert alert.rule == "lr_schedule" and step == 700
    assert first_fired(replay(_stream(800, scalars_with(cosine)))) == (None, None)
    stepped = scalars_with(lambda s: cosine(s - s % 5, warmup=200))  # its repeated values are not the warm-up's end
    assert first_fired(replay(_stream(400, stepped))) == (None, None)


def test_an_attention_max_logit_past_its_danger_level_warns_though_it_grew_before_the_warm_up_ended():
    # 50x within the first 50 steps, then a plateau at 2000: growth from the warm-up's level is ~1x
    logits = scalars_with(cosine, lambda s: {"attn_max_logit": 40.0 * 50 ** min(1.0, s / 50)})
    step, alert = first_fired(replay(_stream(300, logits)))
    assert alert is not None and alert.rule == "attn_logit_growth" and step < 100
    calm = scalars_with(cosine, lambda s: {"attn_max_logit": 8.0 * 50 ** min(1.0, s / 50)})  # plateau at 400
    assert first_fired(replay(_stream(300, calm))) == (None, None)


def _creep(factor, steps):
    def grow(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.0.mlp.fc2" and site == "output":
            stats["kurtosis"] *= factor ** (step / steps)
        return stats
    return grow


def test_a_slow_kurtosis_creep_warns_once_it_passes_the_level_since_warm_up_but_a_healthy_creep_does_not():
    # 100x over 1500 steps: ~1.6x per 50 steps, under the fast rule, and the 200-step window forgets it
    creep = replay(stream(1500, _creep(100.0, 1500), every=10, layers=FEW))
    step, alert = first_fired(creep)
    assert alert is not None and alert.rule == "kurtosis_growth" and (alert.layer, alert.site) == \
        ("blocks.0.mlp.fc2", "output")
    assert "since the warm-up" in next(f.message for a in creep if a.step == step for f in a.findings
                                       if f.layer == "blocks.0.mlp.fc2" and f.severity == "warning")
    healthy_creep = replay(stream(1500, _creep(20.0, 1500), every=10, layers=FEW))  # as healthy runs do
    assert first_fired(healthy_creep) == (None, None)


def test_a_burst_of_bad_data_warns_then_resolves_and_the_risk_returns_to_low():
    def burst(step, rng):
        bad = 600 <= step < 640
        return {"loss": (5.5 if bad else 2.5) + 0.05 * rng.standard_normal(),
                "grad_norm": (4.0 if bad else 1.0) * (1 + 0.05 * rng.standard_normal()), "lr": cosine(step)}

    assessments = replay(_stream(900, burst))
    tracker, fired, resolved = AlertTracker(), [], []
    for a in assessments:
        for event in tracker.update(a.run, a.step, a.findings):
            if event.kind == FIRED and event.alert.severity in ("warning", "critical"):
                fired.append(event.step)
            elif event.kind == RESOLVED:
                resolved.append(event.step)
    assert fired and 600 <= min(fired) <= 615
    assert resolved and max(resolved) <= 640 + 100  # within 100 steps of the recovery
    assert max(a.risk for a in assessments[-(900 - 640 - RESOLVE_AFTER_STEPS):]) < 0.5


def test_batches_of_one_step_and_of_many_steps_read_the_lr_alike():
    batches = _stream(300, scalars_with(lambda s: cosine(s) * (10.0 if s >= 200 else 1.0)))
    one = RunPredictor("a")
    many = RunPredictor("b")
    a = [x.risk for b in batches for x in one.observe(IngestBatch.model_validate(b))]
    b = [x.risk for i in range(0, 300, 25) for x in many.observe(IngestBatch.model_validate(merge(batches[i:i + 25])))]
    assert a == b and max(a) >= 0.5


def _paging_spans(assessments):
    """{(rule, layer, site, first step): [fired step, resolved step or None]} of the alerts that paged."""
    tracker, spans = AlertTracker(), {}
    for a in assessments:
        for event in tracker.update(a.run, a.step, a.findings):
            al = event.alert
            key = (al.rule, al.layer, al.site, al.first_step)
            if event.kind in (FIRED, ESCALATED) and al.severity in ("warning", "critical") and key not in spans:
                spans[key] = [event.step, None]
            elif event.kind == RESOLVED and key in spans:
                spans[key][1] = event.step
    return spans


def test_an_lr_jump_after_which_the_loss_settles_higher_resolves_its_alerts_once_the_run_recovered():
    # x20 from step 700: the loss blows up for 60 steps, then settles 0.4 nat above its level before the jump (a
    # new floor under the new learning rate, not a drift: the drift's baseline is taken again after the event)
    def jump(step, rng):
        up = 2.0 if 700 <= step < 760 else 0.4 if step >= 760 else 0.0
        return {"loss": 2.5 + up + 0.05 * rng.standard_normal(), "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
                "lr": cosine(step) * (20.0 if step >= 700 else 1.0)}

    spans = _paging_spans(replay(_stream(1200, jump)))
    assert min(fired for fired, _ in spans.values()) == 700  # lr_schedule, at the jump
    assert all(fired < 760 for fired, _ in spans.values()), spans  # nothing new pages once it recovered
    assert all(end is not None and end <= 760 + 100 for _, end in spans.values()), spans


def test_a_burst_that_flattens_a_tensor_pages_no_kurtosis_alert_when_the_tensor_comes_back():
    # random tokens: the loss +3 nat and one output's kurtosis 5x lower for the burst, back to its level after
    def tensors(step, layer, site, rng):
        stats = healthy(step, layer, site, rng)
        if layer == "blocks.0.attn.proj" and site == "output" and 600 <= step < 640:
            stats["kurtosis"] /= 5.0
        return stats

    def burst(step, rng):
        return {"loss": (5.5 if 600 <= step < 640 else 2.5) + 0.05 * rng.standard_normal(),
                "grad_norm": 1.0 + 0.05 * rng.standard_normal(), "lr": cosine(step)}

    spans = _paging_spans(replay(stream(900, tensors, burst, every=2, layers=FEW)))
    assert spans and not [k for k in spans if k[0] == "kurtosis_growth"], spans
    assert all(end is not None and end <= 640 + 100 for _, end in spans.values()), spans


def test_a_drift_that_begins_after_a_recovered_burst_still_warns():
    def burst_then_creep(step, rng):
        loss = 2.5 + (3.0 if 600 <= step < 640 else 0.0) + 0.004 * max(0, step - 800)
        return {"loss": loss + 0.05 * rng.standard_normal(), "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
                "lr": cosine(step)}

    assessments = replay(_stream(1200, burst_then_creep))
    step, alert = first_fired([a for a in assessments if a.step >= 760], rule="loss_drift")
    assert alert is not None and 800 < step <= 950  # +0.3 nat by step 875, then held 20 steps


def _warmup_run(loss_fn, peak=0.2, warmup=500):
    return _stream(600, lambda step, rng: {"loss": loss_fn(step) + 0.05 * rng.standard_normal(),
                                           "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
                                           "lr": peak * min(1.0, (step + 1) / warmup)})


def test_a_loss_that_stops_falling_while_the_warm_up_climbs_on_warns_before_the_run_stalls():
    # learns until step ~120, then sits on a plateau while the lr keeps climbing for 380 more steps
    stalled = _warmup_run(lambda s: max(2.6, 5.5 - 3.0 * (1 - math.exp(-s / 40))))
    step, alert = first_fired(replay(stalled))
    assert alert is not None and alert.rule == "warmup_stall" and 150 <= step <= 260, (step, alert)
    assert "past its stable learning rate" in alert.message


def test_a_warm_up_whose_loss_keeps_falling_or_starts_near_its_floor_does_not_warn():
    assert first_fired(replay(_stream(600, scalars_with(cosine)))) == (None, None)  # flat loss, 100-step warm-up
    learning = _warmup_run(lambda s: 2.0 + 3.5 * math.exp(-s / 100), warmup=300)  # falls all through its warm-up
    assert first_fired(replay(learning), rule="warmup_stall") == (None, None)
    fine_tune = _warmup_run(lambda s: 1.8 + 0.2 * math.exp(-s / 200), peak=2e-5, warmup=300)  # near its floor
    assert first_fired(replay(fine_tune), rule="warmup_stall") == (None, None)
