"""What the divergence predictors hand to the alerting side: the contract between `monitor.predictors`
(pure, incremental, per run) and `monitor.alerting` (lifecycle, storage, webhooks, Prometheus).

A predictor observes a run's ingest batches in order and returns one `Assessment` per step it evaluated.
An assessment carries the run's risk, what drove it, the culprit layers/sites, and the `findings`: the
conditions that hold at that step. Findings are level-triggered (a condition that still holds is reported
again at every evaluation); the alert lifecycle turns them into de-duplicated alerts:

* an alert's identity (fingerprint) is (run, rule, layer, site);
* pending when its finding first appears; firing once the finding has held for `for_steps` steps
  (0: fires at once, as non-finite values do); a pending alert whose finding disappears is dropped;
* a firing alert resolves when its finding has been absent for `RESOLVE_AFTER_STEPS` steps;
* a finding of higher severity for a firing alert raises the alert's severity.

"First alert" in the benchmarks means the first step at which an alert of severity warning or critical
fires under these rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEVERITIES = ("info", "warning", "critical")
RESOLVE_AFTER_STEPS = 50


@dataclass(frozen=True)
class Finding:
    rule: str  # e.g. "nonfinite", "kurtosis_growth", "amax_saturation", "underflow_rise", "loss_spike"
    severity: str  # one of SEVERITIES
    step: int
    message: str  # one line for people: what, where, how much
    layer: str | None = None
    site: str | None = None
    value: float | None = None  # the signal's value that triggered it
    for_steps: int = 0  # steps the condition must hold before the alert fires

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")


@dataclass
class Assessment:
    run: str
    step: int
    risk: float  # 0 (healthy) .. 1 (diverging now)
    steps_to_divergence: float | None = None  # estimate; None when no trend points at divergence
    signals: dict[str, float] = field(default_factory=dict)  # signal name -> its score at this step
    culprits: list[dict] = field(default_factory=list)  # [{"layer", "site", "signal", "value", "ratio"}], worst first
    findings: list[Finding] = field(default_factory=list)
    # run-level aggregates for Prometheus (bounded labels): e.g. "worst_kurtosis", "worst_underflow_frac",
    # "worst_overflow_frac", "loss", "grad_norm"
    gauges: dict[str, float] = field(default_factory=dict)
