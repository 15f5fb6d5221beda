"""Run comparison, read through the store: a layer x step difference heatmap of two runs on one step grid, and
the FP8-vs-BF16 parity view, which pairs runs whose configs differ only in one key and gives each pair's loss
gap over steps.

Configs are nested dicts; they are compared as flat dotted paths (`train.precision`). A key names a path
exactly or by its last part (`precision`). Paths that name the run rather than the training (its name, the
monitor's address, the spool) never keep two runs apart.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fp8mon.monitor.storage import AbstractStore
from fp8mon.monitor.storage.entities import Heatmap, Run
from fp8mon.monitor.storage.errors import BadParameter, NotFound

# leaf names that identify a run, not how it trains
RUN_IDENTITY = frozenset({"run_name", "monitor_url", "monitor_spool", "out", "resume", "run", "name"})
PREFERRED_KEYS = ("precision", "recipe", "dtype", "fp8")
MODES = ("difference", "log10_ratio")
MAX_PAIRS = 32


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Dotted path -> the value as canonical JSON (so lists and numbers compare as written)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = json.dumps(value, sort_keys=True)
    return out


def resolve_key(flat: dict[str, str], key: str) -> str | None:
    if key in flat:
        return key
    matches = sorted(p for p in flat if p.endswith("." + key))
    return matches[0] if matches else None


def _shown(raw: str) -> str:
    value = json.loads(raw)
    return value if isinstance(value, str) else raw


@dataclass
class Pairing:
    key: str
    reference: str | None
    pairs: list[tuple[Run, Run, str]]  # (reference run, other run, other run's value)
    unpaired: list[str]


def pair_runs(runs: Iterable[Run], key: str, reference: str | None = None,
              ignore: Iterable[str] = ()) -> Pairing:
    """Group runs whose configs are equal but for `key` (and the ignored leaf names); in each group, pair every
    run whose value is not `reference` with the group's first reference run. `reference` defaults to "bf16"
    when some run has it, else to the most common value."""
    ignored = RUN_IDENTITY | set(ignore)
    entries = []
    for run in runs:
        flat = flatten(run.config)
        path = resolve_key(flat, key)
        if path is None:
            entries.append((run, None, None))
            continue
        rest = tuple(sorted((p, v) for p, v in flat.items() if p != path and p.rsplit(".", 1)[-1] not in ignored))
        entries.append((run, _shown(flat[path]), rest))
    values = [v for _, v, _ in entries if v is not None]
    if reference is None and values:
        reference = "bf16" if "bf16" in values else max(sorted(set(values)), key=values.count)
    groups: dict[tuple, list[tuple[Run, str]]] = {}
    unpaired = [run.name for run, v, _ in entries if v is None]
    for run, value, rest in entries:
        if value is not None:
            groups.setdefault(rest, []).append((run, value))
    pairs = []
    for members in groups.values():
        refs = [run for run, value in members if value == reference]
        others = [(run, value) for run, value in members if value != reference]
        if not refs or not others:
            unpaired.extend(run.name for run, _ in members)
            continue
        pairs.extend((refs[0], run, value) for run, value in others)
        unpaired.extend(run.name for run in refs[1:])
    pairs.sort(key=lambda p: (p[0].name, p[1].name))
    return Pairing(key=key, reference=reference, pairs=pairs, unpaired=sorted(unpaired))


def config_keys(runs: Iterable[Run]) -> list[str]:
    """Leaf names whose values differ among the runs (run identity left out), the preferred parity keys first."""
    seen: dict[str, set[str]] = {}
    for run in runs:
        for path, value in flatten(run.config).items():
            leaf = path.rsplit(".", 1)[-1]
            if leaf not in RUN_IDENTITY:
                seen.setdefault(leaf, set()).add(value)
    differing = [k for k, v in seen.items() if len(v) > 1]
    return sorted(differing, key=lambda k: (PREFERRED_KEYS.index(k) if k in PREFERRED_KEYS else len(PREFERRED_KEYS),
                                            k))


# -- aligned reads ---------------------------------------------------------------------------------


def _overlap(store: AbstractStore, names: list[str]) -> tuple[int, int] | None:
    runs = [store.get_run(n).run for n in names]
    if any(r.first_step is None for r in runs):
        return None
    lo, hi = max(r.first_step for r in runs), min(r.last_step for r in runs)
    return (lo, hi) if lo <= hi else None


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def scalar_gap(store: AbstractStore, reference: str, other: str, scalar: str = "loss",
               max_points: int = 500) -> dict:
    """The scalar of both runs on one step grid over the steps both have (bucket means when downsampled), and
    other - reference where both are finite."""
    span = _overlap(store, [reference, other])
    out = {"scalar": scalar, "step": [], "reference": [], "other": [], "gap": [], "bucket_width": 1}
    if span is None:
        return out
    read = {}
    for name in (reference, other):
        try:
            s = store.series(name, scalar=scalar, start=span[0], end=span[1], max_points=max_points)
        except NotFound:
            return out
        points = s.points
        read[name] = dict(zip(points["step"], points.get("value") or points["mean"]))
        out["bucket_width"] = max(out["bucket_width"], s.bucket_width)
    for step in sorted(set(read[reference]) & set(read[other])):
        a, b = _number(read[reference][step]), _number(read[other][step])
        out["step"].append(step)
        out["reference"].append(a)
        out["other"].append(b)
        out["gap"].append(None if a is None or b is None else b - a)
    return out


_COMBINE = {"max": np.nanmax, "min": np.nanmin, "mean": np.nanmean}


def _matrix(h: Heatmap, layers: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Values as floats (missing: NaN) and where the stored value was non-finite."""
    index = {layer: i for i, layer in enumerate(h.layers)}
    rows = [h.values[index[layer]] for layer in layers]
    values = np.array([[v if isinstance(v, (int, float)) else np.nan for v in row] for row in rows], dtype=float)
    bad = np.array([[isinstance(v, str) for v in row] for row in rows], dtype=bool)
    return values.reshape(len(layers), -1), bad.reshape(len(layers), -1)


def _rebucket(values: np.ndarray, bad: np.ndarray, edges: list[int], target: list[int],
              agg: str) -> tuple[np.ndarray, np.ndarray]:
    """Columns of a finer grid folded into the coarser `target` columns that hold their first steps."""
    cols = np.searchsorted(np.array(target), np.array(edges[:-1]), side="right") - 1
    out = np.full((values.shape[0], len(target) - 1), np.nan)
    out_bad = np.zeros_like(out, dtype=bool)
    for c in range(len(target) - 1):
        take = np.flatnonzero(cols == c)
        if not take.size:
            continue
        block = values[:, take]
        with warnings.catch_warnings():  # an all-NaN column is NaN, as meant
            warnings.simplefilter("ignore", RuntimeWarning)
            out[:, c] = _COMBINE[agg](block, axis=1) if agg != "last" else _last(block)
        out_bad[:, c] = bad[:, take].any(axis=1)
    return out, out_bad


def _last(block: np.ndarray) -> np.ndarray:
    out = np.full(block.shape[0], np.nan)
    for i, row in enumerate(block):
        finite = np.flatnonzero(~np.isnan(row))
        if finite.size:
            out[i] = row[finite[-1]]
    return out


def heatmap_difference(store: AbstractStore, base: str, other: str, *, stat: str, site: str, agg: str = "max",
                       rank: int | None = 0, max_points: int = 600, mode: str = "difference") -> dict:
    """`other` minus `base` (or log10 of their ratio) per layer and step bucket, over the layers both runs have
    (in `base`'s order) and the steps both have. A cell is null where either run has nothing, "NaN" where
    either value is non-finite."""
    if mode not in MODES:
        raise BadParameter(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    span = _overlap(store, [base, other])
    out = {"runs": [base, other], "stat": stat, "site": site, "agg": agg, "mode": mode, "layers": [], "edges": [],
           "bucket_width": 1, "values": [], "only_in": {base: [], other: []}}
    if span is None:
        return out
    a, b = (store.heatmap(n, stat=stat, site=site, rank=rank, start=span[0], end=span[1], max_points=max_points,
                          agg=agg) for n in (base, other))
    layers = [layer for layer in a.layers if layer in set(b.layers)]
    out["only_in"] = {base: [x for x in a.layers if x not in set(b.layers)],
                      other: [x for x in b.layers if x not in set(a.layers)]}
    if not layers or len(a.edges) < 2 or len(b.edges) < 2:
        return out
    (va, ba), (vb, bb) = _matrix(a, layers), _matrix(b, layers)
    edges = a.edges
    if a.edges != b.edges:  # different bucket widths: fold the finer grid into the coarser one
        if a.bucket_width >= b.bucket_width:
            vb, bb = _rebucket(vb, bb, b.edges, a.edges, agg)
        else:
            va, ba = _rebucket(va, ba, a.edges, b.edges, agg)
            edges = b.edges
    with np.errstate(all="ignore"):
        diff = vb - va if mode == "difference" else np.log10(vb / va)
    bad = ba | bb
    values = [[("NaN" if bad[i, c] else None) if not np.isfinite(diff[i, c]) or bad[i, c] else float(diff[i, c])
               for c in range(diff.shape[1])] for i in range(diff.shape[0])]
    out.update(layers=layers, edges=edges, bucket_width=max(a.bucket_width, b.bucket_width), values=values)
    return out


def runs_named(store: AbstractStore, names: list[str]) -> list[Run]:
    return [store.get_run(n).run for n in names]


def runs_listed(store: AbstractStore, *, name: str | None, tags: list[str] | None, limit: int) -> list[Run]:
    """Runs matching the run list's filters, oldest first, at most `limit`."""
    page = store.list_runs(name=name, tags=tags, order_by="created_at", limit=limit)
    return list(page.runs)
