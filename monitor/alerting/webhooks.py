"""Alert notifications to webhooks (Slack-compatible JSON), from a sender thread of their own.

`WebhookSender.notify(event)` (the pipeline's notifier) queues the event; the thread groups events per run and
rule with a severity floor and a rate limit (monitor.alerting.grouping) and sends one message per group
(`group_payload`). `send(payload)` queues a ready message. Neither blocks: they queue (bounded; a full queue
drops the notification and counts it). The thread POSTs each notification to every URL in turn, retrying connection errors, timeouts,
429 and 5xx answers with exponential backoff (`backoff * 2**attempt`, capped, a Retry-After header
honoured up to the cap) for at most `max_attempts` attempts; any other 4xx is not retried.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from urllib.parse import quote

import httpx

from fp8mon.monitor.alerting.grouping import GroupNotice, NotificationGroups
from fp8mon.monitor.alerting.lifecycle import AlertEvent

log = logging.getLogger("fp8mon.webhooks")

_COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
_EMOJI = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}
_VERBS = {"fired": "FIRING", "escalated": "ESCALATED", "resolved": "RESOLVED"}
_DUE = object()  # the sender thread woke because a group's notification is due
LISTED_ALERTS = 10  # a group message names this many of its alerts, then counts the rest


def run_link(base_url: str, run: str) -> str:
    """The dashboard's view of a run."""
    return f"{base_url}/?run={quote(run, safe='')}"


def _where(alert) -> str:
    return " / ".join(p for p in (alert.layer, alert.site) if p) or "run-level"


def _alert_fields(event: AlertEvent) -> dict:
    a = event.alert
    return {"event": event.kind, "layer": a.layer, "site": a.site, "severity": a.severity, "step": event.step,
            "first_step": a.first_step, "fired_step": a.fired_step, "escalated_step": a.escalated_step,
            "escalations": list(a.escalations), "resolved_step": a.resolved_step, "message": a.message,
            "value": a.value, "fingerprint": a.fingerprint}


def group_payload(notice: GroupNotice, base_url: str) -> dict:
    """One Slack message for a run and rule: how many of its alerts fire, and what changed since the last one.
    The alerts come as plain fields under `fp8mon` for receivers that are not Slack."""
    status, severity = notice.status, notice.severity
    verb = _VERBS[status]
    link = run_link(base_url, notice.run)
    counts = {}
    for e in notice.changes:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    changed = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    step = max(e.step for e in notice.changes)
    if notice.firing:
        where = ", ".join(_where(a) for a in notice.firing[:LISTED_ALERTS])
        if len(notice.firing) > LISTED_ALERTS:
            where += f" and {len(notice.firing) - LISTED_ALERTS} more"
        summary = f"{len(notice.firing)} firing ({where})"
    else:
        summary = "all resolved"
    text = (f"[{verb}] {severity.upper()} {notice.rule} on run {notice.run} at step {step}: {summary}; "
            f"{changed} since the last message")
    lines = [f"{e.kind} {e.alert.severity} at step {e.step}, {_where(e.alert)}: {e.alert.message}"
             + (f" (was {e.previous_severity}; fired at step {e.alert.fired_step})" if e.kind == "escalated" else "")
             for e in notice.changes[:LISTED_ALERTS]]
    if len(notice.changes) > LISTED_ALERTS:
        lines.append(f"... and {len(notice.changes) - LISTED_ALERTS} more")
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{_EMOJI.get(severity, '')} *{verb}* "
                                                                   f"`{notice.rule}` on *{notice.run}*"}},
            {"type": "section", "text": {"type": "plain_text", "text": "\n".join(lines)}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|Open run in fp8mon>"}]},
        ],
        "attachments": [{"color": "#2ca02c" if status == "resolved" else _COLOURS.get(severity, "#7f7f7f"),
                         "fallback": text, "title": f"{notice.run}: {notice.rule}", "title_link": link}],
        "fp8mon": {"event": status, "run": notice.run, "rule": notice.rule, "severity": severity, "step": step,
                   "firing": len(notice.firing), "url": link, "alerts": [_alert_fields(e) for e in notice.changes]},
    }


class WebhookSender:
    def __init__(self, urls: list[str], *, base_url: str = "", max_attempts: int = 6, backoff: float = 0.5,
                 max_backoff: float = 30.0, timeout: float = 5.0, queue_size: int = 1000, metrics=None,
                 min_severity: str = "warning", group_wait: float = 10.0, group_interval: float = 300.0):
        """`base_url`: this server's address in the messages' links; `min_severity`, `group_wait`,
        `group_interval`: the grouping of monitor.alerting.grouping."""
        self.groups = NotificationGroups(min_severity, group_wait, group_interval)
        self.urls = list(urls)
        self.base_url = base_url
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self.metrics = metrics
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._abort = threading.Event()  # set when stop() stops waiting: give up on retries
        self._thread: threading.Thread | None = None

    def start(self) -> WebhookSender:
        if self.urls and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fp8mon-webhooks", daemon=True)
            self._thread.start()
        return self

    def notify(self, event: AlertEvent) -> None:
        if not self.urls:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            log.warning("webhook queue full: %s of %s on run %r dropped", event.kind, event.alert.rule,
                        event.alert.run)
            self._count(failed=len(self.urls))

    def send(self, payload: dict) -> bool:
        if not self.urls:
            return False
        try:
            self._queue.put_nowait(payload)
            return True
        except queue.Full:
            log.warning("webhook queue full: notification dropped: %s", payload.get("text"))
            self._count(failed=len(self.urls))
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is queued for up to `timeout` seconds, then give up on the rest."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._abort.set()
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout, headers={"User-Agent": "fp8mon-webhooks"}) as client:
            while True:
                due = self.groups.next_due()
                try:
                    item = self._queue.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
                except queue.Empty:
                    item = _DUE
                try:
                    if isinstance(item, AlertEvent):
                        if not self.groups.add(item, time.monotonic()) and self.metrics is not None:
                            self.metrics.webhook_suppressed.inc()
                    elif isinstance(item, dict):
                        self._deliver_all(client, item)
                    for notice in self.groups.due(time.monotonic(), everything=item is None):
                        if self.metrics is not None:
                            self.metrics.webhook_suppressed.inc(len(notice.changes) - 1)
                        self._deliver_all(client, group_payload(notice, self.base_url))
                    if item is None:
                        return
                finally:
                    if item is not _DUE:
                        self._queue.task_done()

    def _deliver_all(self, client: httpx.Client, payload: dict) -> None:
        for url in self.urls:
            self._count(ok=self._deliver(client, url, payload))

    def _deliver(self, client: httpx.Client, url: str, payload: dict) -> bool:
        for attempt in range(self.max_attempts):
            retry_after = None
            try:
                response = client.post(url, json=payload)
                if response.status_code < 300:
                    return True
                if response.status_code != 429 and response.status_code < 500:
                    log.warning("webhook %s refused the notification: HTTP %s %s", url, response.status_code,
                                response.text[:200])
                    return False
                retry_after = _seconds(response.headers.get("retry-after"))
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt + 1 == self.max_attempts:
                break
            delay = min(self.max_backoff, retry_after if retry_after is not None else self.backoff * 2 ** attempt)
            log.info("webhook %s failed (%s); retry %d in %.1f s", url, problem, attempt + 1, delay)
            if self._abort.wait(delay):
                break
        log.warning("webhook %s: notification given up after %d attempts: %s", url, attempt + 1,
                    payload.get("text"))
        return False

    def _count(self, ok: bool | None = None, failed: int = 0) -> None:
        if self.metrics is None:
            return
        if ok is True:
            self.metrics.webhook_deliveries.inc()
        elif ok is False:
            self.metrics.webhook_failures.inc()
        if failed:
            self.metrics.webhook_failures.inc(failed)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued notification was handled (tests, shutdown); alert events then wait in their
        group until it is due."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return False


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
