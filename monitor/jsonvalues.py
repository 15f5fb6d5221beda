"""JSON has no NaN or Infinity: the API writes non-finite floats as the strings "NaN", "Infinity", "-Infinity"."""

import numpy as np

from fp8mon.monitor.wire import finite_or_none


def json_floats(values: np.ndarray, null: np.ndarray | None = None) -> list:
    """A float array as a JSON-ready list: None where null, "NaN"/"Infinity"/"-Infinity" for non-finite."""
    out = values.tolist()
    bad = ~np.isfinite(values)
    if null is not None:
        bad |= null
    for i in np.flatnonzero(bad).tolist():
        out[i] = None if null is not None and null[i] else finite_or_none(out[i])
    return out


def json_safe(obj):
    """Recursively replace non-finite floats (user configs may hold them) by their JSON strings."""
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
