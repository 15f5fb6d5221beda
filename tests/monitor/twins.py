"""Runs written through the store as the trainer would report them: a nested config (train.precision, seed,
and what names the run), a loss and the kurtosis of a few layers: twins for the comparison and parity views."""

from fp8mon.monitor.wire import IngestBatch

LAYERS = ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]


def ingest(store, run: str, *, precision: str, seed: int, steps=range(10), loss=lambda s: 2.0, kurtosis=None,
           layers=LAYERS, tag: str = "") -> None:
    """A run with a trainer-like nested config, a loss and the kurtosis of `layers` at the input site."""
    kurtosis = kurtosis or (lambda j, s: 3.0 + j)
    config = {"train": {"precision": precision, "seed": seed, "lr": 0.003, "run_name": run,
                        "monitor_url": f"http://127.0.0.1:{1000 + seed}"}}
    store.ingest(IngestBatch.model_validate({
        "version": 1, "batch_id": f"{run}-{tag}{steps[0]}", "run": run, "run_meta": {"config": config},
        "scalars": {"step": list(steps), "name": ["loss"] * len(steps), "value": [loss(s) for s in steps]},
        "tensors": {"step": [s for s in steps for _ in layers], "layer": list(layers) * len(steps),
                    "site": ["input"] * len(steps) * len(layers),
                    "stats": {"kurtosis": [kurtosis(j, s) for s in steps for j in range(len(layers))]}}}))
