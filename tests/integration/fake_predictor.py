"""A deterministic stand-in predictor for server tests (FP8MON_PREDICTOR=tests.integration.fake_predictor:
ThresholdPredictor): the alerting side is tested without depending on the real predictors' tuning.

Per step: the worst kurtosis over layers x sites; above 20 a `kurtosis_growth` warning (critical above 50)
that must hold 5 steps; a non-finite loss is an immediate critical `nonfinite` finding. Risk: worst kurtosis
/ 50, capped at 1 (1 with a non-finite loss).
"""

import math

from fp8mon.monitor.assessment import Assessment, Finding

WARN, CRIT, FOR_STEPS = 20.0, 50.0, 5


class ThresholdPredictor:
    def __init__(self, run, config=None, params=None):
        self.run = run

    def observe(self, batch):
        per_step: dict[int, dict] = {}
        t = batch.tensors
        if t is not None and "kurtosis" in t.stats:
            steps = [t.step] * len(t) if isinstance(t.step, int) else t.step
            for step, layer, site, k in zip(steps, t.layer, t.site, t.stats["kurtosis"]):
                if k is None:
                    continue
                best = per_step.setdefault(step, {})
                if k > best.get("k", -math.inf):
                    best.update(k=k, layer=layer, site=site)
        s = batch.scalars
        if s is not None:
            steps = [s.step] * len(s) if isinstance(s.step, int) else s.step
            for step, name, value in zip(steps, s.name, s.value):
                entry = per_step.setdefault(step, {})
                if name == "loss" and value is not None and not math.isfinite(value):
                    entry["nonfinite"] = True
        out = []
        for step in sorted(per_step):
            e = per_step[step]
            findings, k = [], e.get("k")
            risk = 0.0 if k is None else min(1.0, k / CRIT)
            if k is not None and k > WARN:
                findings.append(Finding(rule="kurtosis_growth", severity="critical" if k > CRIT else "warning",
                                        step=step, layer=e["layer"], site=e["site"], value=k, for_steps=FOR_STEPS,
                                        message=f"kurtosis {k:.1f} at {e['layer']}/{e['site']}"))
            if e.get("nonfinite"):
                risk = 1.0
                findings.append(Finding(rule="nonfinite", severity="critical", step=step, for_steps=0,
                                        message="non-finite loss"))
            out.append(Assessment(run=self.run, step=step, risk=risk,
                                  steps_to_divergence=None if k is None else max(0.0, (CRIT - k) * 10),
                                  signals={"kurtosis": risk}, culprits=[] if k is None else [
                                      {"layer": e["layer"], "site": e["site"], "signal": "kurtosis", "value": k}],
                                  findings=findings, gauges={} if k is None else {"worst_kurtosis": k}))
        return out


class LayerPredictor:
    """One finding per layer and site, as the real predictors raise them: kurtosis above 10 a `kurtosis_growth`
    info (warning above 20, critical above 50) that must hold 5 steps; an underflow fraction above 0.1 an
    immediate `underflow` info."""

    def __init__(self, run, config=None, params=None):
        self.run = run

    def observe(self, batch):
        t = batch.tensors
        per_step: dict[int, list] = {}
        if t is None:
            return []
        steps = [t.step] * len(t) if isinstance(t.step, int) else t.step
        kurtosis = t.stats.get("kurtosis") or [None] * len(steps)
        underflow = t.stats.get("underflow_frac") or [None] * len(steps)
        for step, layer, site, k, u in zip(steps, t.layer, t.site, kurtosis, underflow):
            findings = per_step.setdefault(step, [])
            if k is not None and k > 10:
                severity = "critical" if k > CRIT else "warning" if k > WARN else "info"
                findings.append(Finding(rule="kurtosis_growth", severity=severity, step=step, layer=layer, site=site,
                                        value=k, for_steps=FOR_STEPS, message=f"kurtosis {k:.1f} at {layer}/{site}"))
            if u is not None and u > 0.1:
                findings.append(Finding(rule="underflow", severity="info", step=step, layer=layer, site=site,
                                        value=u, message=f"underflow {u:.2f} at {layer}/{site}"))
        return [Assessment(run=self.run, step=step, risk=0.5 if findings else 0.0, steps_to_divergence=None,
                           signals={}, culprits=[], findings=findings, gauges={})
                for step, findings in sorted(per_step.items())]
