"""GET /api/v1/runs/{run}/series and /heatmap: downsampled reads (storage.series)."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from fp8mon.agent.wire import SITES, TENSOR_STATS
from fp8mon.monitor.api_models import HeatmapOut, SeriesOut
from fp8mon.monitor.deps import StoreDep, require_read
from fp8mon.monitor.routers.common import ERRORS, RunPath, SafeJSONResponse, http_errors

router = APIRouter(tags=["series"], dependencies=[require_read])

Stat = Literal[TENSOR_STATS]  # type: ignore[valid-type]
Site = Literal[SITES]  # type: ignore[valid-type]
StepParam = Annotated[int | None, Query(ge=0, le=2**62)]
RankParam = Annotated[int, Query(ge=-1, le=32767, description="rank (-1: reduced over all ranks)")]


@router.get("/runs/{run:path}/series", response_model=SeriesOut, responses=ERRORS,
            summary="One statistic of one layer x site, or one scalar, over a step range")
def get_series(
    store: StoreDep,
    run: RunPath,
    stat: Annotated[Stat | None, Query(description="tensor statistic (with layer and site)")] = None,
    layer: Annotated[str | None, Query(max_length=300)] = None,
    site: Annotated[Site | None, Query()] = None,
    scalar: Annotated[str | None, Query(max_length=200, description="a scalar (loss, grad_norm, ...) "
                                                                     "instead of stat/layer/site")] = None,
    rank: RankParam = 0,
    worst_over_ranks: Annotated[bool, Query(description="each point the largest over the series' ranks, a NaN "
                                                        "winning; in buckets each aggregate the largest of the ranks' "
                                                        "(rank is ignored; the merged rank -1 only if it is the only "
                                                        "one)")] = False,
    start: Annotated[int | None, Query(ge=0, le=2**62, description="first step (default: the run's first)")] = None,
    end: Annotated[int | None, Query(ge=0, le=2**62, description="last step, inclusive (default: the run's "
                                                                  "last)")] = None,
    max_points: Annotated[int, Query(ge=1, le=10_000, description="at most this many points; a longer range "
                                                                  "comes as min/max/mean/last buckets")] = 1000,
):
    """Raw points when the range has at most `max_points` steps; else buckets of `bucket_width` steps, each
    with its min, max, mean, last and count (never sampling: a one-step spike or NaN shows in its bucket).
    Non-finite values come as the strings "NaN", "Infinity", "-Infinity"."""
    with http_errors():
        return SafeJSONResponse(store.series(run, stat=stat, layer=layer, site=site, scalar=scalar,
                                             rank=None if worst_over_ranks else rank, start=start, end=end,
                                             max_points=max_points).to_dict())


@router.get("/runs/{run:path}/heatmap", response_model=HeatmapOut, responses=ERRORS,
            summary="Layer x step matrix of one statistic at one site")
def get_heatmap(
    store: StoreDep,
    run: RunPath,
    stat: Annotated[Stat, Query(description="tensor statistic")],
    site: Annotated[Site, Query()] = "input",
    agg: Annotated[Literal["max", "min", "mean", "last"], Query(description="per-bucket aggregate")] = "max",
    rank: RankParam = 0,
    worst_over_ranks: Annotated[bool, Query(description="each cell the largest over the run's ranks (rank is "
                                                        "ignored; the merged rank -1 only if it is the only one)")]
    = False,
    start: StepParam = None,
    end: StepParam = None,
    max_points: Annotated[int, Query(ge=1, le=4000, description="at most this many columns")] = 1000,
    top: Annotated[int | None, Query(ge=1, le=10_000, description="only the k layers whose largest cell is largest "
                                                                   "(NaN and infinities first), worst first")]
    = None,
    digits: Annotated[int | None, Query(ge=1, le=17, description="values rounded to this many significant digits "
                                                                 "(default: as stored)")] = None,
):
    """Rows are the run's layers with that site in model order; columns are step buckets
    (`edges[i]` to `edges[i+1]`); each cell is the bucket's `agg` (a NaN in the bucket makes max, min
    and mean NaN). null: nothing reported there. `run_ranks` lists the ranks holding this site's statistics:
    a map of a rank not among them is empty."""
    with http_errors():
        heatmap = store.heatmap(run, stat=stat, site=site, rank=None if worst_over_ranks else rank, start=start,
                                end=end, max_points=max_points, agg=agg, top=top, digits=digits)
    return SafeJSONResponse(heatmap.to_dict())
