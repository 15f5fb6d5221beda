"""From stored batches to predictions, alerts, webhooks and Prometheus gauges, off the ingest path.

Threading. `Store.ingest` calls `Pipeline.submit` after a batch has committed (duplicates excluded); submit
only puts the batch on a bounded queue (`put_nowait`: when the queue is full the batch skips prediction and
`fp8mon_predictor_dropped_batches_total` counts it; ingest never waits). One worker thread takes batches in
arrival order, which is each run's order as long as its agent sends sequentially, and for each batch:

1. finds the run's state: one predictor (`settings.predictor`, default `monitor.predictors:RunPredictor`,
   built lazily as `factory(run, config=<run config>)`) and the run's active alerts;
2. `predictor.observe(batch)` -> assessments, in step order, through the `AlertTracker` (lifecycle rules in
   monitor.assessment);
3. writes through its alert store (storage.AlertStore), in one transaction: the predictions kept (below)
   and the alert rows (inserted when pending or
   fired; updated on fire, escalation, resolution and with each batch's last step; a dropped pending alert's
   row is deleted);
4. after the commit, hands notifications (fired, escalated, resolved) to its notifier (the queues of the
   webhook and Alertmanager senders) and updates the run's Prometheus gauges (monitor.gauges).

Predictions stored. A predictor may assess every step; a row per step of a 100k-step run with JSON signals
and culprits is tens of MB for a curve people read at a coarser grain. Stored: every
`prediction_every_steps`-th step, the last assessment of each batch (so `/predictions/latest` is current),
any step whose risk moved by `prediction_risk_delta` or more since the last stored one, and every step at
which an alert changed state. Alerts are computed from every assessment, stored or not.

Restart. Nothing is replayed: a run's predictor is rebuilt empty on its first batch after a restart, so its
windows and trends warm up again (the history before the restart is not re-read); its pending and firing
alerts are read back from the database, so they continue (no duplicate 'fired', resolution still works).
/metrics is seeded at start from the database (runs seen in the last hour and not ended: last step, latest
risk, firing alerts). Lost: predictor state, and batches still queued when the process died (they are
stored, just never assessed).

End of a run. When a run's status becomes final (`FINAL_STATUSES`, by an ingested `run_meta` or PATCH
/runs/{run}, which calls `end_run`), its firing alerts resolve and its pending ones are dropped, written and
notified as any other resolution; a run that resumes opens new alerts.

Deletion. `forget_run` (DELETE /runs/{run}) drops the run's series from /metrics at once, the worker drops its
predictor and alert state, and queued batches of the deleted run id are skipped.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from fp8mon.monitor.alerting.lifecycle import DROPPED, ESCALATED, FIRED, RESOLVED, Alert, AlertEvent, AlertTracker
from fp8mon.monitor.assessment import Assessment
from fp8mon.monitor.gauges import batch_gauges
from fp8mon.monitor.jsonvalues import json_safe
from fp8mon.monitor.metrics import Metrics
from fp8mon.monitor.settings import DEFAULT_PREDICTOR
from fp8mon.monitor.storage import AlertStore
from fp8mon.monitor.storage.database import utcnow
from fp8mon.monitor.storage.entities import AlertWrite, PredictionRecord
from fp8mon.monitor.wire import FINAL_STATUSES, IngestBatch, IngestResult

log = logging.getLogger("fp8mon.pipeline")

NOTIFY = (FIRED, ESCALATED, RESOLVED)
SEED_RECENT = timedelta(hours=1)


class Notifier(Protocol):
    def notify(self, event: AlertEvent) -> None:
        """Queue a notification of the event; never blocks (the webhook sender delivers in its own thread)."""


def load_factory(spec: str):
    """`module:callable` -> the callable; None when `spec` is empty or the default predictor is not installed."""
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if spec == DEFAULT_PREDICTOR and exc.name in ("fp8mon.monitor.predictors", module_name):
            log.warning("no predictors installed (%s): ingest and /metrics work, no predictions or alerts", exc)
            return None
        raise
    return getattr(module, attr or "RunPredictor")


@dataclass
class _RunState:
    run_id: int
    predictor: object | None
    alert_ids: dict[str, int] = field(default_factory=dict)  # fingerprint -> alerts.id of the active alert
    stored_risk: float | None = None
    last_step: int | None = None
    ended: bool = False
    config: dict | None = None  # what the predictor was built with, for a rebuild


@dataclass(frozen=True)
class _EndRun:
    """A queue item: the run's status became final outside ingest."""

    run: str
    run_id: int


class Pipeline:
    def __init__(self, alerts: AlertStore, *, metrics: Metrics, notifier: Notifier | None = None,
                 predictor_factory=None, predictor_spec: str = "", queue_size: int = 1000, every_steps: int = 10,
                 risk_delta: float = 0.05):
        self.alerts = alerts
        self.metrics = metrics
        self.notifier = notifier
        self._factory = predictor_factory
        self._factory_spec = predictor_spec if predictor_factory is None else ""
        self._factory_loaded = predictor_factory is not None
        self.every_steps = every_steps
        self.risk_delta = risk_delta
        self.tracker = AlertTracker()
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._runs: dict[str, _RunState] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)  # submission order; deletion skips what was submitted before it
        self._submitted = 0
        self._forgotten: dict[str, int] = {}  # run name -> last submission number of its deleted incarnation
        self._forget: list[str] = []
        self._thread: threading.Thread | None = None
        metrics.queue_depth.set_function(self._queue.qsize)

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> Pipeline:
        self._thread = threading.Thread(target=self._run, name="fp8mon-pipeline", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is queued (up to `timeout` seconds), then stop."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("pipeline stopped with %d batches not assessed", self._queue.qsize())
        self._thread.join(timeout)
        self._thread = None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every batch submitted so far was processed (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # -- entry points (any thread) ------------------------------------------------------------------

    def submit(self, batch: IngestBatch, result: IngestResult) -> bool:
        """The Store's after-commit listener: never blocks."""
        if result.duplicate:
            return False
        with self._lock:
            self._submitted = seq = next(self._seq)
        try:
            self._queue.put_nowait((batch, result.run_id, seq))
            return True
        except queue.Full:
            self.metrics.predictor_dropped.inc()
            return False

    def forget_run(self, name: str) -> None:
        """The run was deleted: batches of it submitted so far are skipped; its state and series go."""
        self.metrics.runs.remove(name)
        with self._lock:
            self._forgotten[name] = self._submitted
            self._forget.append(name)
        if hasattr(self.notifier, "forget_run"):
            self.notifier.forget_run(name)

    def end_run(self, name: str, run_id: int) -> None:
        """The run's status became final outside ingest (PATCH): resolve its alerts in the worker's turn."""
        with self._lock:
            self._submitted = seq = next(self._seq)
        try:
            self._queue.put_nowait((_EndRun(name, run_id), run_id, seq))
        except queue.Full:  # rare; its alerts then resolve with its next final batch or stay open
            self.metrics.predictor_dropped.inc()
            log.warning("pipeline queue full: the alerts of ended run %r stay open", name)

    def _is_forgotten(self, name: str, seq: int) -> bool:
        with self._lock:
            return seq <= self._forgotten.get(name, 0)

    # -- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._seed_metrics()
        except Exception:
            log.exception("could not seed /metrics from the database")
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._apply_forgets()
                batch, run_id, seq = item
                if self._is_forgotten(batch.run, seq):
                    pass
                elif isinstance(batch, _EndRun):
                    self._end(batch.run, run_id)
                else:
                    self._process(batch, run_id, seq)
            except Exception:
                self._drop_state(item[0].run)  # rebuilt from the database on its next batch
                if not self._is_forgotten(item[0].run, item[2]):  # else: deleted while being assessed
                    self.metrics.predictor_errors.inc()
                    log.exception("pipeline failed on a batch of run %r", item[0].run)
            finally:
                self._queue.task_done()

    def _apply_forgets(self) -> None:
        with self._lock:
            names, self._forget = self._forget, []
        for name in names:
            self._drop_state(name)

    def _drop_state(self, name: str) -> None:
        self._runs.pop(name, None)
        self.tracker.forget(name)

    def _predictor_for(self, run: str, config: dict | None):
        if not self._factory_loaded:
            self._factory_loaded = True
            try:
                self._factory = load_factory(self._factory_spec)
            except Exception:
                log.exception("cannot load the predictor %r: no predictions", self._factory_spec)
        if self._factory is None:
            return None
        try:
            return self._factory(run, config=config)
        except Exception:
            log.exception("cannot build a predictor for run %r", run)
            self.metrics.predictor_errors.inc()
            return None

    def _state(self, batch: IngestBatch | _EndRun, run_id: int) -> _RunState:
        state = self._runs.get(batch.run)
        if state is not None and state.run_id == run_id:
            return state
        self._drop_state(batch.run)  # a new run of the same name (the old one was deleted)
        stored = self.alerts.run_alert_state(run_id)
        config = stored.config
        meta = getattr(batch, "run_meta", None)
        if meta is not None and meta.config is not None:
            config = meta.config
        predictor = None if isinstance(batch, _EndRun) else self._predictor_for(batch.run, config)
        state = _RunState(run_id, predictor, config=config)
        restored = []
        for row in stored.alerts:
            alert = Alert(run=batch.run, rule=row.rule, layer=row.layer, site=row.site, severity=row.severity,
                          state=row.state, message=row.message, first_step=row.first_step or 0,
                          last_step=row.last_step or 0, for_steps=int(row.details.get("for_steps", 0)),
                          value=row.details.get("value"), fired_step=row.fired_step,
                          escalated_step=row.escalated_step, escalations=list(row.escalations))
            if alert.fingerprint in state.alert_ids:
                continue
            state.alert_ids[alert.fingerprint] = row.id
            restored.append(alert)
        self.tracker.restore(restored)
        self._runs[batch.run] = state
        return state

    def _process(self, batch: IngestBatch, run_id: int, seq: int) -> None:
        state = self._state(batch, run_id)
        run = batch.run
        assessments: list[Assessment] = []
        if state.predictor is not None:
            try:
                assessments = sorted(state.predictor.observe(batch) or [], key=lambda a: a.step)
            except Exception:
                self.metrics.predictor_errors.inc()
                log.exception("predictor failed on run %r; its state is rebuilt on the next batch", run)
                state.predictor = self._predictor_for(run, state.config)
        events: list[AlertEvent] = []
        predictions: list[PredictionRecord] = []
        for i, a in enumerate(assessments):
            step_events = self.tracker.update(run, a.step, a.findings)
            events.extend(step_events)
            risk = _risk(a.risk)
            if (a.step % self.every_steps == 0 or i == len(assessments) - 1 or step_events
                    or state.stored_risk is None or abs(risk - state.stored_risk) >= self.risk_delta):
                state.stored_risk = risk
                predictions.append(PredictionRecord(step=a.step, risk=risk,
                                                    steps_to_divergence=_finite(a.steps_to_divergence),
                                                    signals=json_safe(dict(a.signals)),
                                                    culprits=json_safe(list(a.culprits))))
        last = assessments[-1] if assessments else None
        final = batch.run_meta is not None and batch.run_meta.status in FINAL_STATUSES
        if final:
            events.extend(self.tracker.end_run(run, last.step if last is not None else None))
        if predictions or events or self.tracker.active(run):
            self._write(state, run, predictions, events, last)
        self._notify(events)
        self.metrics.predictor_batches.inc()

        values = batch_gauges(batch)
        if "last_step" in values:  # a late batch does not move the run's last step back
            state.last_step = values["last_step"] = max(values["last_step"], state.last_step or 0)
        if last is not None:
            values["risk"] = _risk(last.risk)
            values["steps_to_divergence"] = _finite(last.steps_to_divergence)
            for key in ("worst_kurtosis", "worst_underflow_frac", "worst_overflow_frac"):
                if key in last.gauges and last.gauges[key] is not None:
                    values[key] = last.gauges[key]
        if self._is_forgotten(run, seq):
            self._drop_state(run)
            self.metrics.runs.remove(run)
            return
        self.metrics.runs.update(run, values, self._firing(run))
        if final:
            self.metrics.runs.end(run)
            state.predictor = None  # a finished run needs no more predictions; rebuilt if it resumes
            state.ended = True
        elif state.ended and batch.run_meta is not None and batch.run_meta.status == "running":
            state.ended = False
            state.predictor = self._predictor_for(run, state.config)

    def _end(self, run: str, run_id: int) -> None:
        loaded = run in self._runs and self._runs[run].run_id == run_id
        state = self._state(_EndRun(run, run_id), run_id)
        events = self.tracker.end_run(run, state.last_step)
        if events:
            self._write(state, run, [], events, None)
            self._notify(events)
            self.metrics.runs.update(run, None, self._firing(run), active=False)
        self.metrics.runs.end(run)
        if not loaded:  # built for this only: a later batch of the run builds it with its predictor
            self._runs.pop(run, None)

    def _notify(self, events: list[AlertEvent]) -> None:
        for event in events:
            if event.kind in NOTIFY:
                if self.notifier is not None:
                    self.notifier.notify(event)
                self.metrics.alert_events.labels(event.alert.severity).inc()

    def _write(self, state: _RunState, run: str, predictions: list[PredictionRecord], events: list[AlertEvent],
               last: Assessment | None) -> None:
        context = {} if last is None else {"risk": _risk(last.risk),
                                           "steps_to_divergence": _finite(last.steps_to_divergence)}
        writes = [AlertWrite(e.alert, delete=e.kind == DROPPED, resolved=e.kind == RESOLVED, context=context)
                  for e in events]
        changed = {e.alert.fingerprint for e in events}
        # then every active alert as it stands after the batch (an event's copy is its state at that step)
        writes += [AlertWrite(a, context=context) for a in self.tracker.active(run)
                   if a.fingerprint in state.alert_ids or a.fingerprint in changed]
        state.alert_ids = self.alerts.record_assessments(state.run_id, predictions, writes, state.alert_ids)

    def _firing(self, run: str) -> dict[str, int]:
        """The run's firing counts for /metrics: acknowledged alerts are left out, as on the dashboard (the database
        knows the acknowledgements; it is asked only when something fires)."""
        counts = self.tracker.firing_counts(run)
        return self.alerts.firing_counts(run) if any(counts.values()) else counts

    def _seed_metrics(self) -> None:
        recent = self.alerts.recent_runs(utcnow() - SEED_RECENT, self.metrics.runs.max_runs)
        for run in reversed(recent):  # oldest first: the most recent ends up most recently active
            values = {"last_step": run.last_step,
                      "last_seen": run.last_seen_at.timestamp() if run.last_seen_at else None}
            if run.risk is not None:
                values.update(risk=run.risk, steps_to_divergence=run.steps_to_divergence)
            self.metrics.runs.update(run.name, values, run.firing)


def _risk(x) -> float:
    x = float(x) if x is not None else 0.0
    return 1.0 if math.isnan(x) else min(1.0, max(0.0, x))


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
