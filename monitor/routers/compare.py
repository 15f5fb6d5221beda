"""/api/v1/compare: two runs' difference heatmap on one step grid; the FP8-vs-BF16 parity pairs with their
loss gaps (monitor/compare.py)."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from fp8mon.monitor import compare
from fp8mon.monitor.api_models import HeatmapDiffOut, ParityOut
from fp8mon.monitor.deps import StoreDep, require_read
from fp8mon.monitor.routers.common import ERRORS, SafeJSONResponse, http_errors
from fp8mon.monitor.routers.series import RankParam, Site, Stat

router = APIRouter(tags=["compare"], dependencies=[require_read])

RunName = Annotated[str, Query(min_length=1, max_length=200, description="run name")]
Mode = Literal[compare.MODES]  # type: ignore[valid-type]


@router.get("/compare/heatmap", response_model=HeatmapDiffOut, responses=ERRORS,
            summary="Layer x step difference of one statistic between two runs")
def heatmap_difference(
    store: StoreDep, base: RunName, other: RunName,
    stat: Annotated[Stat, Query(description="tensor statistic")],
    site: Annotated[Site, Query()] = "input",
    agg: Annotated[Literal["max", "min", "mean", "last"], Query(description="per-bucket aggregate")] = "max",
    rank: RankParam = 0,
    worst_over_ranks: Annotated[bool, Query(description="each run's cells the largest over its ranks")] = False,
    mode: Annotated[Mode, Query(description="other - base, or log10(other / base)")] = "difference",
    max_points: Annotated[int, Query(ge=1, le=4000, description="at most this many columns")] = 600,
):
    """Rows: the layers both runs have, in `base`'s order (`only_in` lists the others); columns: step buckets
    over the steps both runs have, the coarser run's grid when their buckets differ."""
    with http_errors():
        return SafeJSONResponse(compare.heatmap_difference(
            store, base, other, stat=stat, site=site, agg=agg, rank=None if worst_over_ranks else rank,
            max_points=max_points, mode=mode))


@router.get("/compare/parity", response_model=ParityOut, responses=ERRORS,
            summary="Pairs of runs whose configs differ only in one key, with each pair's loss gap")
def parity(
    store: StoreDep,
    key: Annotated[str | None, Query(max_length=200, description="config key (a dotted path, or its last part); "
                                                                 "default: precision, recipe, ... or the first "
                                                                 "key that differs")] = None,
    reference: Annotated[str | None, Query(max_length=200, description="the key's value each pair is measured "
                                                                       "against (default bf16 if present)")] = None,
    run: Annotated[list[str] | None, Query(description="these runs (repeatable); default: every run matching "
                                                       "name and tag")] = None,
    name: Annotated[str | None, Query(max_length=200, description="as in GET /runs")] = None,
    tag: Annotated[list[str] | None, Query(description="as in GET /runs")] = None,
    ignore: Annotated[list[str] | None, Query(description="config keys (last parts) that may differ too")] = None,
    scalar: Annotated[str, Query(max_length=200)] = "loss",
    max_points: Annotated[int, Query(ge=2, le=5000, description="points per gap curve")] = 400,
):
    with http_errors():
        runs = (compare.runs_named(store, run) if run
                else compare.runs_listed(store, name=name, tags=tag, limit=1000))
        keys = compare.config_keys(runs)
        chosen = key or (keys[0] if keys else "precision")
        pairing = compare.pair_runs(runs, chosen, reference, ignore or ())
        pairs = [{"reference": ref.name, "other": other.name, "value": value,
                  "gap": compare.scalar_gap(store, ref.name, other.name, scalar, max_points)}
                 for ref, other, value in pairing.pairs[:compare.MAX_PAIRS]]
    return SafeJSONResponse({"key": chosen, "reference": pairing.reference, "keys": keys, "pairs": pairs,
                             "more_pairs": max(0, len(pairing.pairs) - compare.MAX_PAIRS),
                             "unpaired": pairing.unpaired})
