"""Synthetic ingest streams (wire-format batch dicts) for the server and Prometheus tests."""

LAYERS = [f"blocks.{i}.{part}" for i in range(2) for part in ("attn.qkv", "mlp.fc1")]


def kurtosis_stream(run: str, steps: range, kurtosis, per_batch: int = 10, loss=lambda step: 2.0):
    """Batches with every layer's input kurtosis (3.0, except `kurtosis(step)` on blocks.1.mlp.fc1) and a loss."""
    steps = list(steps)
    for lo in range(0, len(steps), per_batch):
        chunk = steps[lo:lo + per_batch]
        yield {
            "version": 1, "batch_id": f"{run}-{chunk[0]}", "run": run,
            "tensors": {"step": [s for s in chunk for _ in LAYERS], "layer": LAYERS * len(chunk),
                        "site": ["input"] * (len(chunk) * len(LAYERS)),
                        "stats": {"kurtosis": [kurtosis(s) if layer == "blocks.1.mlp.fc1" else 3.0
                                               for s in chunk for layer in LAYERS],
                                  "underflow_frac": [0.001] * (len(chunk) * len(LAYERS)),
                                  "overflow_frac": [0.0] * (len(chunk) * len(LAYERS))}},
            "scalars": {"step": chunk, "name": ["loss"] * len(chunk), "value": [loss(s) for s in chunk]},
        }


FAKE_PREDICTOR = "tests.integration.fake_predictor:ThresholdPredictor"
LAYER_PREDICTOR = "tests.integration.fake_predictor:LayerPredictor"
SITES = ("input", "weight", "grad_output")


def layer_stream(run: str, steps: range, kurtosis, underflow=lambda step, layer, site: 0.0, per_batch: int = 10,
                 status: str | None = None):
    """Batches with every layer and site's kurtosis(step, layer, site) and underflow(step, layer, site) (a 2-block
    model: 4 layers x 3 sites); the last batch carries run_meta.status `status` when given."""
    steps = list(steps)
    where = [(layer, site) for layer in LAYERS for site in SITES]
    for lo in range(0, len(steps), per_batch):
        chunk = steps[lo:lo + per_batch]
        body = {
            "version": 1, "batch_id": f"{run}-{chunk[0]}", "run": run,
            "tensors": {"step": [s for s in chunk for _ in where], "layer": [lay for _ in chunk for lay, _ in where],
                        "site": [site for _ in chunk for _, site in where],
                        "stats": {"kurtosis": [kurtosis(s, lay, site) for s in chunk for lay, site in where],
                                  "underflow_frac": [underflow(s, lay, site) for s in chunk for lay, site in where]}},
        }
        if status is not None and lo + per_batch >= len(steps):
            body["run_meta"] = {"status": status}
        yield body


def fake_predictor_env() -> dict:
    """The environment of a server process that runs the fake predictor."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    return {"FP8MON_PREDICTOR": FAKE_PREDICTOR,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
