"""The built-in webhook's grouping (pure, no I/O): alert events in, one notification per run and rule out.

* events below the severity floor (`min_severity`, default warning) are dropped;
* a group is (run, rule): an alert on 12 layers and sites is one notification listing them, not 12;
* a group's first notification waits `group_wait` seconds for the rest of its alerts; after that it notifies at
  most once per `group_interval` seconds (the rate limit), with everything that changed meanwhile;
* a notification says whether the group still fires ("fired", "escalated") or has no firing alert left
  ("resolved").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8mon.monitor.alerting.lifecycle import ESCALATED, FIRED, RESOLVED, Alert, AlertEvent
from fp8mon.monitor.assessment import SEVERITIES

_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class GroupNotice:
    """One notification: a group's changes since its last one, and what fires now."""

    run: str
    rule: str
    changes: list[AlertEvent]  # the latest event of each alert that changed, in order of change
    firing: list[Alert]  # the group's firing alerts after these changes

    @property
    def status(self) -> str:
        if not self.firing:
            return RESOLVED
        return ESCALATED if any(e.kind == ESCALATED for e in self.changes) else FIRED

    @property
    def severity(self) -> str:
        alerts = self.firing or [e.alert for e in self.changes]
        return max((a.severity for a in alerts), key=_RANK.__getitem__)


@dataclass
class _Group:
    firing: dict[str, Alert] = field(default_factory=dict)  # fingerprint -> alert
    changes: dict[str, AlertEvent] = field(default_factory=dict)  # fingerprint -> its latest event since last sent
    first_change: float | None = None
    last_sent: float | None = None


class NotificationGroups:
    def __init__(self, min_severity: str = "warning", group_wait: float = 10.0, group_interval: float = 300.0):
        if min_severity not in _RANK:
            raise ValueError(f"unknown severity {min_severity!r}")
        self.min_rank = _RANK[min_severity]
        self.group_wait = group_wait
        self.group_interval = group_interval
        self._groups: dict[tuple[str, str], _Group] = {}

    def add(self, event: AlertEvent, now: float) -> bool:
        """Take an event; False when it is below the floor or no notification kind."""
        a = event.alert
        if event.kind not in (FIRED, ESCALATED, RESOLVED) or _RANK[a.severity] < self.min_rank:
            return False
        group = self._groups.setdefault((a.run, a.rule), _Group())
        previous = group.changes.get(a.fingerprint)
        if previous is not None and previous.kind == FIRED and event.kind == ESCALATED:
            event = AlertEvent(FIRED, event.step, a)  # new since the last notification: it fired
        group.changes.pop(a.fingerprint, None)
        group.changes[a.fingerprint] = event
        if group.first_change is None:
            group.first_change = now
        if event.kind == RESOLVED:
            group.firing.pop(a.fingerprint, None)
        else:
            group.firing[a.fingerprint] = a
        return True

    def _due_at(self, group: _Group) -> float | None:
        if group.first_change is None:
            return None
        if group.last_sent is None:
            return group.first_change + self.group_wait
        return max(group.first_change, group.last_sent + self.group_interval)

    def next_due(self) -> float | None:
        """When the earliest waiting notification is due; None: nothing waits."""
        times = [t for t in map(self._due_at, self._groups.values()) if t is not None]
        return min(times) if times else None

    def due(self, now: float, everything: bool = False) -> list[GroupNotice]:
        """The notifications due at `now` (all waiting ones with `everything`, e.g. at shutdown)."""
        out = []
        for (run, rule), group in list(self._groups.items()):
            due_at = self._due_at(group)
            if due_at is not None and (everything or now >= due_at):
                out.append(GroupNotice(run, rule, list(group.changes.values()), list(group.firing.values())))
                group.changes, group.first_change, group.last_sent = {}, None, now
            elif (due_at is None and not group.firing and group.last_sent is not None
                  and now - group.last_sent >= self.group_interval):
                del self._groups[(run, rule)]  # quiet and past its rate limit: forget it
        return out
