"""Scoring the divergence predictors on labelled runs (monitor.fixtures): lead times and alarms of our
predictors and of a reactive baseline, both through the server's alert lifecycle.

An alert counts once, when it first fires at severity warning or critical (or escalates to it) under
monitor.alerting.lifecycle.AlertTracker, i.e. after its finding held `for_steps` steps. The lead of a
diverging run is its divergence step minus the first such alert's step (negative: late). The *standing*
lead counts an alert that resolved before the divergence step as a false alarm, not as lead: it is the
divergence step minus the start of the unbroken stretch of paging alerts still open at it (0 when none is
open). The baseline: a loss z-score over the previous BASELINE_WINDOW finite logged losses (mean/std),
firing at the first logged step with z > BASELINE_Z (a non-finite loss counts as firing); its condition
goes through the same lifecycle (resolved once absent for RESOLVE_AFTER_STEPS steps).

bench/predict.py prints these figures over the fixture corpus.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from fp8mon.monitor.alerting.lifecycle import ESCALATED, FIRED, RESOLVED, AlertEvent, AlertTracker
from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.fixtures import Fixture
from fp8mon.monitor.predictors import PredictorParams, RunPredictor
from fp8mon.monitor.wire import IngestBatch

BASELINE_WINDOW = 30
BASELINE_Z = 3.0


@dataclass
class Outcome:
    first_alert: int | None = None
    first_rule: str | None = None
    alerts: int = 0  # warning/critical alerts that fired over the whole run
    alert_steps: list[int] = field(default_factory=list)
    # [start, end) of every alert while it paged (warning/critical): end = its resolution step, None if open
    spans: list[list[int | None]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0


def _track_span(out: Outcome, event: AlertEvent, spans: dict) -> bool:
    """Keep the span of a paging alert: opened when it first fires at warning/critical (or escalates to it),
    closed when it resolves. True for the event that opens one (a new paging alert)."""
    alert = event.alert
    identity = (alert.rule, alert.layer, alert.site, alert.first_step)
    if event.kind in (FIRED, ESCALATED) and alert.severity in ("warning", "critical") and identity not in spans:
        spans[identity] = [event.step, None]
        out.spans.append(spans[identity])
        return True
    if event.kind == RESOLVED and identity in spans:
        spans[identity][1] = event.step
    return False


# Scalars a training loop logs at every step (the agent's `log` sends them whenever it is called); the others (the
# attention max-logit, log Z, ...) fp8mon's trainer computes on reporting steps only
EVERY_STEP_SCALARS = frozenset({"loss", "grad_norm", "lr", "tokens_per_s"})


def subsample(batches: list[dict], every: int) -> list[dict]:
    """The run as an agent reporting every `every` steps would have sent it: tensor records and the scalars that
    are not EVERY_STEP_SCALARS only on steps divisible by `every`."""
    if every <= 1:
        return batches
    out = []
    for batch in batches:
        b = {k: v for k, v in batch.items() if k not in ("tensors", "scalars")}
        t = batch.get("tensors")
        if t:
            n = len(t["layer"])
            steps = t["step"] if isinstance(t["step"], list) else [t["step"]] * n
            keep = [i for i in range(n) if steps[i] % every == 0]
            if keep:
                b["tensors"] = {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in t.items()
                                if k != "stats"}
                b["tensors"]["stats"] = {k: [v[i] for i in keep] for k, v in t["stats"].items()}
        sc = batch.get("scalars")
        if sc:
            n = len(sc["name"])
            steps = sc["step"] if isinstance(sc["step"], list) else [sc["step"]] * n
            keep = [i for i in range(n) if sc["name"][i] in EVERY_STEP_SCALARS or steps[i] % every == 0]
            if keep:
                b["scalars"] = {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in sc.items()}
        if "tensors" in b or "scalars" in b:
            out.append(b)
    return out


def replay(fixture: Fixture, params: PredictorParams | None = None, every: int = 1) -> Outcome:
    """Our predictors + the alert lifecycle over the fixture's batches, in order (`every` > 1: subsampled)."""
    batches = [IngestBatch.model_validate(b) for b in subsample(fixture.batches, every)]
    predictor, tracker, out = RunPredictor(fixture.name, params=params), AlertTracker(), Outcome()
    spans = {}  # an alert counts once, when it first fires at warning/critical (or escalates to it)
    t0 = time.perf_counter()
    for batch in batches:
        for assessment in predictor.observe(batch):
            out.steps += 1
            for event in tracker.update(fixture.name, assessment.step, assessment.findings):
                if _track_span(out, event, spans):
                    out.alerts += 1
                    out.alert_steps.append(event.step)
                    if out.first_alert is None:
                        out.first_alert, out.first_rule = event.step, event.alert.rule
    out.seconds = time.perf_counter() - t0
    return out


def baseline_z(losses: list[tuple[int, float]], window: int = BASELINE_WINDOW) -> list[tuple[int, float]]:
    """(step, z) of every logged loss: z of the loss vs the mean/std of the previous `window` finite logged
    losses (0 while fewer; +inf for a non-finite loss)."""
    out, history = [], []
    for step, loss in losses:
        if not math.isfinite(loss):
            z = math.inf
        elif len(history) >= window:
            recent = history[-window:]
            sd = statistics.pstdev(recent)
            z = (loss - statistics.fmean(recent)) / sd if sd > 0 else 0.0
        else:
            z = 0.0
        out.append((step, z))
        if math.isfinite(loss):
            history.append(loss)
    return out


def baseline(losses: list[tuple[int, float]], threshold: float = BASELINE_Z) -> Outcome:
    """Loss z-score vs the previous BASELINE_WINDOW logged losses; an alert per run of steps with z > threshold.
    Its spans come from the same condition through the server's alert lifecycle (a warning while z > threshold,
    resolved once absent for RESOLVE_AFTER_STEPS steps)."""
    out, firing = Outcome(), False
    tracker, spans = AlertTracker(), {}
    for step, z in baseline_z(losses):
        if z > threshold and not firing:
            out.alerts += 1
            out.alert_steps.append(step)
            if out.first_alert is None:
                out.first_alert = step
        firing = z > threshold
        findings = [Finding("loss_zscore", "warning", step, f"loss z {z:.1f}")] if firing else []
        for event in tracker.update("baseline", step, findings):
            _track_span(out, event, spans)
    return out


def standing_lead(fixture: Fixture, outcome: Outcome) -> int | None:
    """Divergence step minus the start of the unbroken stretch of paging alerts still open at it (spans that
    overlap or touch are one stretch); 0 when no alert is open then; None for a run that did not diverge."""
    if not fixture.diverged:
        return None
    d = fixture.divergence_step
    spans = sorted((a, math.inf if b is None else b) for a, b in outcome.spans if a <= d)
    start, end = None, -math.inf
    for a, b in spans:
        if a > end:  # a gap: a new stretch
            start = a
        end = max(end, b)
    return d - start if start is not None and end > d else 0


def matched_threshold(stable: list[Fixture]) -> float:
    """The smallest baseline threshold with no alert on these runs: just above their largest finite z."""
    top = max((z for f in stable for _, z in baseline_z(f.losses()) if math.isfinite(z)), default=BASELINE_Z)
    return max(BASELINE_Z, math.nextafter(top, math.inf))


def lead(fixture: Fixture, outcome: Outcome) -> int | None:
    if not fixture.diverged or outcome.first_alert is None:
        return None
    return fixture.divergence_step - outcome.first_alert
