"""Divergence predictors: pure, incremental, per run (docs/prediction-reference.md).

    predictor = RunPredictor("run-1")
    for batch in batches:                     # monitor.wire.IngestBatch, in arrival order
        for assessment in predictor.observe(batch):
            ...                               # monitor.assessment.Assessment, one per evaluated step
"""

from fp8mon.monitor.predictors.divergence import DivergenceDetector, divergence_step
from fp8mon.monitor.predictors.params import PredictorParams
from fp8mon.monitor.predictors.run import RunPredictor

__all__ = ["DivergenceDetector", "PredictorParams", "RunPredictor", "divergence_step"]
