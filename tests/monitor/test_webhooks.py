"""Webhooks: Slack-compatible notifications, retried with backoff from their own thread, against a real local
HTTP receiver; end to end from ingest through the application."""

import time

import pytest

from fp8mon.monitor.alerting.grouping import GroupNotice, NotificationGroups
from fp8mon.monitor.alerting.lifecycle import AlertTracker
from fp8mon.monitor.alerting.webhooks import WebhookSender, group_payload
from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.localserver import free_port
from fp8mon.monitor.metrics import Metrics
from tests.integration.receiver import Receiver
from tests.integration.streams import FAKE_PREDICTOR, LAYER_PREDICTOR, kurtosis_stream, layer_stream


def fired_event(run="exp/llama-fp8", severity="critical"):
    (event,) = AlertTracker().update(run, 120, [Finding(
        rule="kurtosis_growth", severity=severity, step=120, layer="blocks.3.mlp.fc2", site="input", value=61.5,
        message="kurtosis 61.5 at blocks.3.mlp.fc2/input")])
    return event


def one(event):
    return GroupNotice(event.alert.run, event.alert.rule, [event], [] if event.kind == "resolved" else [event.alert])


def slack_payload(event, base_url):
    return group_payload(one(event), base_url)


def test_payload_names_run_severity_rule_where_step_and_links_the_run():
    p = slack_payload(fired_event(), "http://mon:8080")
    assert p["text"].startswith("[FIRING] CRITICAL kurtosis_growth on run exp/llama-fp8 at step 120: 1 firing "
                                "(blocks.3.mlp.fc2 / input)")
    assert "kurtosis 61.5 at blocks.3.mlp.fc2/input" in p["blocks"][1]["text"]["text"]
    assert "http://mon:8080/?run=exp%2Fllama-fp8" in p["blocks"][2]["elements"][0]["text"]
    assert p["attachments"][0]["color"] == "#d62728"
    assert p["fp8mon"]["event"] == "fired" and p["fp8mon"]["alerts"][0]["layer"] == "blocks.3.mlp.fc2"


def test_escalation_payload_carries_the_escalated_step_beside_the_fired_step():
    t = AlertTracker()

    def finding(severity):
        return Finding(rule="stale_scale", severity=severity, step=0, layer="blocks.0.mlp.fc2", site="grad_output",
                       message=f"stale scale ({severity})")

    (fired,) = t.update("exp/run", 80, [finding("info")])
    assert slack_payload(fired, "http://mon")["fp8mon"]["alerts"][0]["escalated_step"] is None
    (escalated,) = t.update("exp/run", 300, [finding("warning")])
    p = slack_payload(escalated, "http://mon")
    alert = p["fp8mon"]["alerts"][0]
    assert p["fp8mon"]["event"] == "escalated" and p["fp8mon"]["severity"] == "warning"
    assert (alert["fired_step"], alert["escalated_step"], alert["step"]) == (80, 300, 300)
    assert alert["escalations"] == [{"step": 300, "severity": "warning", "from": "info"}]
    assert p["text"].startswith("[ESCALATED] WARNING stale_scale on run exp/run")
    assert "(was info; fired at step 80)" in p["blocks"][1]["text"]["text"]


def test_retries_with_backoff_until_delivered():
    metrics = Metrics()
    with Receiver(fail_first=2) as rx:
        sender = WebhookSender([rx.url], backoff=0.1, metrics=metrics).start()
        t0 = time.monotonic()
        assert sender.send(slack_payload(fired_event(), "http://mon"))
        assert time.monotonic() - t0 < 0.05  # send only queues
        rx.wait_for(lambda p: p["fp8mon"]["event"] == "fired", timeout=10)
        sender.stop()
    assert [s for _, s in rx.attempts] == [503, 503, 200]
    gaps = [b[0] - a[0] for a, b in zip(rx.attempts, rx.attempts[1:])]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19  # 0.1 s, then doubled
    assert len(rx.received) == 1
    assert metrics.webhook_deliveries._value.get() == 1 and metrics.webhook_failures._value.get() == 0


def test_client_errors_are_not_retried_and_dead_endpoints_are_given_up():
    metrics = Metrics()
    dead = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    with Receiver(fail_first=100, fail_status=400) as rx:
        sender = WebhookSender([rx.url, dead], backoff=0.02, max_attempts=3, metrics=metrics).start()
        sender.send(slack_payload(fired_event(), "http://mon"))
        assert sender.drain(10)
        sender.stop()
    assert len(rx.attempts) == 1  # 400: the payload is wrong, retrying cannot help
    assert metrics.webhook_failures._value.get() == 2 and metrics.webhook_deliveries._value.get() == 0


@pytest.mark.sqlite_only
def test_server_sends_fired_and_resolved_without_slowing_ingest(app_factory):
    # The receiver fails twice, then answers slowly: ingest must not notice.
    with Receiver(fail_first=2, delay=0.5) as rx:
        run = "team/diverging"

        def kurtosis(step):
            return 80.0 if 20 <= step < 40 else 3.0

        # webhook_urls as the environment gives them: comma-separated
        with app_factory(webhook_urls=f"{rx.url}, {rx.url}?second", webhook_backoff_seconds=0.1,
                         webhook_group_wait_seconds=0, webhook_group_interval_seconds=0,
                         public_url="http://fp8mon.example:8080", predictor=FAKE_PREDICTOR) as client:
            latencies = []
            for body in kurtosis_stream(run, range(0, 120), kurtosis):
                t0 = time.monotonic()
                assert client.post("/api/v1/ingest", json=body).status_code == 200
                latencies.append(time.monotonic() - t0)
            fired = rx.wait_for(lambda p: p["fp8mon"]["event"] == "fired")
            resolved = rx.wait_for(lambda p: p["fp8mon"]["event"] == "resolved")
        assert max(latencies) < 0.5, latencies  # the receiver takes 0.5 s per call; ingest never waits for it
        f = fired[0]["fp8mon"]
        assert f["run"] == run and f["rule"] == "kurtosis_growth" and f["severity"] == "critical"
        (alert,) = f["alerts"]
        assert alert["layer"] == "blocks.1.mlp.fc1" and alert["event"] == "fired"
        assert alert["step"] == 25  # appeared at 20, held for_steps=5
        assert "http://fp8mon.example:8080/?run=team%2Fdiverging" in str(fired[0]["blocks"])
        assert resolved[0]["fp8mon"]["step"] == 39 + 50 and resolved[0]["text"].startswith("[RESOLVED]")
        # both URLs got each notification, exactly once despite the retries
        deadline = time.monotonic() + 10
        while len(rx.received) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p["fp8mon"]["event"] for p in rx.received) == ["fired", "fired", "resolved", "resolved"]


# -- grouping: one message per run and rule, a severity floor, a rate limit ----------------------------------


def event(kind_step_severity, layer="blocks.0.mlp.fc1", site="input", rule="kurtosis_growth", run="r"):
    """The event of a tracker fed one finding per given (step, severity); None severity: absent."""
    t = AlertTracker(resolve_after_steps=1)
    out = []
    for step, severity in kind_step_severity:
        findings = [] if severity is None else [Finding(rule=rule, severity=severity, step=step, layer=layer,
                                                        site=site, message=f"{rule} {severity}")]
        out += t.update(run, step, findings)
    return out


def test_groups_gather_layers_and_sites_of_a_run_and_rule_into_one_notice():
    g = NotificationGroups("warning", group_wait=10, group_interval=60)
    for layer in ("blocks.0.mlp.fc1", "blocks.1.mlp.fc1"):
        for site in ("input", "weight"):
            for e in event([(5, "warning"), (6, "critical")], layer=layer, site=site):
                assert g.add(e, now=0.0)
    assert g.add(event([(5, "critical")], rule="nonfinite", layer=None, site=None)[0], now=1.0)
    assert not g.add(event([(5, "info")], rule="underflow")[0], now=1.0)  # below the floor
    assert g.due(now=9.9) == [] and g.next_due() == 10.0
    (notice,) = g.due(now=10.0)
    assert (notice.run, notice.rule, notice.status, notice.severity) == ("r", "kurtosis_growth", "fired", "critical")
    assert len(notice.firing) == 4 and [e.kind for e in notice.changes] == ["fired"] * 4  # fired, then rose: new
    payload = group_payload(notice, "http://mon")
    assert payload["text"].startswith("[FIRING] CRITICAL kurtosis_growth on run r at step 6: 4 firing (")
    assert len(payload["fp8mon"]["alerts"]) == 4 and payload["fp8mon"]["firing"] == 4
    assert [n.rule for n in g.due(now=11.0)] == ["nonfinite"]


def test_a_group_notifies_at_most_once_per_interval_and_says_when_all_resolved():
    g = NotificationGroups("warning", group_wait=0, group_interval=60)
    a = event([(5, "warning"), (6, None)])
    b = event([(5, "warning"), (6, "critical"), (7, None)], layer="blocks.1.mlp.fc1")
    g.add(a[0], now=0.0)
    assert [n.status for n in g.due(now=0.0)] == ["fired"]
    g.add(b[0], now=1.0)
    g.add(b[1], now=2.0)
    assert g.due(now=59.0) == [] and g.next_due() == 60.0  # the rate limit holds back what changed
    (notice,) = g.due(now=60.0)
    assert (notice.status, [e.kind for e in notice.changes], len(notice.firing)) == ("fired", ["fired"], 2)
    g.add(a[1], now=61.0)
    g.add(b[2], now=62.0)
    (notice,) = g.due(now=120.0)
    assert (notice.status, notice.severity, notice.firing) == ("resolved", "critical", [])
    assert group_payload(notice, "http://mon")["text"].startswith("[RESOLVED] CRITICAL kurtosis_growth on run r")
    # an escalation of a known alert is an "escalated" message; the floor can be lowered
    g = NotificationGroups("info", group_wait=0, group_interval=0)
    info = event([(5, "info"), (6, "warning")])
    g.add(info[0], now=0.0)
    assert g.due(now=0.0)[0].severity == "info"
    g.add(info[1], now=1.0)
    assert g.due(now=1.0)[0].status == "escalated"


@pytest.mark.sqlite_only
def test_a_two_block_run_sends_a_handful_of_messages_not_one_per_layer_and_site(app_factory):
    """The issue's scenario: a 2-block run (4 layers x 3 sites) whose every layer and site raises a kurtosis
    warning (half of them escalating to critical) and an underflow info, then finishes. One message per run and
    rule with something at warning or above: the kurtosis alerts firing, then resolved (rate-limited)."""
    def kurtosis(step, layer, site):
        if step < 10 or step >= 60:
            return 3.0
        return 80.0 if step >= 30 and layer.startswith("blocks.1") else 30.0

    interval = 1.5
    with Receiver() as rx:
        with app_factory(webhook_urls=rx.url, webhook_group_wait_seconds=0.5,
                         webhook_group_interval_seconds=interval, predictor=LAYER_PREDICTOR) as client:
            bodies = list(layer_stream("two-blocks", range(0, 100), kurtosis, underflow=lambda *_: 0.2,
                                       status="finished"))
            for body in bodies[:6]:
                assert client.post("/api/v1/ingest", json=body).status_code == 200
            assert client.app.state.pipeline.flush(10)
            (firing,) = rx.wait_for(lambda p: True, timeout=10)
            for body in bodies[6:]:
                assert client.post("/api/v1/ingest", json=body).status_code == 200
            rx.wait_for(lambda p: p["fp8mon"]["event"] == "resolved", timeout=10)
            events = client.get("/metrics").text
        time.sleep(0.3)
    per_event = sum(float(line.split()[-1]) for line in events.splitlines()
                    if line.startswith("fp8mon_alert_events_total"))
    assert per_event >= 50  # what a message per event would have sent (12 + 6 + 12 kurtosis, 12 + 12 underflow)
    assert [p["fp8mon"]["event"] for p in rx.received] == ["fired", "resolved"]
    f = firing["fp8mon"]
    assert (f["rule"], f["severity"], f["firing"], len(f["alerts"])) == ("kurtosis_growth", "critical", 12, 12)
    assert "12 firing" in firing["text"] and "and 2 more" in firing["text"]
    gap = rx.attempts[1][0] - rx.attempts[0][0]
    assert gap >= interval - 0.1, gap  # the rate limit per group
    resolved = rx.received[1]["fp8mon"]
    assert resolved["firing"] == 0 and {a["event"] for a in resolved["alerts"]} == {"resolved"}


def test_settings_refuse_alert_urls_without_a_scheme():
    from pydantic import ValidationError

    from fp8mon.monitor.settings import Settings

    for field in ("alertmanager_url", "webhook_urls"):
        with pytest.raises(ValidationError, match="must start with http:// or https://"):
            Settings(**{field: "alertmanager:9093"})
    assert Settings(alertmanager_url="http://alertmanager:9093").webhook_min_severity == "warning"
