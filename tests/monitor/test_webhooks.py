"""Webhooks: Slack-compatible notifications, retried with backoff from their own thread, against a real local
HTTP receiver; end to end from ingest through the application."""

import time

import pytest

from fp8mon.monitor.alerting.lifecycle import AlertTracker
from fp8mon.monitor.alerting.webhooks import WebhookSender, slack_payload
from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.localserver import free_port
from fp8mon.monitor.metrics import Metrics
from tests.integration.receiver import Receiver
from tests.integration.streams import FAKE_PREDICTOR, kurtosis_stream


def fired_event(run="exp/llama-fp8", severity="critical"):
    (event,) = AlertTracker().update(run, 120, [Finding(
        rule="kurtosis_growth", severity=severity, step=120, layer="blocks.3.mlp.fc2", site="input", value=61.5,
        message="kurtosis 61.5 at blocks.3.mlp.fc2/input")])
    return event


def test_slack_payload_names_run_severity_rule_where_step_and_links_the_run():
    p = slack_payload(fired_event(), "http://mon:8080")
    assert p["text"].startswith("[FIRING] CRITICAL kurtosis_growth on run exp/llama-fp8 (blocks.3.mlp.fc2 / input) "
                                "at step 120")
    fields = " ".join(f["text"] for f in p["blocks"][1]["fields"])
    for part in ("exp/llama-fp8", "critical", "kurtosis_growth", "blocks.3.mlp.fc2 / input", "120"):
        assert part in fields
    assert "http://mon:8080/?run=exp%2Fllama-fp8" in fields
    assert p["attachments"][0]["color"] == "#d62728"
    assert p["fp8mon"]["event"] == "fired" and p["fp8mon"]["layer"] == "blocks.3.mlp.fc2"


def test_escalation_payload_carries_the_escalated_step_beside_the_fired_step():
    t = AlertTracker()

    def finding(severity):
        return Finding(rule="stale_scale", severity=severity, step=0, layer="blocks.0.mlp.fc2", site="grad_output",
                       message=f"stale scale ({severity})")

    (fired,) = t.update("exp/run", 80, [finding("info")])
    assert slack_payload(fired, "http://mon")["fp8mon"]["escalated_step"] is None
    (escalated,) = t.update("exp/run", 300, [finding("warning")])
    p = slack_payload(escalated, "http://mon")
    assert p["fp8mon"]["event"] == "escalated" and p["fp8mon"]["severity"] == "warning"
    assert (p["fp8mon"]["fired_step"], p["fp8mon"]["escalated_step"], p["fp8mon"]["step"]) == (80, 300, 300)
    assert p["text"].startswith("[ESCALATED] WARNING stale_scale on run exp/run")
    assert "escalated to warning at step 300, was info; fired at step 80" in p["text"]


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


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_server_sends_fired_and_resolved_without_slowing_ingest(app_factory):
    # The receiver fails twice, then answers slowly: ingest must not notice.
    with Receiver(fail_first=2, delay=0.5) as rx:
        run = "team/diverging"

        def kurtosis(step):
            return 80.0 if 20 <= step < 40 else 3.0

        # webhook_urls as the environment gives them: comma-separated
        with app_factory(webhook_urls=f"{rx.url}, {rx.url}?second", webhook_backoff_seconds=0.1,
                         public_url="http://fp8mon.example:8080", predictor=FAKE_PREDICTOR) as client:
            latencies = []
            for body in kurtosis_stream(run, range(0, 120), kurtosis):
                t0 = time.monotonic()
                assert client.post("/api/v1/ingest", json=body).status_code == 200
                latencies.append(time.monotonic() - t0)
            fired = rx.wait_for(lambda p: p["fp8mon"]["event"] == "fired")
            resolved = rx.wait_for(lambda p: p["fp8mon"]["event"] == "resolved")
        assert max(latencies) < 0.5, latencies  # the receiver takes 0.5 s per call; ingest never waits for it
        f = fired[0]
        assert f["fp8mon"]["run"] == run and f["fp8mon"]["rule"] == "kurtosis_growth"
        assert f["fp8mon"]["severity"] == "critical" and f["fp8mon"]["layer"] == "blocks.1.mlp.fc1"
        assert f["fp8mon"]["step"] == 25  # appeared at 20, held for_steps=5
        assert "http://fp8mon.example:8080/?run=team%2Fdiverging" in str(f["blocks"])
        assert resolved[0]["fp8mon"]["step"] == 39 + 50 and resolved[0]["text"].startswith("[RESOLVED]")
        # both URLs got each notification, exactly once despite the retries
        deadline = time.monotonic() + 10
        while len(rx.received) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p["fp8mon"]["event"] for p in rx.received) == ["fired", "fired", "resolved", "resolved"]
