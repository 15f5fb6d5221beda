"""Alert notifications to webhooks (Slack-compatible JSON), from a sender thread of their own.

`WebhookSender.notify(event)` (the pipeline's notifier) builds the message, `send(payload)` queues it; neither
blocks: it queues (bounded; a full queue drops the notification and
counts it). The thread POSTs each notification to every URL in turn, retrying connection errors, timeouts,
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

from fp8mon.monitor.alerting.lifecycle import AlertEvent

log = logging.getLogger("fp8mon.webhooks")

_COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
_EMOJI = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}
_VERBS = {"fired": "FIRING", "escalated": "ESCALATED", "resolved": "RESOLVED"}


def run_link(base_url: str, run: str) -> str:
    """The dashboard's view of a run."""
    return f"{base_url}/?run={quote(run, safe='')}"


def slack_payload(event: AlertEvent, base_url: str) -> dict:
    """A Slack incoming-webhook message (text + blocks + a coloured attachment); also carries the alert as
    plain fields under `fp8mon` for receivers that are not Slack."""
    a = event.alert
    where = " / ".join(p for p in (a.layer, a.site) if p) or "run-level"
    verb = _VERBS.get(event.kind, event.kind.upper())
    link = run_link(base_url, a.run)
    text = f"[{verb}] {a.severity.upper()} {a.rule} on run {a.run} ({where}) at step {event.step}: {a.message}"
    if event.kind == "escalated" and event.previous_severity:
        text += (f" (escalated to {a.severity} at step {a.escalated_step}, was {event.previous_severity}; "
                 f"fired at step {a.fired_step})")
    fields = [("Run", f"<{link}|{a.run}>"), ("Severity", a.severity), ("Rule", a.rule), ("Where", where),
              ("Step", str(event.step)), ("Since step", str(a.first_step))]
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn",
                                         "text": f"{_EMOJI.get(a.severity, '')} *{verb}* `{a.rule}` on *{a.run}*"}},
            {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in fields]},
            {"type": "section", "text": {"type": "plain_text", "text": a.message}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|Open run in fp8mon>"}]},
        ],
        "attachments": [{"color": "#2ca02c" if event.kind == "resolved" else _COLOURS.get(a.severity, "#7f7f7f"),
                         "fallback": text, "title": f"{a.run}: {a.rule}", "title_link": link}],
        "fp8mon": {"event": event.kind, "run": a.run, "rule": a.rule, "severity": a.severity, "layer": a.layer,
                   "site": a.site, "step": event.step, "first_step": a.first_step, "fired_step": a.fired_step,
                   "escalated_step": a.escalated_step, "resolved_step": a.resolved_step, "message": a.message,
                   "value": a.value, "fingerprint": a.fingerprint, "url": link},
    }


class WebhookSender:
    def __init__(self, urls: list[str], *, base_url: str = "", max_attempts: int = 6, backoff: float = 0.5,
                 max_backoff: float = 30.0, timeout: float = 5.0, queue_size: int = 1000, metrics=None):
        """`base_url`: this server's address in the messages' links."""
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
        if self.urls:
            self.send(slack_payload(event, self.base_url))

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
                payload = self._queue.get()
                try:
                    if payload is None:
                        return
                    for url in self.urls:
                        self._count(ok=self._deliver(client, url, payload))
                finally:
                    self._queue.task_done()

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
        """Wait until every queued notification was handled (tests, shutdown)."""
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
