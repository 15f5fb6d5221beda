"""Non-finite values anywhere: a critical finding at once (for_steps 0) naming the first layer/site (in
model order) whose statistics count NaN/Inf elements, or the scalar (loss, grad_norm) that went
non-finite when no tensor shows it."""

from __future__ import annotations

import math

import numpy as np

from fp8mon.monitor.assessment import Finding
from fp8mon.monitor.predictors.base import SignalOutput
from fp8mon.monitor.predictors.frames import BAD, SlotTable, StepFrame

RULE = "nonfinite"
WATCHED_SCALARS = ("loss", "grad_norm")


class NonFinite:
    name = RULE

    def observe(self, frame: StepFrame, table: SlotTable) -> SignalOutput:
        findings, culprits = [], []
        bad_row = frame.stats.get(BAD)
        bad = np.flatnonzero(bad_row > 0) if bad_row is not None else np.zeros(0, dtype=np.int64)
        if bad.size:
            layer, site = table.name(int(bad[0]))
            count = frame.stats.get("nonfinite")
            n = count[bad[0]] if count is not None and np.isfinite(count[bad[0]]) else float("nan")
            more = f" (and {bad.size - 1} more tensors)" if bad.size > 1 else ""
            findings.append(Finding(RULE, "critical", frame.step, f"non-finite values first in {layer} {site}"
                                    + (f": {n:.0f} NaN/Inf elements" if n == n else "") + more,
                                    layer=layer, site=site, value=float(bad.size), for_steps=0))
            culprits = [{"layer": table.name(i)[0], "site": table.name(i)[1], "signal": RULE, "value": 1.0,
                         "ratio": 10.0} for i in bad[:5].tolist()]
        scalars = [name for name in WATCHED_SCALARS if name in frame.scalars and not math.isfinite(frame.scalars[name])]
        if scalars and not findings:
            findings.append(Finding(RULE, "critical", frame.step, f"{' and '.join(scalars)} non-finite "
                                    f"({', '.join(str(frame.scalars[s]) for s in scalars)})", for_steps=0))
            culprits = [{"layer": None, "site": None, "signal": RULE, "value": frame.scalars[scalars[0]],
                         "ratio": 10.0}]
        if not findings:
            return SignalOutput()
        return SignalOutput(1.0, findings, culprits, 0.0)
