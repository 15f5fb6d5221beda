"""Where the pipeline's alert events go: every configured notifier (the webhooks, Alertmanager)."""

from __future__ import annotations

import logging

from fp8mon.monitor.alerting.lifecycle import Alert, AlertEvent

log = logging.getLogger("fp8mon.notifiers")
PAGE = 1000


class Notifiers:
    """Hands each event to every notifier in turn; one notifier's failure never keeps it from the others."""

    def __init__(self, *notifiers):
        self.notifiers = notifiers

    def notify(self, event: AlertEvent) -> None:
        for notifier in self.notifiers:
            try:
                notifier.notify(event)
            except Exception:
                log.exception("notifier %r failed on a %s event", notifier, event.kind)

    def forget_run(self, run: str) -> None:
        """The run was deleted: notifiers that keep alerts (Alertmanager's re-sends) drop its alerts."""
        for notifier in self.notifiers:
            if hasattr(notifier, "forget_run"):
                notifier.forget_run(run)


def firing_alerts(store) -> list[Alert]:
    """The firing alerts stored, as the lifecycle's alerts (what a notifier re-announces after a restart)."""
    out, offset = [], 0
    while True:
        page = store.list_alerts(state=["firing"], limit=PAGE, offset=offset)
        for a in page.alerts:
            out.append(Alert(run=a.run, rule=a.rule, layer=a.layer, site=a.site, severity=a.severity, state=a.state,
                             message=a.message, first_step=a.first_step or 0, last_step=a.last_step or 0,
                             for_steps=int(a.details.get("for_steps", 0)), value=a.details.get("value"),
                             fired_step=a.fired_step, escalated_step=a.escalated_step,
                             escalations=list(a.escalations)))
        offset += PAGE
        if offset >= page.total or not page.alerts:
            return out
