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


def significant(values: np.ndarray, digits: int) -> np.ndarray:
    """`values` rounded to `digits` significant digits, each the double nearest its short decimal (so JSON writes
    1.234, not 1.2339999999999999); zero, non-finite and tiny (|x| <= 1e-290) values stay as they are."""
    out = values.astype(np.float64, copy=True)
    ok = np.isfinite(out) & (np.abs(out) > 1e-290)  # 10**shift stays finite
    v = out[ok]
    shift = digits - 1 - np.floor(np.log10(np.abs(v))).astype(np.int64)
    up = shift >= 0  # scale by an exact power of ten, round to an integer, scale back: one correctly rounded step
    v[up] = np.round(v[up] * 10.0 ** shift[up]) / 10.0 ** shift[up]
    v[~up] = np.round(v[~up] / 10.0 ** -shift[~up]) * 10.0 ** -shift[~up]
    out[ok] = v
    return out
