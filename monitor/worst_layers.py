"""The "worst k layers" of a heatmap: at hundreds of layers one anomalous row is a line a pixel high, so the view
keeps the k rows whose largest cell is largest (a NaN or an infinity counts as the largest of all), worst first."""

import numpy as np


def row_scores(values: np.ndarray, null: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the largest value of each row, NaN and +Infinity as +inf; whether the row has any value) of a layer x
    column matrix whose `null` cells hold nothing."""
    cells = np.where(null, -np.inf, values)
    bad = np.isnan(cells) | (cells == np.inf)
    largest = np.where(bad, -np.inf, cells).max(axis=1, initial=-np.inf)
    return np.where(bad.any(axis=1), np.inf, largest), (~null).any(axis=1)


def worst_rows(values: np.ndarray, null: np.ndarray, k: int) -> list[int]:
    """The indices of the k rows with the largest values, worst first (ties in row order); rows with no value
    never rank."""
    score, has = row_scores(values, null)
    rows = np.flatnonzero(has)
    order = np.lexsort((rows, -score[rows]))  # last key first: score descending, then row order
    return rows[order][:k].tolist()
