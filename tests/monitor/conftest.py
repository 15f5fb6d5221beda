"""Fixtures of the query and rollup tests: writing known data through the Store, and brute-force references."""

import math

import numpy as np
import pytest

from fp8mon.monitor.wire import IngestBatch


def _value(x):
    return None if x is None else float(x)


class Kit:
    """Helpers shared by the query/rollup tests (a fixture, since conftest modules are not importable)."""

    @staticmethod
    def ingest(store, run, *, steps, layers, values, site="input", rank=0, batch_steps=5000, scalars=None,
               batch_prefix=None, run_meta=None):
        """Write values[stat][i][j] (step i, layer j; None = not reported) and scalars[name][i] in batches."""
        steps = list(steps)
        prefix = batch_prefix or f"{run}-{site}-{rank}-{steps[0] if steps else 0}"
        for b, lo in enumerate(range(0, max(len(steps), 1), batch_steps)):
            chunk = steps[lo:lo + batch_steps]
            body = {"version": 1, "batch_id": f"{prefix}-{b}", "run": run}
            if run_meta is not None and b == 0:
                body["run_meta"] = run_meta
            if layers and values is not None:
                body["tensors"] = {
                    "step": [s for s in chunk for _ in layers],
                    "layer": [layer for _ in chunk for layer in layers],
                    "site": [site] * (len(chunk) * len(layers)),
                    "rank": rank,
                    "stats": {stat: [_value(arr[lo + i][j]) for i in range(len(chunk)) for j in range(len(layers))]
                              for stat, arr in values.items()},
                }
            if scalars:
                names = list(scalars)
                body["scalars"] = {"step": [s for s in chunk for _ in names],
                                   "name": [n for _ in chunk for n in names],
                                   "value": [_value(scalars[n][lo + i]) for i in range(len(chunk)) for n in names],
                                   "rank": rank}
            store.ingest(IngestBatch.model_validate(body))

    @staticmethod
    def bucket(pairs):
        """Brute-force aggregates of [(step, value)] (one bucket, sorted by step): the documented semantics."""
        pairs = sorted(pairs)
        present = [v for _, v in pairs if v is not None]
        out = {"n": len(present), "count": len(pairs), "step_first": pairs[0][0] if pairs else None,
               "step_last": pairs[-1][0] if pairs else None, "last": pairs[-1][1] if pairs else None}
        if not present:
            out.update(min=None, max=None, sum=None, mean=None)
        elif any(math.isnan(v) for v in present):
            out.update(min=math.nan, max=math.nan, sum=math.nan, mean=math.nan)
        else:
            total = math.fsum(present) if all(math.isfinite(v) for v in present) else sum(present)
            out.update(min=min(present), max=max(present), sum=total, mean=total / len(present))
        return out

    @staticmethod
    def decode(v):
        """A JSON value of the API back to a float ("NaN", "Infinity", "-Infinity" strings)."""
        if isinstance(v, str):
            return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[v]
        return v

    @staticmethod
    def same(a, b) -> bool:
        a, b = Kit.decode(a), Kit.decode(b)
        if a is None or b is None:
            return a is None and b is None
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b

    @staticmethod
    def dyadic(rng, shape, scale=64):
        """Random values k/8: sums stay exact in float64 whatever the summation order."""
        return rng.integers(-scale * 8, scale * 8, size=shape).astype(np.float64) / 8


@pytest.fixture(scope="session")
def kit():
    return Kit
