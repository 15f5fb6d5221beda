"""Scoring a labelled corpus against the targets (docs/prediction-evaluation.md): what `fp8mon eval` prints.

Each run is replayed through the predictors and the alert lifecycle (monitor.evaluation.replay), at the reporting
interval it was recorded with or subsampled to `every`, and judged by its failure (monitor.failures):

* a failing run (blow-up, drift, stall, quality gap): its lead, the failure step minus the first paging alert;
* a healthy run: its paging alerts, each a false alarm;
* a transient run (it recovered): how many steps after its recovery its last paging alert resolved;
* a censored run (trained to fail, `expect` "diverging", that had not failed by its last step): reported apart.

The reactive baseline (a loss z-score, monitor.evaluation.baseline) is scored at its own threshold and at the
lowest threshold that gives no alarm on the healthy runs scored together: the fair comparison, at equal false
alarms. A run that fails before EARLY_BEFORE is reported apart: no predictor that first learns the run's normal
can warn it TARGET_LEAD steps ahead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fp8mon.monitor.evaluation import BASELINE_Z, Outcome, baseline, baseline_z, replay
from fp8mon.monitor.failures import Failure
from fp8mon.monitor.fixtures import EARLY_BEFORE, TARGET_LEAD, Fixture
from fp8mon.monitor.predictors import PredictorParams

RESOLVE_TARGET = 100  # a transient run's alerts resolved within this many steps of its recovery


@dataclass
class RunScore:
    name: str
    split: str
    failure: Failure
    ours: Outcome
    base: Outcome  # the baseline at its own threshold
    matched: Outcome  # the baseline at the matched threshold
    expect: str | None = None  # what the run was trained to do ("diverging": chosen to fail)

    @property
    def role(self) -> str:
        """"failing" | "early" | "stable" | "transient" | "censored" (chosen to fail, and it had not failed by its
        last step: neither healthy nor failing, its alerts are not false alarms)."""
        f = self.failure
        if f.failed:
            return "early" if f.step < EARLY_BEFORE else "failing"
        if f.kind == "transient":
            return "transient"
        return "censored" if self.expect == "diverging" else "stable"

    def lead(self, outcome: Outcome | None = None) -> int | None:
        outcome = outcome or self.ours
        if not self.failure.failed or outcome.first_alert is None:
            return None
        return self.failure.step - outcome.first_alert

    @property
    def resolved_after(self) -> float | None:
        """Transient runs: steps from the recovery to the resolution of the last paging alert (<= 0: all resolved
        by then; inf: one is still open at the end); None when nothing paged."""
        if self.role != "transient" or not self.ours.spans:
            return None
        ends = [math.inf if end is None else end for _, end in self.ours.spans]
        return max(ends) - self.failure.recovered


@dataclass
class Report:
    rows: list[RunScore]
    matched_z: float
    every: int
    summary: dict = field(default_factory=dict)


def score(fixtures: list[Fixture], params: PredictorParams | None = None, every: int = 1) -> Report:
    stable = [f for f in fixtures if not f.failure.failed and f.failure.kind != "transient"
              and f.extra.get("expect") != "diverging"]
    top = max((z for f in stable for _, z in baseline_z(f.losses()) if math.isfinite(z)), default=BASELINE_Z)
    matched_z = max(BASELINE_Z, math.nextafter(top, math.inf))
    rows = []
    for f in fixtures:
        losses = f.losses()
        rows.append(RunScore(f.name, f.split, f.failure, replay(f, params, every=every), baseline(losses),
                             baseline(losses, matched_z), f.extra.get("expect")))
    report = Report(rows, matched_z, every)
    report.summary = summarise(rows)
    return report


def summarise(rows: list[RunScore]) -> dict:
    failing = [r for r in rows if r.role == "failing"]
    stable = [r for r in rows if r.role == "stable"]
    transient = [r for r in rows if r.role == "transient"]
    ours = sum(max(0, r.lead() or 0) for r in failing)
    matched = sum(max(0, r.lead(r.matched) or 0) for r in failing)
    literal = sum(max(0, r.lead(r.base) or 0) for r in failing)
    resolved = [r for r in transient if r.resolved_after is None or r.resolved_after <= RESOLVE_TARGET]
    return {
        "failing": len(failing), "warned_100": sum(1 for r in failing if (r.lead() or -1) >= TARGET_LEAD),
        "stable": len(stable), "stable_alerts": sum(r.ours.alerts for r in stable),
        "baseline_stable_alerts": sum(r.base.alerts for r in stable),
        "transient": len(transient), "transient_resolved": len(resolved),
        "lead": ours, "baseline_lead": literal, "matched_lead": matched,
        "ratio_matched": ours / matched if matched else math.inf, "ratio_literal": ours / literal if literal else math.inf,
        "early": sum(1 for r in rows if r.role == "early"),
        "censored": sum(1 for r in rows if r.role == "censored"),
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "open"
    return str(int(value)) if isinstance(value, float) else str(value)


def format_report(report: Report, title: str = "") -> str:
    head = ("run", "split", "kind", "step", "recovered", "first warning", "rule", "lead", "paging alerts",
            "resolved after", f"z>{BASELINE_Z:g} first", "lead", f"z>{report.matched_z:.3g} first", "lead")
    lines = []
    for r in report.rows:
        f = r.failure
        kind = "censored" if r.role == "censored" else f.kind
        lines.append((r.name, r.split, kind, _cell(f.step), _cell(f.recovered), _cell(r.ours.first_alert),
                      r.ours.first_rule or "-", _cell(r.lead()), str(r.ours.alerts), _cell(r.resolved_after),
                      _cell(r.base.first_alert), _cell(r.lead(r.base)), _cell(r.matched.first_alert),
                      _cell(r.lead(r.matched))))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [title] if title else []
    out += [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*line) for line in lines]
    s = report.summary
    out += [
        "",
        f"every={report.every}: failing runs warned >= {TARGET_LEAD} steps ahead: {s['warned_100']} / {s['failing']}"
        f" (apart: {s['early']} failing before step {EARLY_BEFORE}, {s['censored']} censored)",
        f"paging alerts on {s['stable']} stable runs: {s['stable_alerts']} (baseline z>{BASELINE_Z:g}: "
        f"{s['baseline_stable_alerts']})",
        f"transient runs resolved within {RESOLVE_TARGET} steps of recovery: {s['transient_resolved']} / "
        f"{s['transient']}",
        f"total lead {s['lead']}; baseline at z>{report.matched_z:.3g} (no alarm on the stable runs): "
        f"{s['matched_lead']} -> {_ratio(s['ratio_matched'])}; at z>{BASELINE_Z:g}: {s['baseline_lead']} -> "
        f"{_ratio(s['ratio_literal'])}",
    ]
    return "\n".join(out)


def _ratio(x: float) -> str:
    return "inf (baseline lead 0)" if math.isinf(x) else f"{x:.1f}x"
