"""Replay every labelled-run fixture through the divergence predictors and the alert lifecycle, next to
the reactive baseline, and print lead times and false alerts (SPEC section 7, "prediction"); the scoring
is fp8mon.monitor.evaluation.

    python bench/predict.py                 # every fixture under tests/fixtures/runs (cpu and gpu/)
    python bench/predict.py --root DIR      # another corpus

The headline figures of each split are appended to bench/results/predict.csv (bench.record) unless
--no-record is given.

Per run: the label (divergence step by monitor.predictors.divergence), the first alert (the first step at
which an alert of severity warning or critical fires under monitor.alerting.lifecycle.AlertTracker, i.e.
after its finding held `for_steps` steps), the lead time = divergence step - first alert step (negative:
late), or for a stable run the number of alerts that fired at warning/critical (an info alert that
escalates to warning counts from then on); and the same for the baseline: a loss z-score
over the previous 30 logged losses (mean/std), firing at the first logged step with z > 3 (a non-finite
loss counts as firing). Runs are marked "tune" (used to choose the thresholds) or "test" (held out), and
labelled diverged, stable or censored (monitor.fixtures: chosen to diverge, not diverged by its last step);
censored runs count neither as stable (false alerts) nor as diverging (leads), they are reported apart; so
are early failures (diverged before monitor.fixtures.EARLY_BEFORE: no lead of 100 steps is possible).

Beside the literal baseline (the target's definition, whose figure is the one the summary judges), three
lines are printed as context: the baseline at a matched false-alarm threshold (the smallest z with no
alert on the stable tune runs); the ceiling of the ratio (an alert at step 0 of every diverging run); and
the *standing* lead of both detectors, where an alert that resolved before the divergence step is not lead
but a false alarm: both go through the server's alert lifecycle (an alert resolves once its condition has
been absent for RESOLVE_AFTER_STEPS steps; the baseline's condition is z > 3), and the standing lead is the
divergence step minus the start of the unbroken stretch of paging alerts that is still open at it (0 when
none is open: a late alert).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/predict.py`: bench.record from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import Recorder  # noqa: E402
from fp8mon.monitor.evaluation import (
    BASELINE_WINDOW,
    BASELINE_Z,
    baseline,
    lead,
    matched_threshold,
    replay,
    standing_lead,
)
from fp8mon.monitor.fixtures import EARLY_BEFORE, TARGET_LEAD, fixture_paths, load_fixture
from fp8mon.monitor.predictors import RunPredictor
from fp8mon.monitor.wire import IngestBatch

TARGET_RATIO = 5.0
# Said here (and in docs/prediction-evaluation.md) when thresholds were changed after seeing the held-out results.
NOTE = ("pass R: the kurtosis level warning was raised to the critical level (16x) on every run of passes A-Q, all "
        "'tune' now (pass Q's held-out runs had been seen: a healthy wide Llama run's slow 12x rise paged); earlier, "
        "pass Q chose the fast-rise warning and per-step smoothing on every run of passes A-P; a 'test' run was made "
        "after that choice and not used for it (docs/prediction.md)")


def step_cost_ms(layers: int = 100, steps: int = 300) -> float:
    """Time per evaluated step of RunPredictor on a synthetic healthy stream of layers x 5 sites."""
    import numpy as np

    from fp8mon.agent.wire import SITES

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


def fmt(value) -> str:
    return "-" if value is None else str(value)


def summarise(split: str, chosen: list[tuple], matched_z: float, rec: Recorder) -> None:
    """Print the figures of one split (tune, test or all) against the targets; record the headline ones."""
    diverging = [r for r in chosen if r[0].outcome == "diverged"]
    stable = [r for r in chosen if r[0].stable]
    censored = [r for r in chosen if r[0].censored]
    early = [r for r in chosen if r[0].early]
    leads = [r[3] for r in diverging]
    ahead = sum(1 for x in leads if x is not None and x >= TARGET_LEAD)
    false_alerts = sum(r[1].alerts for r in stable)
    base_false = sum(r[2].alerts for r in stable)
    ours_total = sum(x for x in leads if x is not None)
    base_leads = [r[4] for r in diverging]
    base_total = sum(max(0, x) for x in base_leads if x is not None)
    ratio = ours_total / base_total if base_total > 0 else math.inf
    matched_leads = [r[7] for r in diverging]
    matched_total = sum(max(0, x) for x in matched_leads if x is not None)
    matched_ratio = ours_total / matched_total if matched_total > 0 else math.inf
    print(f"[{split}] {len(diverging)} diverged, {len(stable)} stable, {len(censored)} censored, {len(early)} "
          f"early-failure runs")
    print(f"  diverging runs alerted >= {TARGET_LEAD} steps ahead: {ahead}/{len(diverging)} "
          f"(leads {leads}; baseline leads {base_leads})  target: all")
    print(f"  alerts on stable runs: {false_alerts} (baseline: {base_false})  target: 0")
    if censored:
        print(f"  censored runs (not targets): alerts {sum(r[1].alerts for r in censored)} (baseline "
              f"{sum(r[2].alerts for r in censored)}), runs with an alert {sum(1 for r in censored if r[1].alerts)}"
              f"/{len(censored)} (baseline {sum(1 for r in censored if r[2].alerts)}/{len(censored)})")
    if early:
        print(f"  early failures (diverged before step {EARLY_BEFORE}; not targets): " + ", ".join(
            f"{r[0].name} at step {r[0].divergence_step}: our lead {fmt(r[3])}, baseline {fmt(r[4])}"
            for r in early))
    print(f"  total lead vs the literal baseline (late baseline counted as 0): {ours_total} / {base_total} = "
          f"{'inf' if math.isinf(ratio) else f'{ratio:.1f}x'}  target: >= {TARGET_RATIO:.0f}x")
    if diverging:
        # the most lead any predictor can have: an alert at step 0 of every diverging run
        ceiling = sum(r[0].divergence_step for r in diverging)
        print(f"  feasibility of the ratio target: a predictor alerting at step 0 of every diverging run would "
              f"lead by {ceiling} in total = {ceiling / base_total if base_total else math.inf:.1f}x the literal "
              f"baseline ({'reachable' if ceiling >= TARGET_RATIO * base_total else 'the 5x target is unreachable'}"
              f" on these runs)")
    print(f"  [not the target's definition] vs the baseline at matched false alarms (z > {matched_z:.2f}; alerts "
          f"on stable runs {sum(r[6].alerts for r in stable)}): leads {matched_leads}, total {ours_total} / "
          f"{matched_total} = {'inf' if math.isinf(matched_ratio) else f'{matched_ratio:.1f}x'}")
    ours_standing = sum(r[8][0] for r in diverging)
    base_standing = sum(r[8][1] for r in diverging)
    standing_ratio = ours_standing / base_standing if base_standing > 0 else math.inf
    print(f"  [not the target's definition] standing leads (an alert resolved before the divergence step is no "
          f"lead): ours {[r[8][0] for r in diverging]}, baseline {[r[8][1] for r in diverging]}, total "
          f"{ours_standing} / {base_standing} = "
          f"{'inf' if math.isinf(standing_ratio) else f'{standing_ratio:.1f}x'}; runs with a standing lead >= "
          f"{TARGET_LEAD}: ours {sum(1 for r in diverging if r[8][0] >= TARGET_LEAD)}/{len(diverging)}, baseline "
          f"{sum(1 for r in diverging if r[8][1] >= TARGET_LEAD)}/{len(diverging)}")
    # None: no run of the kind the target is about (no diverging or no stable run in this split)
    met = {"lead >= 100 on every diverging run": ahead == len(diverging) if diverging else None,
           "zero alerts on stable runs": false_alerts == 0 if stable else None,
           f">= {TARGET_RATIO:.0f}x the literal baseline's lead": ratio >= TARGET_RATIO if diverging else None}
    verdicts = "; ".join(f"{k}: {'n/a' if v is None else 'yes' if v else 'NO'}" for k, v in met.items())
    print(f"  targets met (literal definitions): {verdicts}")
    for metric, value, unit in (("diverging", len(diverging), "runs"), ("diverging_warned_ge_100", ahead, "runs"),
                                ("stable", len(stable), "runs"), ("alerts_on_stable", false_alerts, "alerts"),
                                ("baseline_alerts_on_stable", base_false, "alerts"),
                                ("total_lead", ours_total, "steps"), ("baseline_total_lead", base_total, "steps"),
                                ("lead_ratio_to_baseline", ratio, "ratio")):
        rec.add(f"{split}/{metric}", value, unit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="fixture directory (default tests/fixtures/runs)")
    parser.add_argument("--no-record", dest="record", action="store_false",
                        help="do not append the figures to bench/results/predict.csv")
    args = parser.parse_args(argv)
    rec = Recorder("predict")
    paths = fixture_paths(args.root)
    if not paths:
        raise SystemExit("no fixtures found")

    fixtures = [load_fixture(p) for p in paths]
    # the matched-false-alarm baseline: its threshold raised until it is silent on the stable *tune* runs
    matched_z = matched_threshold([f for f in fixtures if f.stable and f.split == "tune"])
    rows = []
    header = (f"{'run':34} {'split':5} {'label':>8} {'div':>5} {'last':>5} | {'alert':>5} {'rule':18} {'lead':>5} "
              f"{'alerts':>6} | {'base':>5} {'lead':>5} {'alerts':>6} | {'ratio':>6} | {'m.base':>6} {'lead':>5} "
              f"| {'st.us':>5} {'st.bs':>5} | {'us/step':>7}")
    print(header)
    print("-" * len(header))
    for fx in fixtures:
        ours, base, matched = replay(fx), baseline(fx.losses()), baseline(fx.losses(), matched_z)
        our_lead, base_lead, matched_lead = lead(fx, ours), lead(fx, base), lead(fx, matched)
        ratio = None
        if our_lead is not None and base_lead is not None and base_lead > 0:
            ratio = our_lead / base_lead
        standing = (standing_lead(fx, ours), standing_lead(fx, base))
        rows.append((fx, ours, base, our_lead, base_lead, ratio, matched, matched_lead, standing))
        print(f"{fx.name:34} {fx.split:5} {fx.outcome:>8} {fmt(fx.divergence_step):>5} {fx.last_step():>5} | "
              f"{fmt(ours.first_alert):>5} {fmt(ours.first_rule):18} {fmt(our_lead):>5} {ours.alerts:>6} | "
              f"{fmt(base.first_alert):>5} {fmt(base_lead):>5} {base.alerts:>6} | "
              f"{'-' if ratio is None else f'{ratio:.1f}x':>6} | {fmt(matched.first_alert):>6} {fmt(matched_lead):>5} "
              f"| {fmt(standing[0]):>5} {fmt(standing[1]):>5} | {1e6 * ours.seconds / max(1, ours.steps):7.0f}")

    print()
    print("columns: div = divergence step (label); alert/rule/lead/alerts = ours (first warning/critical alert, its "
          "rule, lead = div - alert, alerts that fired over the run); base = the literal baseline (loss z-score, "
          f"window {BASELINE_WINDOW}, z > {BASELINE_Z:g}); m.base = the same baseline at the matched threshold "
          f"z > {matched_z:.2f} (the smallest with no alert on the stable tune runs); st.us / st.bs = the standing "
          "lead of ours / of the literal baseline (divergence step - start of the paging stretch still open at it, "
          "0 if none: see the docstring). label 'censored': chosen to diverge, not diverged by its last step; "
          "neither stable nor diverging, reported apart.")
    cost = step_cost_ms()
    rec.add("predictor_cost_per_step/100_layers_x_5_sites", cost, "ms")
    print(f"predictor cost, synthetic 100 layers x 5 sites, statistics every step: {cost:.2f} ms/step "
          "(median of 3 replays of 200 steps; this machine, whatever else it was running)")
    if NOTE:
        print(f"NOTE: {NOTE}")
    print()
    for split in ("tune", "test", "all"):
        chosen = [r for r in rows if split == "all" or r[0].split == split]
        if chosen:
            summarise(split, chosen, matched_z, rec)
    if args.record:
        rec.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
