"""The alert lifecycle: level-triggered findings in, de-duplicated alert events out (pure, no I/O).

The rules are those of `monitor.assessment`:

* an alert's identity (fingerprint) is (run, rule, layer, site); several findings with one fingerprint at
  one step count once, at the highest severity among them;
* an alert is pending when its finding first appears and fires once the finding has held for the finding's
  `for_steps` steps (measured in training steps, `step - first_step >= for_steps`, so a predictor that
  evaluates every k-th step fires at the same step as one that evaluates every step); `for_steps == 0` fires
  at once;
* a pending alert whose finding is absent at an evaluation of its run is dropped;
* a firing alert resolves once its finding has been absent for `RESOLVE_AFTER_STEPS` steps
  (`step - last_step >= RESOLVE_AFTER_STEPS`); if the finding comes back before that, it keeps firing;
* a finding of higher severity raises the alert's severity (an `escalated` event when it is firing, which
  sets `escalated_step` to that step; a rise while pending is no escalation: the alert fires at the higher
  severity and `escalated_step` stays None); severity never decreases while the alert lives;
* every severity rise after firing is kept in `escalations` ({"step", "severity", "from"}, in step order), so
  the step at which an alert started paging survives later rises;
* `end_run(run, step)` (the run finished) resolves the run's firing alerts and drops its pending ones;
* after resolution, the same condition opens a new alert.

`AlertTracker.update(run, step, findings)` is called once per evaluated step of a run, in step order, with
all the findings of that step, and returns what changed. Steps that go backwards (a late batch) update what
they mention but never resolve or drop anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from fp8mon.monitor.assessment import RESOLVE_AFTER_STEPS, SEVERITIES, Finding

PENDING, FIRED, ESCALATED, RESOLVED, DROPPED = "pending", "fired", "escalated", "resolved", "dropped"
FIRING = "firing"  # the state of a fired alert
EVENT_KINDS = (PENDING, FIRED, ESCALATED, RESOLVED, DROPPED)
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def fingerprint(run: str, rule: str, layer: str | None, site: str | None) -> str:
    """A stable 32-character id of (run, rule, layer, site): fits an indexed column whatever the names' lengths."""
    key = "\x1f".join((run, rule, layer or "", site or ""))
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass
class Alert:
    """One alert's state. Events carry copies; mutate nothing you get back from the tracker."""

    run: str
    rule: str
    layer: str | None
    site: str | None
    severity: str
    state: str  # "pending" | "firing" | "resolved"
    message: str
    first_step: int  # step at which the finding first appeared
    last_step: int  # last step at which the finding held
    for_steps: int = 0
    value: float | None = None
    fired_step: int | None = None
    escalated_step: int | None = None  # step of the last severity rise after firing; None if it never rose
    resolved_step: int | None = None
    escalations: list = dataclasses.field(default_factory=list)  # {"step", "severity", "from"} per rise after firing

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.run, self.rule, self.layer, self.site)


@dataclass(frozen=True)
class AlertEvent:
    kind: str  # one of EVENT_KINDS
    step: int  # the evaluated step at which it happened
    alert: Alert  # the alert's state after the event (a copy)
    previous_severity: str | None = None  # escalated: the severity before


class AlertTracker:
    """Active (pending and firing) alerts of every run, keyed by fingerprint."""

    def __init__(self, resolve_after_steps: int = RESOLVE_AFTER_STEPS):
        self.resolve_after_steps = resolve_after_steps
        self._runs: dict[str, dict[tuple, Alert]] = {}
        self._last_step: dict[str, int] = {}

    def update(self, run: str, step: int, findings: Iterable[Finding]) -> list[AlertEvent]:
        active = self._runs.setdefault(run, {})
        in_order = step >= self._last_step.get(run, step)
        self._last_step[run] = max(step, self._last_step.get(run, step))
        events: list[AlertEvent] = []

        current: dict[tuple, Finding] = {}
        for f in findings:
            key = (f.rule, f.layer, f.site)
            if key not in current or _RANK[f.severity] > _RANK[current[key].severity]:
                current[key] = f

        for key, f in current.items():
            alert = active.get(key)
            if alert is None:
                alert = Alert(run=run, rule=f.rule, layer=f.layer, site=f.site, severity=f.severity,
                              state=PENDING, message=f.message, first_step=step, last_step=step,
                              for_steps=max(0, f.for_steps), value=f.value)
                active[key] = alert
                if not self._maybe_fire(alert, step, events):
                    events.append(AlertEvent(PENDING, step, dataclasses.replace(alert)))
                continue
            previous = alert.severity
            escalates = _RANK[f.severity] > _RANK[previous]
            if escalates:
                alert.severity = f.severity
            if _RANK[f.severity] == _RANK[alert.severity] and step >= alert.last_step:
                alert.message, alert.value = f.message, f.value  # the latest words of the top severity
            alert.last_step = max(alert.last_step, step)
            alert.for_steps = max(0, f.for_steps)
            if alert.state == PENDING:
                self._maybe_fire(alert, step, events)
            elif escalates:
                alert.escalated_step = step
                alert.escalations = [*alert.escalations, {"step": step, "severity": f.severity, "from": previous}]
                events.append(AlertEvent(ESCALATED, step, dataclasses.replace(alert), previous_severity=previous))

        if in_order:
            for key, alert in list(active.items()):
                if key in current:
                    continue
                if alert.state == PENDING:
                    del active[key]
                    alert.state = DROPPED
                    events.append(AlertEvent(DROPPED, step, dataclasses.replace(alert)))
                elif step - alert.last_step >= self.resolve_after_steps:
                    del active[key]
                    alert.state, alert.resolved_step = RESOLVED, step
                    events.append(AlertEvent(RESOLVED, step, dataclasses.replace(alert)))
        if not active:
            del self._runs[run]
        return events

    def end_run(self, run: str, step: int | None = None) -> list[AlertEvent]:
        """The run finished: its firing alerts resolve (at `step`, default the last step seen) and its pending
        ones are dropped."""
        active = self._runs.pop(run, {})
        last = self._last_step.pop(run, None)
        step = step if step is not None else (last if last is not None else 0)
        events = []
        for alert in active.values():
            if alert.state == PENDING:
                alert.state = DROPPED
                events.append(AlertEvent(DROPPED, step, dataclasses.replace(alert)))
            else:
                alert.state, alert.resolved_step = RESOLVED, max(step, alert.last_step)
                events.append(AlertEvent(RESOLVED, alert.resolved_step, dataclasses.replace(alert)))
        return events

    def _maybe_fire(self, alert: Alert, step: int, events: list[AlertEvent]) -> bool:
        if step - alert.first_step < alert.for_steps:
            return False
        alert.state, alert.fired_step = FIRING, step
        events.append(AlertEvent(FIRED, step, dataclasses.replace(alert)))
        return True

    # -- state ------------------------------------------------------------------------------------------

    def active(self, run: str) -> list[Alert]:
        """Copies of the run's pending and firing alerts, in order of appearance."""
        return [dataclasses.replace(a) for a in self._runs.get(run, {}).values()]

    def firing_counts(self, run: str) -> dict[str, int]:
        """Firing alerts of a run per severity (every severity present, zeros included)."""
        counts = dict.fromkeys(SEVERITIES, 0)
        for alert in self._runs.get(run, {}).values():
            if alert.state == FIRING:
                counts[alert.severity] += 1
        return counts

    def restore(self, alerts: Iterable[Alert]) -> None:
        """Take back pending/firing alerts (e.g. read from the database after a restart)."""
        for alert in alerts:
            if alert.state not in (PENDING, FIRING):
                raise ValueError(f"only pending or firing alerts can be restored, not {alert.state!r}")
            copy = dataclasses.replace(alert, escalations=list(alert.escalations))
            self._runs.setdefault(alert.run, {})[(alert.rule, alert.layer, alert.site)] = copy
            self._last_step[alert.run] = max(alert.last_step, self._last_step.get(alert.run, alert.last_step))

    def forget(self, run: str) -> None:
        self._runs.pop(run, None)
        self._last_step.pop(run, None)

    def runs(self) -> list[str]:
        return list(self._runs)
