"""The alerting pipeline against a real store (SQLite and PostgreSQL): stored batches -> predictor ->
predictions, alert rows through their lifecycle, /metrics state; restart, deletion, back-pressure."""

import threading
import time

import pytest
from sqlalchemy import select

from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS, Assessment, Finding
from fp8mon.monitor.gauges import batch_gauges
from fp8mon.monitor.metrics import Metrics
from fp8mon.monitor.models import Alert, Prediction
from fp8mon.monitor.pipeline import Pipeline
from fp8mon.monitor.wire import IngestBatch


class Scripted:
    """A predictor whose findings per step come from `script(step) -> list[Finding]`; risk = step / 1000."""

    instances: list = []

    def __init__(self, run, config=None, params=None, *, script=None, gate=None):
        self.run, self.config, self.script, self.gate = run, config, script, gate
        self.seen: list[int] = []
        Scripted.instances.append(self)

    def observe(self, batch):
        if self.gate is not None:
            self.gate.wait(10)
        steps = sorted({*batch.scalars.step}) if batch.scalars else []
        self.seen.extend(steps)
        return [Assessment(run=self.run, step=s, risk=min(1.0, s / 1000), steps_to_divergence=1000 - s,
                           signals={"kurtosis": s / 10, "bad": float("nan")},
                           culprits=[{"layer": "blocks.0.attn.qkv", "site": "input", "signal": "kurtosis",
                                      "value": s / 10}],
                           findings=self.script(s) if self.script else [],
                           gauges={"worst_kurtosis": s / 10})
                for s in steps]


def batch(run, steps, bid=None, loss=1.0, status=None):
    body = {"version": 1, "batch_id": bid or f"{run}-{steps[0]}", "run": run,
            "scalars": {"step": list(steps), "name": ["loss"] * len(steps), "value": [loss] * len(steps)}}
    if status:
        body["run_meta"] = {"status": status}
    return IngestBatch.model_validate(body)


def feed(store, run, lo, hi, per_batch=10):
    for start in range(lo, hi, per_batch):
        store.ingest(batch(run, list(range(start, min(hi, start + per_batch)))))


@pytest.fixture
def make_pipeline(store):
    made = []

    def make(script=None, gate=None, **kwargs):
        metrics = Metrics()
        p = Pipeline(store, metrics=metrics,
                     predictor_factory=lambda run, config=None: Scripted(run, config, script=script, gate=gate),
                     **kwargs).start()
        store.add_ingest_listener(p.submit)
        made.append(p)
        return p

    yield make
    for p in made:
        store.remove_ingest_listener(p.submit)
        p.stop()


def kurtosis_after(start, severity="warning", for_steps=20, until=None):
    def script(step):
        if step >= start and (until is None or step < until):
            return [Finding(rule="kurtosis_growth", severity=severity, step=step, layer="blocks.0.attn.qkv",
                            site="input", value=step / 10, message=f"kurtosis {step / 10}", for_steps=for_steps)]
        return []
    return script


def alert_rows(store):
    with store.db.reading() as conn:
        return conn.execute(select(Alert).order_by(Alert.id)).all()


def test_alert_fires_resolves_and_is_stored_once(store, make_pipeline):
    p = make_pipeline(script=kurtosis_after(100, until=200))
    feed(store, "run-a", 0, 150)
    assert p.flush()
    (row,) = alert_rows(store)
    assert (row.state, row.severity, row.rule, row.layer, row.site) == ("firing", "warning", "kurtosis_growth",
                                                                        "blocks.0.attn.qkv", "input")
    assert (row.first_step, row.fired_step, row.last_step) == (100, 120, 149)
    assert row.details["value"] == pytest.approx(14.9) and row.details["for_steps"] == 20
    assert p.metrics.runs.snapshot()["run-a"].firing == {"info": 0, "warning": 1, "critical": 0}

    feed(store, "run-a", 150, 200 + RESOLVE_AFTER_STEPS + 10)
    assert p.flush()
    (row,) = alert_rows(store)
    assert (row.state, row.last_step, row.resolved_step) == ("resolved", 199, 199 + RESOLVE_AFTER_STEPS)
    assert row.resolved_at is not None
    assert p.metrics.runs.snapshot()["run-a"].firing["warning"] == 0


class Collect:
    """A notifier that keeps the events it is handed."""

    def __init__(self):
        self.events = []

    def notify(self, event):
        self.events.append((event.kind, event.step, event.alert.severity))


def test_the_notifier_hears_fired_escalated_and_resolved_once_each(store, make_pipeline):
    def script(step):
        if 10 <= step < 40:
            severity = "critical" if step >= 30 else "warning"
            return [Finding(rule="amax_saturation", severity=severity, step=step, message=severity, for_steps=5)]
        return []

    notifier = Collect()
    p = make_pipeline(script=script, notifier=notifier)
    feed(store, "run-n", 0, 40 + RESOLVE_AFTER_STEPS + 10)
    assert p.flush()
    # pending (step 10) and the steps it held are not news; the resolution comes RESOLVE_AFTER_STEPS after step 39
    assert notifier.events == [("fired", 15, "warning"), ("escalated", 30, "critical"),
                               ("resolved", 39 + RESOLVE_AFTER_STEPS, "critical")]


def test_pending_alert_that_disappears_leaves_no_row(store, make_pipeline):
    p = make_pipeline(script=kurtosis_after(100, until=110))
    feed(store, "run-b", 0, 105)
    assert p.flush()
    assert [r.state for r in alert_rows(store)] == ["pending"]
    feed(store, "run-b", 105, 130)
    assert p.flush()
    assert alert_rows(store) == []


def test_escalation_updates_the_same_row(store, make_pipeline):
    def script(step):
        severity = "critical" if step >= 50 else "warning"
        return [Finding(rule="amax_saturation", severity=severity, step=step, message=severity, for_steps=0)]
    p = make_pipeline(script=script)
    feed(store, "run-c", 0, 60)
    assert p.flush()
    (row,) = alert_rows(store)
    assert (row.state, row.severity, row.message, row.fired_step) == ("firing", "critical", "critical", 0)


def test_predictions_are_decimated_but_latest_is_current(store, make_pipeline):
    p = make_pipeline(every_steps=10, risk_delta=0.05)
    feed(store, "run-d", 0, 95, per_batch=7)
    assert p.flush()
    with store.db.reading() as conn:
        steps = conn.execute(select(Prediction.step).order_by(Prediction.step)).scalars().all()
    # every 10th step, and the last step of each 7-step batch (risk moves 0.001 per step: never by 0.05)
    expected = sorted({s for s in range(95) if s % 10 == 0} | {min(94, b + 6) for b in range(0, 95, 7)})
    assert steps == expected
    latest = store.latest_prediction("run-d").to_dict()
    assert latest["step"] == 94 and latest["risk"] == pytest.approx(0.094)
    assert latest["signals"] == {"kurtosis": pytest.approx(9.4), "bad": "NaN"}  # NaN stored as JSON-safe text
    assert latest["culprits"][0]["layer"] == "blocks.0.attn.qkv"
    snap = p.metrics.runs.snapshot()["run-d"].values
    assert snap["risk"] == pytest.approx(0.094) and snap["last_step"] == 94 and snap["worst_kurtosis"] == 9.4


def test_duplicates_are_not_assessed_twice(store, make_pipeline):
    p = make_pipeline()
    store.ingest(batch("run-e", [0, 1, 2], bid="same"))
    store.ingest(batch("run-e", [0, 1, 2], bid="same"))
    assert p.flush()
    assert Scripted.instances[-1].seen == [0, 1, 2]


def test_restart_continues_alerts_without_duplicates(store, make_pipeline):
    p = make_pipeline(script=kurtosis_after(10, severity="critical", for_steps=0))
    feed(store, "run-f", 0, 40)
    assert p.flush()
    store.remove_ingest_listener(p.submit)
    p.stop()
    # a new server process: no memory of the alert but the database
    q = make_pipeline(script=kurtosis_after(10, severity="critical", for_steps=0, until=50))
    feed(store, "run-f", 40, 60)
    assert q.flush()
    rows = alert_rows(store)
    assert len(rows) == 1 and rows[0].state == "firing" and rows[0].fired_step == 10 and rows[0].last_step == 49
    assert q.metrics.runs.snapshot()["run-f"].firing["critical"] == 1
    feed(store, "run-f", 60, 49 + RESOLVE_AFTER_STEPS + 1)
    assert q.flush()
    (row,) = alert_rows(store)
    assert row.state == "resolved" and row.resolved_step == 49 + RESOLVE_AFTER_STEPS


def test_restart_seeds_metrics_from_the_database(store, make_pipeline):
    p = make_pipeline(script=kurtosis_after(0, severity="critical", for_steps=0))
    feed(store, "run-g", 0, 30)
    assert p.flush()
    store.remove_ingest_listener(p.submit)
    p.stop()
    q = make_pipeline()
    deadline = time.monotonic() + 10
    while "run-g" not in q.metrics.runs.snapshot() and time.monotonic() < deadline:
        time.sleep(0.02)
    state = q.metrics.runs.snapshot()["run-g"]
    assert state.firing["critical"] == 1 and state.values["last_step"] == 29
    assert state.values["risk"] == pytest.approx(0.029)


def test_full_queue_drops_batches_and_never_blocks_ingest(store, make_pipeline):
    gate = threading.Event()
    p = make_pipeline(gate=gate, queue_size=2)
    t0 = time.monotonic()
    feed(store, "run-h", 0, 60)  # 6 batches: 1 being assessed (blocked), 2 queued, 3 dropped
    elapsed = time.monotonic() - t0
    gate.set()
    assert p.flush()
    assert elapsed < 5
    assert p.metrics.predictor_dropped._value.get() >= 3
    assert len(Scripted.instances[-1].seen) <= 30


def test_deleted_run_loses_its_state_and_series(store, make_pipeline):
    gate = threading.Event()
    p = make_pipeline(script=kurtosis_after(0, severity="critical", for_steps=0), gate=gate)
    gate.set()
    feed(store, "run-i", 0, 20)
    assert p.flush()
    assert "run-i" in p.metrics.runs.snapshot()
    gate.clear()
    feed(store, "run-i", 20, 40)  # queued behind the gate
    store.delete_run("run-i").to_dict()
    p.forget_run("run-i")
    assert "run-i" not in p.metrics.runs.snapshot()
    gate.set()
    assert p.flush()
    assert "run-i" not in p.metrics.runs.snapshot()
    assert alert_rows(store) == [] and p.tracker.active("run-i") == []
    # a new run of the same name starts from nothing
    feed(store, "run-i", 0, 10)
    assert p.flush()
    (row,) = alert_rows(store)
    assert row.fired_step == 0 and row.state == "firing"


def test_a_failing_predictor_is_counted_and_the_pipeline_goes_on(store, make_pipeline):
    def script(step):
        if step == 15:
            raise RuntimeError("predictor bug")
        return []
    p = make_pipeline(script=script)
    feed(store, "run-j", 0, 30)
    assert p.flush()
    assert p.metrics.predictor_errors._value.get() == 1
    assert store.latest_prediction("run-j").to_dict()["step"] == 29


def test_final_status_ends_the_run_series_after_grace(store, make_pipeline):
    p = make_pipeline()
    p.metrics.runs.grace_seconds = 0.2
    store.ingest(batch("run-k", [0, 1]))
    store.ingest(batch("run-k", [2], bid="last", status="finished"))
    assert p.flush()
    assert "run-k" in p.metrics.runs.snapshot()
    time.sleep(0.3)
    assert "run-k" not in p.metrics.runs.snapshot()


def test_batch_gauges_take_the_worst_layer_at_the_last_step():
    b = IngestBatch.model_validate({
        "version": 1, "batch_id": "x", "run": "r",
        "tensors": {"step": [1, 1, 2, 2, 2], "layer": ["a", "b", "a", "b", "c"], "site": ["input"] * 5,
                    "stats": {"kurtosis": [99, 1, 3, 7, None], "underflow_frac": [0.5, 0, 0.01, 0.02, 0.03],
                              "overflow_frac": [0, 0, 0, 0.001, 0], "nonfinite": [0, 0, 0, 2, 0]}},
        "scalars": {"step": [2, 2], "name": ["loss", "grad_norm"], "value": [float("nan"), 1.0]}})
    g = batch_gauges(b)
    assert g["last_step"] == 2 and g["worst_kurtosis"] == 7 and g["worst_underflow_frac"] == 0.03
    assert g["worst_overflow_frac"] == 0.001 and g["nonfinite_tensors"] == 2  # layer b + the NaN loss


def test_predictor_setting_resolution():
    from fp8mon.monitor.pipeline import load_factory
    from fp8mon.monitor.settings import DEFAULT_PREDICTOR
    from tests.integration.fake_predictor import ThresholdPredictor

    assert load_factory("") is None
    assert load_factory("tests.integration.fake_predictor:ThresholdPredictor") is ThresholdPredictor
    with pytest.raises(ModuleNotFoundError):
        load_factory("fp8mon.monitor.no_such_module:Predictor")
    try:
        from fp8mon.monitor.predictors import RunPredictor
    except ImportError:  # the default predictors are optional: without them, no predictions (and no error)
        assert load_factory(DEFAULT_PREDICTOR) is None
    else:
        assert load_factory(DEFAULT_PREDICTOR) is RunPredictor
