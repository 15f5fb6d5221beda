"""Alerts: the lifecycle rules of monitor.assessment (pure AlertTracker), and the REST listing/ack API."""

import pytest

from fp8mon.monitor.alerting.lifecycle import AlertTracker, fingerprint
from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS, Finding


def f(rule="kurtosis_growth", severity="warning", step=0, layer="blocks.0.mlp.fc1", site="input", for_steps=0,
      message=None, value=None):
    return Finding(rule=rule, severity=severity, step=step, message=message or f"{rule} {severity}", layer=layer,
                   site=site, for_steps=for_steps, value=value)


def kinds(events):
    return [e.kind for e in events]


# -- lifecycle --------------------------------------------------------------------------------------


def test_zero_for_steps_fires_at_once():
    t = AlertTracker()
    events = t.update("r", 10, [f(rule="nonfinite", severity="critical")])
    assert kinds(events) == ["fired"]
    alert = events[0].alert
    assert (alert.state, alert.severity, alert.first_step, alert.fired_step) == ("firing", "critical", 10, 10)


def test_pending_until_held_for_steps_then_fires_once():
    t = AlertTracker()
    assert kinds(t.update("r", 100, [f(for_steps=20)])) == ["pending"]
    for step in range(101, 120):
        assert t.update("r", step, [f(for_steps=20)]) == [], step
    events = t.update("r", 120, [f(for_steps=20)])
    assert kinds(events) == ["fired"]
    assert events[0].alert.first_step == 100 and events[0].alert.fired_step == 120
    # level-triggered findings keep coming: no new event, one alert
    for step in range(121, 200):
        assert t.update("r", step, [f(for_steps=20)]) == []
    assert len(t.active("r")) == 1 and t.active("r")[0].last_step == 199


def test_for_steps_counts_training_steps_not_evaluations():
    t = AlertTracker()
    assert kinds(t.update("r", 0, [f(for_steps=20)])) == ["pending"]
    assert t.update("r", 10, [f(for_steps=20)]) == []
    assert kinds(t.update("r", 25, [f(for_steps=20)])) == ["fired"]


def test_pending_alert_dropped_when_finding_disappears():
    t = AlertTracker()
    t.update("r", 0, [f(for_steps=5)])
    events = t.update("r", 1, [])
    assert kinds(events) == ["dropped"]
    assert t.active("r") == []
    # it starts over: a new pending alert, which needs its full for_steps again
    assert kinds(t.update("r", 2, [f(for_steps=5)])) == ["pending"]
    assert t.update("r", 6, [f(for_steps=5)]) == []
    assert kinds(t.update("r", 7, [f(for_steps=5)])) == ["fired"]


def test_firing_alert_resolves_after_absence_and_survives_short_gaps():
    t = AlertTracker()
    t.update("r", 0, [f()])
    # absent for fewer than RESOLVE_AFTER_STEPS steps, then back: still the same firing alert
    for step in range(1, RESOLVE_AFTER_STEPS):
        assert t.update("r", step, []) == [], step
    assert t.update("r", RESOLVE_AFTER_STEPS, [f()]) == []
    last = RESOLVE_AFTER_STEPS
    for step in range(last + 1, last + RESOLVE_AFTER_STEPS):
        assert t.update("r", step, []) == []
    events = t.update("r", last + RESOLVE_AFTER_STEPS, [])
    assert kinds(events) == ["resolved"]
    assert events[0].alert.resolved_step == last + RESOLVE_AFTER_STEPS
    assert events[0].alert.last_step == last and events[0].alert.fired_step == 0
    assert t.active("r") == [] and t.runs() == []
    # the condition again after resolution: a new alert
    assert kinds(t.update("r", 500, [f()])) == ["fired"]


def test_resolution_with_sparse_evaluations():
    t = AlertTracker()
    t.update("r", 0, [f()])
    assert t.update("r", RESOLVE_AFTER_STEPS - 1, []) == []
    assert kinds(t.update("r", RESOLVE_AFTER_STEPS + 7, [])) == ["resolved"]


def test_escalation_of_a_firing_alert_and_no_deescalation():
    t = AlertTracker()
    t.update("r", 0, [f(severity="info")])
    events = t.update("r", 1, [f(severity="critical", message="kurtosis 80")])
    assert kinds(events) == ["escalated"]
    assert events[0].previous_severity == "info" and events[0].alert.severity == "critical"
    assert events[0].alert.message == "kurtosis 80"
    assert t.update("r", 2, [f(severity="warning", message="calmer")]) == []
    (alert,) = t.active("r")
    assert alert.severity == "critical" and alert.message == "kurtosis 80"
    # escalating to the same severity again is no event
    assert t.update("r", 3, [f(severity="critical")]) == []


def test_escalated_step_is_the_last_rise_after_firing_and_fired_step_stays():
    t = AlertTracker()
    assert t.update("r", 80, [f(severity="info")])[0].alert.escalated_step is None
    assert t.update("r", 200, [f(severity="info")]) == []
    (event,) = t.update("r", 300, [f(severity="warning")])
    assert (event.kind, event.alert.fired_step, event.alert.escalated_step) == ("escalated", 80, 300)
    assert t.update("r", 310, [f(severity="info")]) == [] and t.active("r")[0].escalated_step == 300
    (event,) = t.update("r", 400, [f(severity="critical")])
    assert (event.alert.fired_step, event.alert.escalated_step) == (80, 400)
    # resolution keeps it
    last = 400 + RESOLVE_AFTER_STEPS
    (event,) = t.update("r", last, [])
    assert (event.kind, event.alert.fired_step, event.alert.escalated_step) == ("resolved", 80, 400)


def test_a_severity_rise_while_pending_is_no_escalation():
    t = AlertTracker()
    t.update("r", 0, [f(severity="info", for_steps=10)])
    t.update("r", 5, [f(severity="warning", for_steps=10)])
    (event,) = t.update("r", 10, [f(severity="warning", for_steps=10)])
    assert (event.kind, event.alert.severity, event.alert.fired_step) == ("fired", "warning", 10)
    assert event.alert.escalated_step is None
    # never rising after firing: still None; a restored alert keeps its escalated_step
    assert t.update("r", 20, [f(severity="warning", for_steps=10)]) == []
    assert t.active("r")[0].escalated_step is None
    t.update("r", 30, [f(severity="critical", for_steps=10)])
    fresh = AlertTracker()
    fresh.restore(t.active("r"))
    assert fresh.active("r")[0].escalated_step == 30


def test_pending_alert_takes_the_higher_severity_and_its_shorter_for_steps():
    t = AlertTracker()
    assert kinds(t.update("r", 0, [f(severity="warning", for_steps=100)])) == ["pending"]
    events = t.update("r", 5, [f(severity="critical", for_steps=0)])
    assert kinds(events) == ["fired"]
    assert events[0].alert.severity == "critical" and events[0].alert.first_step == 0


def test_deduplicated_by_run_rule_layer_site():
    t = AlertTracker()
    same_step = [f(severity="warning"), f(severity="critical"), f(severity="info")]
    events = t.update("r", 0, same_step)
    assert kinds(events) == ["fired"] and events[0].alert.severity == "critical"
    others = [f(), f(layer="blocks.1.mlp.fc1"), f(site="weight"), f(rule="underflow_rise"),
              f(layer=None, site=None, rule="loss_spike")]
    events = t.update("r", 1, others)
    assert len(events) == 4 and set(kinds(events)) == {"fired"}
    assert len(t.active("r")) == 5
    assert kinds(t.update("other-run", 1, [f()])) == ["fired"]  # another run: its own alert
    assert len({a.fingerprint for a in t.active("r") + t.active("other-run")}) == 6


def test_runs_are_independent_for_resolution():
    t = AlertTracker()
    t.update("a", 0, [f()])
    t.update("b", 0, [f()])
    t.update("b", 1000, [f()])  # run b's steps do not age run a's alert
    assert len(t.active("a")) == 1
    assert kinds(t.update("a", 60, [])) == ["resolved"]
    assert len(t.active("b")) == 1


def test_late_steps_never_resolve_or_drop():
    t = AlertTracker()
    t.update("r", 100, [f()])
    t.update("r", 101, [f(rule="loss_spike", for_steps=10)])
    assert t.update("r", 40, []) == []  # a late batch of old steps
    assert {a.rule for a in t.active("r")} == {"kurtosis_growth", "loss_spike"}


def test_firing_counts_restore_and_forget():
    t = AlertTracker()
    t.update("r", 0, [f(severity="critical"), f(rule="x", severity="warning", for_steps=50),
                      f(rule="y", severity="warning")])
    assert t.firing_counts("r") == {"info": 0, "warning": 1, "critical": 1}
    fresh = AlertTracker()
    fresh.restore(t.active("r"))
    # the restored alerts continue: no duplicate 'fired', and the pending one fires on time
    events = fresh.update("r", 50, [f(severity="critical"), f(rule="x", severity="warning", for_steps=50),
                                    f(rule="y", severity="warning")])
    assert kinds(events) == ["fired"] and events[0].alert.rule == "x" and events[0].alert.first_step == 0
    fresh.forget("r")
    assert fresh.active("r") == [] and fresh.firing_counts("r")["critical"] == 0


def test_events_carry_copies():
    t = AlertTracker()
    (event,) = t.update("r", 0, [f()])
    event.alert.severity = "info"
    assert t.active("r")[0].severity == "warning"


def test_fingerprint_is_stable_and_distinguishes_fields():
    a = fingerprint("run", "rule", "layer", "site")
    assert a == fingerprint("run", "rule", "layer", "site") and len(a) == 32
    assert len({a, fingerprint("run", "rule", "layer", None), fingerprint("run", "rule", None, "site"),
                fingerprint("run2", "rule", "layer", "site"), fingerprint("run", "rule", "layers", "ite")}) == 5


def test_every_rise_after_firing_is_kept_with_its_step():
    t = AlertTracker()
    (fired,) = t.update("r", 80, [f(severity="info")])
    assert fired.alert.escalations == []
    t.update("r", 300, [f(severity="warning")])
    (event,) = t.update("r", 450, [f(severity="critical")])
    assert event.alert.escalations == [{"step": 300, "severity": "warning", "from": "info"},
                                       {"step": 450, "severity": "critical", "from": "warning"}]
    assert (event.alert.fired_step, event.alert.escalated_step) == (80, 450)
    fresh = AlertTracker()  # restored (after a restart) it keeps its history and adds to it
    fresh.restore(t.active("r"))
    assert fresh.active("r")[0].escalations == event.alert.escalations


def test_a_finished_run_resolves_its_firing_alerts_and_drops_its_pending_ones():
    t = AlertTracker()
    t.update("r", 10, [f(rule="nonfinite", severity="critical", layer=None, site=None)])
    t.update("r", 20, [f(rule="nonfinite", severity="critical", layer=None, site=None), f(for_steps=50)])
    t.update("other", 20, [f()])
    events = {e.alert.rule: e for e in t.end_run("r", 25)}
    assert (events["nonfinite"].kind, events["nonfinite"].alert.resolved_step) == ("resolved", 25)
    assert events["kurtosis_growth"].kind == "dropped"  # pending: it never fired
    assert t.active("r") == [] and len(t.active("other")) == 1 and t.end_run("r") == []
    # a resumed run opens a new alert for the same condition
    assert kinds(t.update("r", 30, [f(rule="nonfinite", severity="critical", layer=None, site=None)])) == ["fired"]


def test_severity_is_validated_by_the_contract():
    with pytest.raises(ValueError, match="severity"):
        f(severity="fatal")


# -- REST: the application in process on both databases --------------------------------------------------------

import time  # noqa: E402

from tests.integration.streams import (  # noqa: E402
    FAKE_PREDICTOR,
    LAYER_PREDICTOR,
    kurtosis_stream,
    layer_stream,
)


def wait_json(client, url, predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(url).json()
        if predicate(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: condition not met in {timeout}s: {body}")
        time.sleep(0.05)


def test_alert_and_prediction_api(app_factory):
    read = {"Authorization": "Bearer r"}
    write = {"Authorization": "Bearer w"}
    with app_factory(write_tokens=["w"], read_tokens=["r"], predictor=FAKE_PREDICTOR) as c:
        c.headers.update(read)
        # run a/b: kurtosis warning from step 10 (fires at 15), then a NaN loss at step 30 (critical at once)
        for body in kurtosis_stream("a/b", range(0, 40), lambda s: 30.0 if s >= 10 else 3.0,
                                    loss=lambda s: float("nan") if s == 30 else 2.0):
            assert c.post("/api/v1/ingest", content=httpx_json(body), headers={**write, "content-type":
                                                                                 "application/json"}).status_code == 200
        for body in kurtosis_stream("quiet", range(0, 40), lambda s: 3.0):
            assert c.post("/api/v1/ingest", json=body, headers=write).status_code == 200
        alerts = wait_json(c, "/api/v1/runs/a/b/alerts", lambda b: b["total"] == 2 and any(
            a["last_step"] == 39 for a in b["alerts"]))["alerts"]
        by_rule = {a["rule"]: a for a in alerts}
        k = by_rule["kurtosis_growth"]
        assert (k["state"], k["severity"], k["layer"], k["site"]) == ("firing", "warning", "blocks.1.mlp.fc1", "input")
        assert (k["first_step"], k["fired_step"], k["escalated_step"], k["resolved_step"]) == (10, 15, None, None)
        assert k["run"] == "a/b" and k["acknowledged_at"] is None and "kurtosis 30.0" in k["message"]
        n = by_rule["nonfinite"]
        assert (n["state"], n["severity"], n["fired_step"], n["layer"]) == ("firing", "critical", 30, None)
        assert n["escalated_step"] is None
        assert n["last_step"] == 30  # held at step 30 only; it resolves 50 steps later

        assert wait_json(c, "/api/v1/runs/quiet/alerts", lambda b: True)["total"] == 0
        listed = c.get("/api/v1/alerts", params={"state": "firing", "severity": "critical"}).json()
        assert [a["id"] for a in listed["alerts"]] == [n["id"]]
        both = c.get("/api/v1/alerts", params=[("severity", "warning"), ("severity", "critical")]).json()
        assert both["total"] == 2
        page = c.get("/api/v1/alerts", params={"limit": 1, "offset": 1}).json()
        assert page["total"] == 2 and len(page["alerts"]) == 1 and page["alerts"][0]["id"] in {k["id"], n["id"]}
        assert c.get("/api/v1/alerts", params={"run": "quiet"}).json()["total"] == 0
        assert c.get("/api/v1/alerts", params={"state": "resolved"}).json()["alerts"] == []

        bad = c.get("/api/v1/alerts", params={"state": "burning"})
        assert bad.status_code == 422 and "state" in bad.text
        assert c.get("/api/v1/alerts", params={"limit": 0}).status_code == 422
        missing = c.get("/api/v1/runs/nope/alerts")
        assert missing.status_code == 404 and "nope" in missing.json()["detail"]
        assert c.get("/api/v1/alerts", params={"run": "nope"}).status_code == 404

        # acknowledge: write scope; idempotent; the alert keeps firing
        assert c.post(f"/api/v1/alerts/{n['id']}/ack").status_code == 403
        acked = c.post(f"/api/v1/alerts/{n['id']}/ack", headers=write).json()
        assert acked["acknowledged_at"] is not None and acked["newly_acknowledged"] is True
        again = c.post(f"/api/v1/alerts/{n['id']}/ack", headers=write).json()
        assert again["acknowledged_at"] == acked["acknowledged_at"] and again["newly_acknowledged"] is False
        assert again["state"] == "firing"
        assert c.post("/api/v1/alerts/999999/ack", headers=write).status_code == 404
        assert c.post("/api/v1/alerts/abc/ack", headers=write).status_code == 422

        # predictions
        latest = wait_json(c, "/api/v1/runs/a/b/predictions/latest", lambda b: b.get("step") == 39)
        assert latest["risk"] == 0.6 and latest["culprits"][0]["layer"] == "blocks.1.mlp.fc1"
        preds = c.get("/api/v1/runs/a/b/predictions").json()["predictions"]
        steps = [p["step"] for p in preds]
        assert steps == sorted(steps) and steps[-1] == 39 and {0, 10, 20, 30} <= set(steps)
        assert next(p for p in preds if p["step"] == 30)["risk"] == 1.0  # the NaN loss
        window = c.get("/api/v1/runs/a/b/predictions", params={"from_step": 10, "to_step": 20}).json()
        assert [p["step"] for p in window["predictions"]] == [s for s in steps if 10 <= s <= 20]
        assert [p["step"] for p in c.get("/api/v1/runs/a/b/predictions", params={"limit": 2}).json()[
            "predictions"]] == steps[-2:]
        inverted = c.get("/api/v1/runs/a/b/predictions", params={"from_step": 20, "to_step": 10})
        assert inverted.status_code == 422 and "from_step" in inverted.text
        assert c.get("/api/v1/runs/a/b/predictions", params={"from_step": -1}).status_code == 422
        assert c.get("/api/v1/runs/nope/predictions/latest").status_code == 404
        assert c.get("/api/v1/runs/a/b/predictions", headers={"Authorization": "Bearer nope"}).status_code == 403

        # the other routes of a run still work beside these (route order)
        assert c.get("/api/v1/runs/a/b/latest").json()["run"] == "a/b"
        assert c.get("/api/v1/runs/a/b").json()["name"] == "a/b"

        # deleting the run removes its alerts and predictions
        assert c.delete("/api/v1/runs/a/b", headers=write).status_code == 200
        assert c.get("/api/v1/alerts").json()["total"] == 0


def test_escalated_step_is_listed_and_survives_a_restart(app_factory):
    # kurtosis 30 (warning) from step 10, fires at 15; 80 (critical) from step 25: an escalation at 25
    def kurtosis(step):
        return 80.0 if step >= 25 else 30.0 if step >= 10 else 3.0

    url = "/api/v1/runs/esc/alerts"

    def only_alert_at(last_step):
        return lambda b: b["total"] == 1 and b["alerts"][0]["last_step"] == last_step

    with app_factory(predictor=FAKE_PREDICTOR) as c:
        for body in kurtosis_stream("esc", range(0, 40), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        (a,) = wait_json(c, url, only_alert_at(39))["alerts"]
    assert (a["rule"], a["state"], a["severity"]) == ("kurtosis_growth", "firing", "critical")
    assert (a["first_step"], a["fired_step"], a["escalated_step"]) == (10, 15, 25)

    # a restarted server (a new application, its lifespan over) reads the alert back from the database and
    # keeps its escalated_step
    with app_factory(predictor=FAKE_PREDICTOR) as c:
        for body in kurtosis_stream("esc", range(40, 60), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        (a,) = wait_json(c, url, only_alert_at(59))["alerts"]
    assert (a["state"], a["fired_step"], a["escalated_step"]) == ("firing", 15, 25)


def test_the_escalation_history_is_stored_listed_and_survives_a_restart(app_factory):
    # blocks.0.attn.qkv/input: kurtosis 15 (info) from step 0, fires at 5; 30 (warning) from 20; 80 (critical)
    # from 40: two rises, at 20 and 40
    def kurtosis(step, layer, site):
        if (layer, site) != ("blocks.0.attn.qkv", "input"):
            return 3.0
        return 80.0 if step >= 40 else 30.0 if step >= 20 else 15.0

    url = "/api/v1/runs/hist/alerts"
    with app_factory(predictor=LAYER_PREDICTOR) as c:
        for body in layer_stream("hist", range(0, 30), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        wait_json(c, url, lambda b: b["total"] == 1 and b["alerts"][0]["last_step"] == 29)
    with app_factory(predictor=LAYER_PREDICTOR) as c:  # restarted in the middle of the history
        for body in layer_stream("hist", range(30, 50), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        (a,) = wait_json(c, url, lambda b: b["total"] == 1 and b["alerts"][0]["last_step"] == 49)["alerts"]
    assert (a["severity"], a["first_step"], a["fired_step"], a["escalated_step"]) == ("critical", 0, 5, 40)
    assert a["escalations"] == [{"step": 20, "severity": "warning", "from": "info"},
                                {"step": 40, "severity": "critical", "from": "warning"}]


def test_alerts_of_a_finished_run_resolve(app_factory):
    def kurtosis(step):
        return 80.0 if step >= 10 else 3.0

    with app_factory(predictor=FAKE_PREDICTOR) as c:
        # run "done": its last batch says finished, while its alert still fires
        bodies = list(kurtosis_stream("done", range(0, 40), kurtosis))
        bodies[-1]["run_meta"] = {"status": "finished"}
        # run "patched": finished through PATCH /runs/{run}
        for body in [*bodies, *kurtosis_stream("patched", range(0, 40), kurtosis)]:
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        (done,) = wait_json(c, "/api/v1/runs/done/alerts", lambda b: b["total"] == 1 and
                            b["alerts"][0]["state"] == "resolved")["alerts"]
        assert (done["fired_step"], done["resolved_step"]) == (15, 39) and done["resolved_at"] is not None
        wait_json(c, "/api/v1/runs/patched/alerts", lambda b: b["total"] == 1 and b["alerts"][0]["state"] == "firing"
                  and b["alerts"][0]["last_step"] == 39)
        assert c.patch("/api/v1/runs/patched", json={"status": "failed"}).status_code == 200
        (patched,) = wait_json(c, "/api/v1/runs/patched/alerts", lambda b: b["alerts"][0]["state"] == "resolved")[
            "alerts"]
        assert patched["resolved_step"] == 39
        assert c.get("/api/v1/alerts", params={"state": "firing"}).json()["total"] == 0
        # a run that goes on after all is assessed again: the condition opens a new alert
        for body in kurtosis_stream("patched", range(40, 60), kurtosis):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        again = wait_json(c, "/api/v1/runs/patched/alerts", lambda b: b["total"] == 2)["alerts"]
        assert sorted((a["state"], a["fired_step"]) for a in again) == [("firing", 45), ("resolved", 15)]


def test_a_run_finished_after_a_restart_resolves_the_alerts_read_back(app_factory):
    with app_factory(predictor=FAKE_PREDICTOR) as c:
        for body in kurtosis_stream("later", range(0, 40), lambda s: 80.0 if s >= 10 else 3.0):
            assert c.post("/api/v1/ingest", json=body).status_code == 200
        wait_json(c, "/api/v1/runs/later/alerts", lambda b: b["total"] == 1 and b["alerts"][0]["last_step"] == 39)
    with app_factory(predictor=FAKE_PREDICTOR) as c:  # restarted: the alert lives in the database only
        assert c.patch("/api/v1/runs/later", json={"status": "diverged"}).status_code == 200
        (a,) = wait_json(c, "/api/v1/runs/later/alerts", lambda b: b["alerts"][0]["state"] == "resolved")["alerts"]
    assert (a["fired_step"], a["resolved_step"]) == (15, 39)


def httpx_json(body) -> bytes:
    """JSON with a NaN literal, as Python's json module and the agent's encoder write it."""
    import json

    return json.dumps(body).encode()
