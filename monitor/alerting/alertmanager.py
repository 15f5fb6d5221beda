"""fp8mon's alerts to Prometheus Alertmanager (v2 API, `POST /api/v2/alerts`), from a sender thread of its own.

Alertmanager then does the grouping, inhibition, silences and the receivers (Slack, email, PagerDuty); see
dashboards/alertmanager.yml for the route docker-compose ships.

Each firing alert is posted with the labels `alertname` (the rule), `run`, `rule`, `severity`, and `layer` and
`site` when it has them, and annotations `summary`, `description` and `dashboard` (the run's page). Alertmanager
identifies an alert by its labels, so an escalation posts the old severity's alert resolved beside the new one.
Every firing alert is re-posted every `resend_seconds` with `endsAt` four re-sends ahead: Alertmanager keeps it
while fp8mon lives and lets it expire if fp8mon dies. A resolved alert is posted once with `endsAt` = now.

`notify(event)` only queues (bounded; a full queue drops the event and counts a failure). A failed post
(Alertmanager down, an error answer) is counted in `fp8mon_alertmanager_failures_total`, logged once per outage,
and retried: firing alerts with the next re-send, resolutions until they are delivered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx

from fp8mon.monitor.alerting.lifecycle import ESCALATED, FIRED, RESOLVED, Alert, AlertEvent
from fp8mon.monitor.alerting.webhooks import run_link

log = logging.getLogger("fp8mon.alertmanager")

RETRY_SECONDS = 5.0  # after a failed post, the next try comes at most this late
MAX_UNSENT_RESOLUTIONS = 10_000


def alertmanager_alert(alert: Alert, base_url: str, starts_at: datetime, ends_at: datetime) -> dict:
    """One alert in Alertmanager's v2 format."""
    labels = {"alertname": alert.rule, "run": alert.run, "rule": alert.rule, "severity": alert.severity}
    if alert.layer:
        labels["layer"] = alert.layer
    if alert.site:
        labels["site"] = alert.site
    where = " / ".join(p for p in (alert.layer, alert.site) if p) or "run-level"
    link = run_link(base_url, alert.run)
    history = f"fired at step {alert.fired_step}"
    if alert.escalations:
        history += "; " + ", ".join(f"{e['severity']} at step {e['step']}" for e in alert.escalations)
    return {
        "labels": labels,
        "annotations": {"summary": f"{alert.severity} {alert.rule} on run {alert.run} ({where})",
                        "description": f"{alert.message} ({history})", "dashboard": link},
        "startsAt": starts_at.isoformat(), "endsAt": ends_at.isoformat(), "generatorURL": link,
    }


@dataclass(frozen=True)
class _Forget:
    run: str


class AlertmanagerSender:
    def __init__(self, url: str, *, base_url: str = "", resend_seconds: float = 60.0, timeout: float = 5.0,
                 queue_size: int = 1000, metrics=None):
        """`url`: Alertmanager's base address (http://alertmanager:9093); empty: send nothing."""
        self.url = url.rstrip("/")
        self.base_url = base_url
        self.resend_seconds = resend_seconds
        self.timeout = timeout
        self.metrics = metrics
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._firing: dict[str, tuple[Alert, datetime]] = {}  # fingerprint -> (alert, when it started)
        self._resolved: list[tuple[Alert, datetime]] = []  # resolutions not yet delivered
        self._down = False  # in an outage (logged once)
        self._full = False  # the queue is full (logged once)
        self._thread: threading.Thread | None = None

    def start(self) -> AlertmanagerSender:
        if self.url and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fp8mon-alertmanager", daemon=True)
            self._thread.start()
        return self

    def restore(self, alerts: list[Alert]) -> None:
        """Firing alerts read back at start: Alertmanager hears of them again (call before start)."""
        now = datetime.now(UTC)
        for alert in alerts:
            self._firing[alert.fingerprint] = (alert, now)

    def notify(self, event: AlertEvent) -> None:
        if not self.url or event.kind not in (FIRED, ESCALATED, RESOLVED):
            return
        try:
            self._queue.put_nowait(event)
            self._full = False
        except queue.Full:
            self._count_failure()
            if not self._full:
                log.warning("Alertmanager queue full: alert events dropped until it drains (counted in "
                            "fp8mon_alertmanager_failures_total); firing alerts are still re-sent")
            self._full = True

    def forget_run(self, run: str) -> None:
        """The run was deleted: its firing alerts are posted resolved and no longer re-sent."""
        if self.url:
            try:
                self._queue.put_nowait(_Forget(run))
            except queue.Full:
                self._count_failure()

    def stop(self, timeout: float = 5.0) -> None:
        """Post what is queued (one try), then stop."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        next_resend = time.monotonic()
        with httpx.Client(timeout=self.timeout, headers={"User-Agent": "fp8mon-alertmanager"}) as client:
            stopping = False
            while not stopping:
                items = []
                try:
                    items.append(self._queue.get(timeout=max(0.0, next_resend - time.monotonic())))
                    while True:  # everything queued goes in one post
                        items.append(self._queue.get_nowait())
                except queue.Empty:
                    pass
                stopping = None in items
                changed = {self._take(e) for e in items if e is not None}
                resend = time.monotonic() >= next_resend
                if changed or resend or self._resolved:
                    ok = self._post(client, None if resend else changed)
                    if resend or not ok:
                        next_resend = time.monotonic() + (self.resend_seconds if ok else
                                                          min(self.resend_seconds, RETRY_SECONDS))
                for _ in items:
                    self._queue.task_done()

    def _take(self, event: AlertEvent | _Forget) -> str:
        if isinstance(event, _Forget):
            for fingerprint, (alert, start) in list(self._firing.items()):
                if alert.run == event.run:
                    del self._firing[fingerprint]
                    self._resolved.append((alert, start))
            return event.run
        a, now = event.alert, datetime.now(UTC)
        old = self._firing.pop(a.fingerprint, None)
        if old is not None and (event.kind == RESOLVED or old[0].severity != a.severity):
            self._resolved.append(old)  # Alertmanager knows it by its labels, severity included
        elif old is None and event.kind == RESOLVED:
            self._resolved.append((a, now))  # fired before this sender knew it
        if event.kind != RESOLVED:
            self._firing[a.fingerprint] = (a, old[1] if old is not None else now)
        del self._resolved[:-MAX_UNSENT_RESOLUTIONS]
        return a.fingerprint

    def _post(self, client: httpx.Client, changed: set[str] | None) -> bool:
        """Post the resolutions and the firing alerts that changed (`changed`: fingerprints and run names; None:
        every firing alert, the re-send)."""
        now = datetime.now(UTC)
        ends = now + timedelta(seconds=4 * max(self.resend_seconds, 1.0))
        body = [alertmanager_alert(a, self.base_url, start, now) for a, start in self._resolved]
        body += [alertmanager_alert(a, self.base_url, start, ends) for fingerprint, (a, start) in self._firing.items()
                 if changed is None or fingerprint in changed]
        if not body:
            return True
        try:
            response = client.post(f"{self.url}/api/v2/alerts", json=body)
            problem = None if response.status_code < 300 else f"HTTP {response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            self._resolved.clear()
            if self._down:
                log.info("Alertmanager at %s reachable again: %d alerts posted", self.url, len(body))
            self._down = False
            if self.metrics is not None:
                self.metrics.alertmanager_posts.inc()
            return True
        self._count_failure()
        if not self._down:
            log.warning("cannot post alerts to Alertmanager at %s (%s); retrying, not logged again until it "
                        "answers", self.url, problem)
        self._down = True
        return False

    def _count_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.alertmanager_failures.inc()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event was taken (tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return False
