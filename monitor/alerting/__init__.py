"""Alerting: the alert lifecycle (pure), webhooks, and the alert/prediction storage of the pipeline."""

from fp8mon.monitor.alerting.lifecycle import Alert, AlertEvent, AlertTracker, fingerprint

__all__ = ["Alert", "AlertEvent", "AlertTracker", "fingerprint"]
