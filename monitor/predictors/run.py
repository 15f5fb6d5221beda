"""`RunPredictor`: the divergence predictors of one run, fed its ingest batches in order.

Each step present in a batch (tensor statistics or scalars) is evaluated once, in step order, and gives
one `Assessment`. Tensor signals update on reporting steps and report their last state again on the steps
in between (findings are level-triggered). Records for a step at or below the last evaluated one (a late
or resent batch) are not evaluated again; they are counted in `late_steps`.

Risk: every signal scores in [0, 1] (0 below half its warning threshold, 0.5 at it, 1 from 1.5x on;
monitor.predictors.base.score_of); the run's risk is the worst score, so risk >= 0.5 means that some
signal is at a warning level now, and it is 1 while non-finite values or the divergence condition hold.
"""

from __future__ import annotations

import numpy as np

from fp8mon.monitor.assessment import Assessment
from fp8mon.monitor.predictors.base import SignalOutput
from fp8mon.monitor.predictors.frames import SlotTable, StepFrame, split_steps
from fp8mon.monitor.predictors.kurtosis import KurtosisGrowth
from fp8mon.monitor.predictors.nonfinite import NonFinite
from fp8mon.monitor.predictors.params import PredictorParams
from fp8mon.monitor.predictors.saturation import AmaxSaturation, UnderflowRise
from fp8mon.monitor.predictors.scalars import Growth, LossDivergence, Spike
from fp8mon.monitor.predictors.schedule import LrSchedule, Warmup, WarmupStall
from fp8mon.monitor.wire import IngestBatch


class RunPredictor:
    def __init__(self, run: str, config: dict | None = None, params: PredictorParams | None = None):
        self.run, self.config = run, config or {}
        p = self.params = params or PredictorParams()
        self.table = SlotTable()
        w = self.warmup = Warmup(p)  # its end follows the reported lr; every baseline waits for it
        self.tensor_signals = [KurtosisGrowth(p, w), AmaxSaturation(p, w), UnderflowRise(p, w)]
        a = p.scalar_alpha_steps
        self.lr_schedule, self.loss_divergence = LrSchedule(p, w), LossDivergence(p)  # they hold events
        self.scalar_signals = [
            self.lr_schedule,
            WarmupStall(p, w),
            Spike("loss_spike", "loss", p.loss_spike_z, p, log=False),
            Spike("grad_norm_spike", "grad_norm", p.grad_norm_spike_z, p, log=True),
            Growth("loss_drift", "loss", p.loss_drift, p, log=False, warmup=w, alpha=p.slow_alpha,
                   for_steps=p.drift_for_steps, alpha_steps=1, clip_rise=p.drift_clip * p.loss_drift),
            Growth("grad_norm_growth", "grad_norm", p.grad_norm_rise, p, log=True, warmup=w, alpha=p.slow_alpha,
                   for_steps=p.drift_for_steps, alpha_steps=1),
            Growth("attn_logit_growth", "attn_max_logit", p.attn_logit_rise, p, log=True, warmup=w,
                   alpha_steps=a, level=p.attn_logit_level),
            Growth("adam_update_growth", "adam_update_rms", p.adam_update_rise, p, log=True, warmup=w,
                   alpha_steps=a),
            Growth("logsumexp_drift", "logit_logsumexp", p.logsumexp_rise, p, log=False, warmup=w,
                   pages=p.logsumexp_pages, alpha_steps=a),
            self.loss_divergence,
        ]
        self.nonfinite = NonFinite()
        self.last_step: int | None = None
        self.late_steps = 0
        self.gauges: dict[str, float] = {}

    def observe(self, batch: IngestBatch) -> list[Assessment]:
        out = []
        for frame in split_steps(batch, self.table):
            if self.last_step is not None and frame.step <= self.last_step:
                self.late_steps += 1
                continue
            out.append(self._evaluate(frame))
            self.last_step = frame.step
        return out

    def _evaluate(self, frame: StepFrame) -> Assessment:
        step, table = frame.step, self.table
        self.warmup.observe(step, frame.scalars.get("lr"))
        tensors = frame.has_tensors
        outputs: dict[str, SignalOutput] = {}
        for signal in self.tensor_signals:
            if tensors:
                signal.update(frame, table)
            outputs[signal.name] = signal.evaluate(step, table, updated=tensors)
        for signal in self.scalar_signals:
            outputs[signal.name] = signal.observe(step, frame.scalars)
        outputs[self.nonfinite.name] = self.nonfinite.observe(frame, table)
        self.warmup.observe_event(step, self.lr_schedule.holding or self.loss_divergence.holding)
        self._update_gauges(frame)

        risk = max(o.score for o in outputs.values())
        estimates = [o.steps_to_divergence for o in outputs.values() if o.steps_to_divergence is not None]
        culprits = sorted((c for o in outputs.values() for c in o.culprits), key=lambda c: -c["ratio"])
        return Assessment(
            run=self.run, step=step, risk=risk,
            steps_to_divergence=min(estimates) if estimates else None,
            signals={name: o.score for name, o in outputs.items() if o.score > 0},
            culprits=culprits[:10],
            findings=[f for o in outputs.values() for f in o.findings],
            gauges=dict(self.gauges),
        )

    def _update_gauges(self, frame: StepFrame) -> None:
        if frame.has_tensors:
            for gauge, stat in (("worst_kurtosis", "kurtosis"), ("worst_underflow_frac", "underflow_frac"),
                                ("worst_overflow_frac", "overflow_frac")):
                row = frame.stats.get(stat)
                if row is not None:
                    worst = np.fmax.reduce(np.where(np.isfinite(row), row, np.nan))
                    if worst == worst:
                        self.gauges[gauge] = float(worst)
        for name in ("loss", "grad_norm"):
            if name in frame.scalars:
                self.gauges[name] = frame.scalars[name]
