"""Alerting: the alert lifecycle (pure), the notifiers (grouped webhooks, Alertmanager); the alert storage of the
pipeline is storage.alerts."""

from fp8mon.monitor.alerting.lifecycle import Alert, AlertEvent, AlertTracker, fingerprint

__all__ = ["Alert", "AlertEvent", "AlertTracker", "fingerprint"]
