"""Prometheus metrics of the monitor (GET /metrics), on a registry of their own.

Labels are bounded: `run` (at most `metrics_max_runs` runs, the most recently active; an ended or deleted
run's series go away after a grace period) and `severity` (3 values). Per-layer, per-site and per-statistic
values stay in the store; only run-level worst-layer aggregates are exported.

Names: one `fp8mon_` prefix, base units (seconds, ratios 0..1), `_total` counters.

The state lives in this process. `fp8mon serve --workers N` with N > 1 would give each worker process its
own (partial) view, so alerting and /metrics assume the default single worker (`fp8mon serve` refuses more while
predictions are on). Besides: `fp8mon_build_info{version, python}` and the process's `process_*` (CPU, memory,
open files).
"""

from __future__ import annotations

import platform
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fp8mon import __version__
from fp8mon.monitor.assessment import SEVERITIES

# exported name -> (help, the key of RunState.values)
RUN_GAUGES = {
    "fp8mon_run_risk_score": ("Divergence risk of the run's last evaluated step, 0 (healthy) to 1 (diverging).",
                              "risk"),
    "fp8mon_run_steps_to_divergence": ("Estimated training steps until divergence; absent when no trend points "
                                       "at divergence.", "steps_to_divergence"),
    "fp8mon_run_worst_kurtosis": ("Largest kurtosis over the run's layers and sites at its last step.",
                                  "worst_kurtosis"),
    "fp8mon_run_worst_underflow_ratio": ("Largest fraction of values flushed to zero by the FP8 cast, over "
                                         "layers and sites at the last step.", "worst_underflow_frac"),
    "fp8mon_run_worst_overflow_ratio": ("Largest fraction of values saturating the FP8 range, over layers and "
                                        "sites at the last step.", "worst_overflow_frac"),
    "fp8mon_run_nonfinite_tensors": ("Tensors (layer x site) with NaN/Inf values, plus non-finite scalars "
                                     "(loss, grad norm), at the run's last step.", "nonfinite_tensors"),
    "fp8mon_run_last_step": ("Last training step received for the run.", "last_step"),
    "fp8mon_run_last_seen_timestamp_seconds": ("Unix time of the run's last ingested batch.", "last_seen"),
}
ALERTS_FIRING = "fp8mon_alerts_firing"
FIRING_HELP = "Firing fp8mon alerts per run and severity, acknowledged ones left out (as on the dashboard)."
# The *_created series double the exposition for nothing the rules or dashboards use (process-wide switch).
disable_created_metrics()

INGEST_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class RunState:
    values: dict[str, float] = field(default_factory=dict)
    firing: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEVERITIES, 0))
    active_at: float = field(default_factory=time.time)
    ended_at: float | None = None  # wall time the run ended or was deleted


class RunMetrics(Collector):
    """Per-run gauges, built at scrape time from the latest values the pipeline recorded."""

    def __init__(self, max_runs: int = 100, grace_seconds: float = 300.0, clock=time.time):
        self.max_runs = max_runs
        self.grace_seconds = grace_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunState] = {}

    def update(self, run: str, values: dict[str, float | None] | None = None,
               firing: dict[str, int] | None = None, *, active: bool = True) -> None:
        with self._lock:
            state = self._runs.setdefault(run, RunState())
            if values:
                for key, value in values.items():
                    if value is None:
                        state.values.pop(key, None)
                    else:
                        state.values[key] = float(value)
            if firing is not None:
                state.firing = {s: int(firing.get(s, 0)) for s in SEVERITIES}
            if active:
                state.active_at = self._clock()
                state.ended_at = None

    def set_firing(self, run: str, firing: dict[str, int]) -> None:
        """New firing counts of a run already exported (an acknowledgement): neither adds a run nor makes it
        active."""
        with self._lock:
            state = self._runs.get(run)
            if state is not None:
                state.firing = {s: int(firing.get(s, 0)) for s in SEVERITIES}

    def end(self, run: str) -> None:
        """The run finished (or was deleted): its series go after the grace period."""
        with self._lock:
            state = self._runs.get(run)
            if state is not None and state.ended_at is None:
                state.ended_at = self._clock()

    def remove(self, run: str) -> None:
        with self._lock:
            self._runs.pop(run, None)

    def exported_runs(self) -> list[str]:
        now = self._clock()
        with self._lock:
            for name in [n for n, s in self._runs.items()
                         if s.ended_at is not None and now - s.ended_at >= self.grace_seconds]:
                del self._runs[name]
            live = sorted(self._runs.items(), key=lambda item: item[1].active_at, reverse=True)
            # memory stays bounded too: runs far beyond the exported ones are forgotten
            for name, _ in live[4 * self.max_runs:]:
                del self._runs[name]
            return [name for name, _ in live[:self.max_runs]]

    def snapshot(self) -> dict[str, RunState]:
        names = self.exported_runs()
        with self._lock:
            return {n: RunState(dict(self._runs[n].values), dict(self._runs[n].firing), self._runs[n].active_at,
                                self._runs[n].ended_at) for n in names if n in self._runs}

    def describe(self):
        return [GaugeMetricFamily(name, doc, labels=["run"]) for name, (doc, _) in RUN_GAUGES.items()] + [
            GaugeMetricFamily(ALERTS_FIRING, FIRING_HELP, labels=["run", "severity"])]

    def collect(self):
        runs = self.snapshot()
        for name, (doc, key) in RUN_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["run"])
            for run, state in runs.items():
                if key in state.values:
                    family.add_metric([run], state.values[key])
            yield family
        firing = GaugeMetricFamily(ALERTS_FIRING, FIRING_HELP, labels=["run", "severity"])
        for run, state in runs.items():
            for severity in SEVERITIES:
                firing.add_metric([run, severity], state.firing.get(severity, 0))
        yield firing


class Metrics:
    """Everything /metrics exports; one instance per application."""

    def __init__(self, *, max_runs: int = 100, grace_seconds: float = 300.0):
        self.registry = CollectorRegistry()
        r = self.registry
        Info("fp8mon_build", "The fp8mon version serving.", registry=r).info(
            {"version": __version__, "python": platform.python_version()})
        ProcessCollector(registry=r)
        self.ingest_batches = Counter("fp8mon_ingest_batches", "Ingest batches stored (duplicates excluded).",
                                      registry=r)
        self.ingest_duplicates = Counter("fp8mon_ingest_duplicate_batches",
                                         "Ingest batches acknowledged as already stored.", registry=r)
        self.ingest_values = Counter("fp8mon_ingest_values", "Statistic and scalar values stored.", registry=r)
        self.ingest_rejected = Counter("fp8mon_ingest_rejected",
                                       "Ingest requests answered with an error (4xx/5xx), nothing stored.", registry=r)
        self.ingest_duration = Histogram("fp8mon_ingest_request_duration_seconds",
                                         "Time to receive, validate and durably store an ingest request.",
                                         buckets=INGEST_DURATION_BUCKETS, registry=r)
        self.queue_depth = Gauge("fp8mon_predictor_queue_depth", "Ingested batches waiting for the predictors.",
                                 registry=r)
        self.predictor_batches = Counter("fp8mon_predictor_batches", "Batches evaluated by the predictors.",
                                         registry=r)
        self.predictor_dropped = Counter("fp8mon_predictor_dropped_batches",
                                         "Batches not evaluated because the predictor queue was full.", registry=r)
        self.predictor_errors = Counter("fp8mon_predictor_errors",
                                        "Batches whose evaluation or alert bookkeeping failed.", registry=r)
        self.alert_events = Counter("fp8mon_alert_events", "Alert lifecycle transitions (fired, escalated, "
                                    "resolved) per severity.", ["severity"], registry=r)
        self.webhook_deliveries = Counter("fp8mon_webhook_deliveries", "Webhook notifications delivered.",
                                          registry=r)
        self.webhook_failures = Counter("fp8mon_webhook_failures",
                                        "Webhook notifications given up after every retry (or dropped).", registry=r)
        self.webhook_suppressed = Counter("fp8mon_webhook_suppressed_events",
                                          "Alert events folded into another notification of their run and rule "
                                          "or below the webhook's severity floor.", registry=r)
        self.alertmanager_posts = Counter("fp8mon_alertmanager_posts", "Alert posts Alertmanager accepted.",
                                          registry=r)
        self.alertmanager_failures = Counter("fp8mon_alertmanager_failures",
                                             "Alert posts to Alertmanager that failed (retried) or were dropped.",
                                             registry=r)
        self.runs = RunMetrics(max_runs, grace_seconds)
        r.register(self.runs)
