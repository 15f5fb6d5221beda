"""The lead figures of fp8mon.monitor.evaluation (what bench/predict.py prints): the literal first-alert lead
and the standing lead, where an alert that resolved before the divergence step counts as a false alarm, not
as lead."""

import dataclasses
import math

from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS
from fp8mon.monitor.evaluation import Outcome, baseline, lead, standing_lead
from fp8mon.monitor.fixtures import Fixture


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
