"""The lead figures of fp8mon.monitor.evaluation (what bench/predict.py prints): the literal first-alert lead
and the standing lead, where an alert that resolved before the divergence step counts as a false alarm, not
as lead; the failure labels of monitor.failures; and `fp8mon eval` on the corpus of models fp8mon did not write
(tests/fixtures/corpus), at reporting intervals 1, 5 and 10."""

import dataclasses
import math

import numpy as np
import pytest

from fp8mon.monitor import failures
from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS
from fp8mon.monitor.evaluation import Outcome, baseline, lead, replay, standing_lead, subsample
from fp8mon.monitor.fixtures import FIXTURE_DIR, Fixture, fixture_paths, load_fixture
from fp8mon.monitor.predictors import divergence_step


def diverging_at(step: int) -> Fixture:
    return Fixture(name="run", config={}, diverged=True, divergence_step=step, rule="", batches=[])


def test_a_resolved_chance_alarm_is_lead_only_in_the_literal_reading():
    losses = [(s, 3.0 + 0.01 * (s % 7)) for s in range(600)]
    losses[100] = (100, 9.0)  # one bad batch: z far above 3, then the loss is flat again
    losses[599] = (599, math.nan)  # the run dies at step 599
    fixture, base = diverging_at(599), baseline(losses)
    assert base.first_alert == 100 and lead(fixture, base) == 499
    assert base.spans[0] == [100, 100 + RESOLVE_AFTER_STEPS]  # resolved once absent for the lifecycle's steps
    assert standing_lead(fixture, base) == 0  # the alarm open at the divergence step is the NaN itself


def test_alarms_that_overlap_or_touch_are_one_stretch_and_a_later_one_starts_a_new_one():
    fixture = diverging_at(500)
    out = Outcome(spans=[[100, 200], [150, 300], [300, None]])  # one unbroken stretch from 100
    assert standing_lead(fixture, out) == 400
    out = Outcome(spans=[[100, 200], [250, None], [450, 460]])  # a gap at 200-250: the stretch open at 500 began at 250
    assert standing_lead(fixture, out) == 250
    assert standing_lead(fixture, Outcome(spans=[[100, 200]])) == 0
    assert standing_lead(dataclasses.replace(fixture, diverged=False, divergence_step=None), out) is None


# -- what failure means (monitor.failures) -------------------------------------------------------------------

def _healthy(steps=1200, floor=2.0, seed=0):
    """A loss falling from 5.5 toward `floor`, with batch noise."""
    rng = np.random.default_rng(seed)
    return [(s, floor + 3.5 * math.exp(-s / 150) + 0.05 * rng.standard_normal()) for s in range(steps)]


def test_a_burst_that_recovers_is_transient_not_a_failure():
    losses = [(s, v + (3.0 if 700 <= s < 740 else 0.0)) for s, v in _healthy()]
    f = failures.label(losses)
    assert (f.kind, f.step, f.failed) == ("transient", 700, False)
    assert 740 <= f.recovered <= 745
    assert divergence_step(losses) == 700  # what the divergence rule alone called "diverged"


def test_a_loss_that_blows_up_or_drifts_and_stays_up_fails_at_the_start_of_its_rise():
    nan = [(s, math.nan if s >= 900 else v) for s, v in _healthy()]
    assert failures.label(nan) == failures.Failure("blowup", 900)
    assert failures.label(_healthy(), nonfinite_at=850) == failures.Failure("blowup", 850)
    creep = [(s, v + 0.004 * max(0, s - 600)) for s, v in _healthy()]  # +0.5 nat by step 725, +2.4 by the end
    f = failures.label(creep)
    assert f.kind == "drift" and 700 <= f.step <= 760
    assert failures.label(_healthy()).kind == "none"


def test_a_run_stalled_on_a_plateau_is_a_stall_at_the_step_it_left_the_healthy_reference():
    reference = failures.reference_curve([_healthy(seed=1), _healthy(seed=2)])
    plateau = [(s, max(v, 3.2)) for s, v in _healthy(seed=3)]  # stops learning at 3.2; healthy runs go to 2.0
    f = failures.label(plateau, reference)
    assert f.kind == "stall" and 204 <= f.step <= 240, f  # 0.3 nat above the healthy curve from step 204 on
    assert divergence_step(plateau) is None  # the rule that reads only the run's own minimum misses it
    assert failures.label(plateau).kind == "none"  # without a reference no stall is labelled
    assert failures.label(_healthy(seed=3), reference).kind == "none"


def test_a_run_that_stalls_then_catches_up_is_a_stall_but_a_recovered_burst_is_not():
    reference = failures.reference_curve([_healthy(seed=1), _healthy(seed=2)])
    # stuck at 3.2 over steps 200-500, then learning again and back on the healthy curve by the end
    late = [(s, max(v, 3.2) if s < 500 else v + max(0.0, 1.2 * (1 - (s - 500) / 200))) for s, v in _healthy(seed=3)]
    f = failures.label(late, reference)
    assert f.kind == "stall" and 204 <= f.step <= 240, f  # 300 steps of the schedule lost, whatever came after
    short = [(s, max(v, 3.2) if s < 260 else v) for s, v in _healthy(seed=3)]  # above the reference < 100 steps
    assert failures.label(short, reference).kind == "none"
    burst = [(s, v + (3.0 if 700 <= s < 740 else 0.0)) for s, v in _healthy(seed=3)]
    assert failures.label(burst, reference).kind == "transient"  # its raised loss is the burst, not a plateau


def test_an_fp8_run_above_its_bf16_twin_beyond_the_tolerance_is_a_quality_gap():
    twin = dict(failures.smoothed(_healthy(seed=1)))
    gap = [(s, v + (0.15 if s >= 500 else 0.0)) for s, v in _healthy(seed=2)]
    f = failures.label(gap, twin=twin)
    assert f.kind == "quality_gap" and 480 <= f.step <= 560, f
    assert failures.label(_healthy(seed=2), twin=twin).kind == "none"


def test_subsampling_keeps_every_step_scalars_and_thins_the_rest():
    batch = {"version": 1, "batch_id": "b", "run": "r",
             "tensors": {"step": [0, 0, 3, 5], "layer": ["a", "b", "a", "a"], "site": ["output"] * 4,
                         "stats": {"kurtosis": [1.0, 2.0, 3.0, 4.0]}},
             "scalars": {"step": [3, 3, 5], "name": ["loss", "attn_max_logit", "attn_max_logit"],
                         "value": [1.0, 2.0, 3.0]}}
    out = subsample([batch], 5)[0]
    assert out["tensors"]["step"] == [0, 0, 5] and out["tensors"]["stats"]["kurtosis"] == [1.0, 2.0, 4.0]
    assert list(zip(out["scalars"]["step"], out["scalars"]["name"])) == [(3, "loss"), (5, "attn_max_logit")]
    assert subsample([batch], 1) == [batch]


# -- the corpus of models fp8mon did not write (bench/corpus/make.py) -------------------------------------------

CORPUS = FIXTURE_DIR.parent / "corpus"
INTERVALS = (1, 5, 10)
@pytest.fixture(scope="module")
def corpus():
    return [load_fixture(p) for p in fixture_paths(CORPUS)]


@pytest.fixture(scope="module")
def first_alerts(corpus):
    """(first paging alert, its rule) of every corpus run at reporting intervals 1, 5 and 10."""
    return {f.name: {every: replay(f, every=every) for every in INTERVALS} for f in corpus}


def test_the_corpus_keeps_tune_and_held_out_runs_apart_and_labels_each_by_what_happened(corpus):
    for split, folder in (("tune", "tune"), ("test", "heldout")):
        runs = [f for f in corpus if f.path.parent.name == folder]
        assert runs and {f.split for f in runs} == {split}
        assert all(f.name.startswith(f"ext-{folder}-") for f in runs)
    for f in corpus:
        kind = f.failure.kind
        if f.name.endswith("-stable"):
            assert kind == "none", f.name
        elif f.name.endswith(("-burst", "-lrjump")):  # the loss blew up and came back: not a failure
            assert kind == "transient" and f.failure.recovered > f.failure.step, f.name
        else:  # hot: trains, then sits on a plateau far above the healthy run of its split (some catch up later)
            assert kind == "stall" and f.failure.step >= 160, f.name


def test_first_warnings_move_by_at_most_10_steps_whatever_the_reporting_interval(first_alerts):
    for name, by_every in first_alerts.items():
        steps = [by_every[e].first_alert for e in INTERVALS]
        assert steps.count(None) in (0, len(steps)), (name, steps)
        if steps[0] is not None:
            assert max(steps) - min(steps) <= 10, (name, steps)


def test_every_failing_corpus_run_is_warned_100_steps_before_it_fails_at_any_reporting_interval(corpus, first_alerts):
    failing = [f for f in corpus if f.failure.failed]
    assert len(failing) >= 4  # the stalls of both splits
    for f in failing:
        for every in INTERVALS:
            first = first_alerts[f.name][every].first_alert
            assert first is not None and f.failure.step - first >= 100, (f.name, every, first, f.failure.step)


def _healthy_runs():
    out = []
    for p in fixture_paths(CORPUS):
        f = load_fixture(p)
        if f.failure.kind == "none":
            out.append(pytest.param(f.name, id=f.name))
    return out


@pytest.mark.parametrize("name", _healthy_runs())
def test_no_stable_corpus_run_pages_at_any_reporting_interval(name, first_alerts):
    assert all(first_alerts[name][e].alerts == 0 for e in INTERVALS)


def test_a_transient_corpus_run_resolves_its_alerts_within_100_steps_of_its_recovery(corpus):
    from fp8mon.monitor.scoring import RESOLVE_TARGET, score

    for every in (1, 10):
        for row in score(corpus, every=every).rows:
            if row.role == "transient":
                assert row.resolved_after is None or row.resolved_after <= RESOLVE_TARGET, (row.name, every)


def test_fp8mon_eval_prints_each_run_and_the_baseline_at_its_own_and_at_the_matched_threshold(capsys):
    from fp8mon.cli import main

    assert main(["eval", str(CORPUS / "heldout"), "--every", "1", "10"]) == 0
    out = capsys.readouterr().out
    assert out.count("reporting every") == 2
    for p in fixture_paths(CORPUS / "heldout"):
        assert p.name.split(".")[0] in out
    assert "z>3 first" in out and "(no alarm on the stable runs)" in out
    assert main(["eval", str(CORPUS / "nothing-here")]) == 2


def test_fp8mon_eval_scores_stored_runs_with_labels_given_beside_them(store, database_url, tmp_path, capsys):
    import json

    from fp8mon.cli import main
    from fp8mon.monitor.wire import IngestBatch

    runs = [load_fixture(CORPUS / "heldout" / f"ext-heldout-{name}.json.gz")
            for name in ("gpt2-bf16-stable", "llama-bf16-burst")]
    for f in runs:
        for batch in f.batches:
            store.ingest(IngestBatch.model_validate(batch))
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({f.name: f.failure.as_dict() for f in runs}))
    assert main(["eval", "--labels", str(labels), "--database-url", database_url]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("ext-heldout-")}
    assert rows["ext-heldout-gpt2-bf16-stable"][2:4] == ["none", "-"]
    assert rows["ext-heldout-gpt2-bf16-stable"][8] == "0"  # no paging alert on the stable run
    assert rows["ext-heldout-llama-bf16-burst"][2:5] == ["transient", "380", "478"]
    labels.write_text(json.dumps({"no-such-run": {"kind": "none"}}))
    assert main(["eval", "--labels", str(labels), "--database-url", database_url]) == 1
