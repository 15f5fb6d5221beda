"""GET /api/v1/runs/{run}/histogram: the stored log2 histograms of one layer x site, with the FP8 format's limits."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from fp8mon.agent.wire import SITES
from fp8mon.monitor.api_models import HistogramOut
from fp8mon.monitor.deps import StoreDep, require_read
from fp8mon.monitor.fp8_formats import FORMATS, SITE_FORMATS, limit_lines
from fp8mon.monitor.routers.common import ERRORS, RunPath, SafeJSONResponse, http_errors

router = APIRouter(tags=["series"], dependencies=[require_read])

Site = Literal[SITES]  # type: ignore[valid-type]


@router.get("/runs/{run:path}/histogram", response_model=HistogramOut, responses=ERRORS,
            summary="Log2 histograms (binades x steps) of one layer x site, with the FP8 format's limits")
def get_histogram(
    store: StoreDep,
    run: RunPath,
    layer: Annotated[str, Query(max_length=300)],
    site: Annotated[Site, Query()],
    rank: Annotated[int, Query(ge=-1, le=32767, description="rank (-1: reduced over all ranks)")] = 0,
    sum_over_ranks: Annotated[bool, Query(description="each step's histograms summed over the run's ranks: the "
                                                      "histogram of all ranks' values together, with every rank's "
                                                      "scales (rank is ignored; the merged rank -1 only if it is "
                                                      "the only one)")] = False,
    start: Annotated[int | None, Query(ge=0, le=2**62)] = None,
    end: Annotated[int | None, Query(ge=0, le=2**62)] = None,
    max_points: Annotated[int, Query(ge=1, le=2000, description="at most this many columns; more histograms "
                                                                 "are summed")] = 300,
    format: Annotated[Literal["e4m3", "e5m2", "none"] | None,
                      Query(description="the FP8 format whose limits to draw (default: the agent's format of the "
                                        "site: E4M3 for input and weight, E5M2 for gradients, none for output)")]
    = None,
):
    """Column i sums the histograms of steps `step[i]`..`step_last[i]`; bin j of `counts[i]` counts
    2^(binade_lo + j) <= |x| < 2^(binade_lo + j + 1). `limits` (null without a format) gives, per column, the
    log2 of |x| above which values overflow and at or below which they quantize to zero at the scale in use."""
    with http_errors():
        hist = store.histograms(run, layer=layer, site=site, rank=None if sum_over_ranks else rank, start=start,
                                end=end, max_points=max_points)
    name = SITE_FORMATS.get(site) if format is None else (None if format == "none" else format)
    limits = None if name is None else limit_lines(FORMATS[name], hist.scale_min, hist.scale_max)
    return SafeJSONResponse({**hist.to_dict(), "limits": limits})
