"""Export a stored run as wire-format ingest batches (docs/wire-format.md), in step order: what
`fp8mon export` writes and what the labelled-run fixtures hold. POSTing the batches to /api/v1/ingest of
another monitor recreates the run (statistics, scalars, config, tags and status)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from fp8mon.agent.wire import TENSOR_STATS, WIRE_VERSION
from fp8mon.monitor.storage import AbstractStore


def export_run(store: AbstractStore, name: str, *, steps_per_batch: int = 10, stats: tuple[str, ...] = TENSOR_STATS,
               hist: bool = True) -> list[dict]:
    """The run `name` as ingest batch dicts of `steps_per_batch` consecutive stored steps each (tensor
    records of every rank, and scalars), `stats` (a subset of TENSOR_STATS) and, with `hist`, the log2
    histograms. The first batch carries the run's config and tags, the last its status. Non-finite values
    are floats (json.dumps writes them as NaN/Infinity, which the server accepts)."""
    unknown = set(stats) - set(TENSOR_STATS)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}")
    run = store.export_rows(name, stats=tuple(stats), hist=hist)
    tensors, scalars = defaultdict(list), defaultdict(list)
    for row in run.tensor_rows:
        tensors[row[0]].append(row)
    for row in run.scalar_rows:
        scalars[row[0]].append(row)
    steps = sorted(set(tensors) | set(scalars))
    batches = []
    for i in range(0, len(steps), steps_per_batch):
        chunk = steps[i:i + steps_per_batch]
        batch = {"version": WIRE_VERSION, "batch_id": f"export-{chunk[0]}-{chunk[-1]}", "run": name}
        rows = [r for s in chunk for r in tensors.get(s, ())]
        if rows:
            batch["tensors"] = _tensor_block(rows, stats, hist)
        rows = [r for s in chunk for r in scalars.get(s, ())]
        if rows:
            batch["scalars"] = {"step": [r[0] for r in rows], "name": [r[2] for r in rows],
                                "value": [r[3] for r in rows], "rank": [r[1] for r in rows]}
        batches.append(batch)
    meta = {"config": run.config, "tags": run.tags}
    if not batches:
        return [{"version": WIRE_VERSION, "batch_id": "export-meta", "run": name,
                 "run_meta": {**meta, "status": run.status}}]
    batches[0]["run_meta"] = meta
    batches[-1].setdefault("run_meta", {})["status"] = run.status
    return batches


def _tensor_block(rows: list[tuple], stats: tuple[str, ...], hist: bool) -> dict:
    block = {"step": [r[0] for r in rows], "layer": [r[2] for r in rows], "site": [r[3] for r in rows],
             "rank": [r[1] for r in rows], "stats": {}}
    for j, name in enumerate(stats, start=4):
        values = [r[j] for r in rows]
        if name in ("numel", "nonfinite"):  # counts travel as integers
            values = [None if v is None or v != v else int(v) for v in values]
        if any(v is not None for v in values):
            block["stats"][name] = values
    if hist:
        j = 4 + len(stats)
        hists = [None if r[j] is None else np.frombuffer(r[j], dtype="<i8").tolist() for r in rows]
        if any(h is not None for h in hists):
            block["log2_hist"] = hists
    return block
