"""Replay every labelled-run fixture through the divergence predictors and the alert lifecycle, next to
the reactive baseline, and print lead times and false alerts (SPEC section 7, "prediction").

    python -m bench.predict                 # every fixture under tests/fixtures/runs (cpu and gpu/)
    python -m bench.predict --root DIR      # another corpus

Per run: the label (divergence step by monitor.predictors.divergence), the first alert (the first step at
which an alert of severity warning or critical fires under monitor.alerting.lifecycle.AlertTracker, i.e.
after its finding held `for_steps` steps), the lead time = divergence step - first alert step (negative:
late), or for a stable run the number of alerts that fired at warning/critical (an info alert that
escalates to warning counts from then on); and the same for the baseline: a loss z-score
over the previous 30 logged losses (mean/std), firing at the first logged step with z > 3 (a non-finite
loss counts as firing). Runs are marked "tune" (used to choose the thresholds) or "test" (held out).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field

from monitor.alerting.lifecycle import ESCALATED, FIRED, AlertTracker
from monitor.fixtures import Fixture, fixture_paths, load_fixture
from monitor.predictors import PredictorParams, RunPredictor
from monitor.schemas import IngestBatch

TARGET_LEAD = 100
TARGET_RATIO = 5.0
BASELINE_WINDOW = 30
BASELINE_Z = 3.0


@dataclass
class Outcome:
    first_alert: int | None = None
    first_rule: str | None = None
    alerts: int = 0  # warning/critical alerts that fired over the whole run
    alert_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0


def replay(fixture: Fixture, params: PredictorParams | None = None) -> Outcome:
    """Our predictors + the alert lifecycle over the fixture's batches, in order."""
    batches = [IngestBatch.model_validate(b) for b in fixture.batches]
    predictor, tracker, out = RunPredictor(fixture.name, params=params), AlertTracker(), Outcome()
    counted = set()  # an alert counts once, when it first fires at warning/critical (or escalates to it)
    t0 = time.perf_counter()
    for batch in batches:
        for assessment in predictor.observe(batch):
            out.steps += 1
            for event in tracker.update(fixture.name, assessment.step, assessment.findings):
                alert = event.alert
                identity = (alert.rule, alert.layer, alert.site, alert.first_step)
                if event.kind in (FIRED, ESCALATED) and alert.severity in ("warning", "critical") \
                        and identity not in counted:
                    counted.add(identity)
                    out.alerts += 1
                    out.alert_steps.append(event.step)
                    if out.first_alert is None:
                        out.first_alert, out.first_rule = event.step, event.alert.rule
    out.seconds = time.perf_counter() - t0
    return out


def baseline(losses: list[tuple[int, float]]) -> Outcome:
    """Loss z-score vs the previous BASELINE_WINDOW logged losses; an alert per run of steps with z > 3."""
    out, history, firing = Outcome(), [], False
    for step, loss in losses:
        if not math.isfinite(loss):
            z = math.inf
        elif len(history) >= BASELINE_WINDOW:
            window = history[-BASELINE_WINDOW:]
            sd = statistics.pstdev(window)
            z = (loss - statistics.fmean(window)) / sd if sd > 0 else 0.0
        else:
            z = 0.0
        if z > BASELINE_Z and not firing:
            out.alerts += 1
            out.alert_steps.append(step)
            if out.first_alert is None:
                out.first_alert = step
        firing = z > BASELINE_Z
        if math.isfinite(loss):
            history.append(loss)
    return out


def step_cost_ms(layers: int = 100, steps: int = 300) -> float:
    """Time per evaluated step of RunPredictor on a synthetic healthy stream of layers x 5 sites."""
    import numpy as np

    from agent.wire import SITES

    rng = np.random.default_rng(0)
    names = [f"blocks.{i}.mlp.fc1" for i in range(layers)]
    keys = [(layer, site) for layer in names for site in SITES]
    n = len(keys)
    batches = []
    for step in range(steps):
        stats = {"numel": [4096] * n, "amax": (4 + 0.1 * rng.standard_normal(n)).tolist(),
                 "kurtosis": (3 + 0.1 * rng.standard_normal(n)).tolist(),
                 "underflow_frac": (0.01 + 0.001 * rng.standard_normal(n)).tolist(), "overflow_frac": [0.0] * n,
                 "nonfinite": [0] * n, "scale": [112.0] * n, "amax_history_max": [None] * n}
        batches.append(IngestBatch.model_validate({
            "version": 1, "batch_id": str(step), "run": "synthetic",
            "tensors": {"step": step, "layer": [k[0] for k in keys], "site": [k[1] for k in keys], "stats": stats},
            "scalars": {"step": step, "name": ["loss", "grad_norm"],
                        "value": [3.0 + 0.01 * rng.standard_normal(), 1.0]}}))
    times = []
    for _ in range(3):
        predictor = RunPredictor("synthetic")
        for batch in batches[:100]:
            predictor.observe(batch)
        t0 = time.perf_counter()
        for batch in batches[100:]:
            predictor.observe(batch)
        times.append((time.perf_counter() - t0) / (steps - 100))
    return 1e3 * statistics.median(times)


def lead(fixture: Fixture, outcome: Outcome) -> int | None:
    if not fixture.diverged or outcome.first_alert is None:
        return None
    return fixture.divergence_step - outcome.first_alert


def fmt(value) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="fixture directory (default tests/fixtures/runs)")
    args = parser.parse_args(argv)
    paths = fixture_paths(args.root)
    if not paths:
        raise SystemExit("no fixtures found")

    rows = []
    header = (f"{'run':30} {'split':5} {'label':>9} {'div':>5} {'last':>5} | {'alert':>5} {'rule':18} {'lead':>5} "
              f"{'alerts':>6} | {'base':>5} {'lead':>5} {'alerts':>6} | {'ratio':>6} | {'us/step':>7}")
    print(header)
    print("-" * len(header))
    for path in paths:
        fx = load_fixture(path)
        ours, base = replay(fx), baseline(fx.losses())
        our_lead, base_lead = lead(fx, ours), lead(fx, base)
        ratio = None
        if our_lead is not None and base_lead is not None and base_lead > 0:
            ratio = our_lead / base_lead
        rows.append((fx, ours, base, our_lead, base_lead, ratio))
        label = "diverged" if fx.diverged else "stable"
        print(f"{fx.name:30} {fx.split:5} {label:>9} {fmt(fx.divergence_step):>5} {fx.last_step():>5} | "
              f"{fmt(ours.first_alert):>5} {fmt(ours.first_rule):18} {fmt(our_lead):>5} {ours.alerts:>6} | "
              f"{fmt(base.first_alert):>5} {fmt(base_lead):>5} {base.alerts:>6} | "
              f"{'-' if ratio is None else f'{ratio:.1f}x':>6} | {1e6 * ours.seconds / max(1, ours.steps):7.0f}")

    print()
    print(f"predictor cost, synthetic 100 layers x 5 sites, statistics every step: {step_cost_ms():.2f} ms/step "
          "(median of 3 replays of 200 steps; this machine, whatever else it was running)")
    print()
    for split in ("tune", "test", "all"):
        chosen = [r for r in rows if split == "all" or r[0].split == split]
        if not chosen:
            continue
        diverging = [r for r in chosen if r[0].diverged]
        stable = [r for r in chosen if not r[0].diverged]
        leads = [r[3] for r in diverging]
        ahead = sum(1 for x in leads if x is not None and x >= TARGET_LEAD)
        false_alerts = sum(r[1].alerts for r in stable)
        base_false = sum(r[2].alerts for r in stable)
        # stable by the label but trained at a learning rate chosen to make them diverge
        stressed = [r for r in stable if r[0].extra.get("expect") == "diverging"]
        ours_total = sum(x for x in leads if x is not None)
        base_leads = [r[4] for r in diverging]
        base_total = sum(max(0, x) for x in base_leads if x is not None)
        ratio = ours_total / base_total if base_total > 0 else math.inf
        print(f"[{split}] {len(diverging)} diverging, {len(stable)} stable runs")
        print(f"  diverging runs alerted >= {TARGET_LEAD} steps ahead: {ahead}/{len(diverging)} "
              f"(leads {leads}; baseline leads {base_leads})  target: all")
        print(f"  alerts on stable runs: {false_alerts} (baseline: {base_false})  target: 0")
        if stressed:
            sane = [r for r in stable if r not in stressed]
            print(f"    of which on {len(sane)} runs at a sane lr: {sum(r[1].alerts for r in sane)} (baseline: "
                  f"{sum(r[2].alerts for r in sane)}); on {len(stressed)} high-lr runs that had not diverged by "
                  f"their last step: {sum(r[1].alerts for r in stressed)} (baseline: "
                  f"{sum(r[2].alerts for r in stressed)}), runs with an alert "
                  f"{sum(1 for r in stressed if r[1].alerts)}/{len(stressed)}")
        print(f"  total lead vs baseline (late baseline counted as 0): {ours_total} / {base_total} = "
              f"{'inf' if math.isinf(ratio) else f'{ratio:.1f}x'}  target: >= {TARGET_RATIO:.0f}x")
        met = ahead == len(diverging) and false_alerts == 0 and ratio >= TARGET_RATIO
        print(f"  targets met: {'yes' if met else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
