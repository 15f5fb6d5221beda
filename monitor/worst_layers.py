"""The "worst k layers" of a heatmap: at hundreds of layers one anomalous row is a line a pixel high, so the view
keeps the k rows whose largest cell is largest (a NaN or an infinity counts as the largest of all), worst first."""

import dataclasses
import math

from fp8mon.monitor.storage.entities import Heatmap


def row_score(row: list) -> float:
    """The largest value of a heatmap row as the API writes it (numbers, "NaN"/"Infinity" strings, null)."""
    best = -math.inf
    for value in row:
        if isinstance(value, str):
            if value != "-Infinity":
                return math.inf
            continue
        if value is not None and value > best:
            best = value
    return best


def worst_layers(heatmap: Heatmap, k: int) -> Heatmap:
    """The k rows with the largest values, worst first (ties in model order); rows with no value never rank."""
    scored = [(row_score(row), i) for i, row in enumerate(heatmap.values) if any(v is not None for v in row)]
    keep = [i for _, i in sorted(scored, key=lambda t: (-t[0], t[1]))[:k]]
    return dataclasses.replace(heatmap, layers=[heatmap.layers[i] for i in keep],
                               values=[heatmap.values[i] for i in keep], top=k)
