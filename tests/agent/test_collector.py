"""The collector's vectorised wire block against the oracle's per-row ``Moments.to_stats``."""

from __future__ import annotations

import math

import torch

from fp8mon.agent.collector import tensors_block
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.wire import TENSOR_STATS


def _rows():
    g = torch.Generator().manual_seed(0)
    nanny = torch.randn(3000, generator=g)
    nanny[::97] = float("nan")
    nanny[5::101] = float("inf")
    cases = [
        ds.partials(torch.randn(5000, generator=g) * 3 + 1, fmt="e4m3", scale=2.0),
        ds.partials(torch.randn(4099, generator=g).to(torch.bfloat16), fmt="e5m2", amax_history_max=7.5),
        ds.partials(torch.randn(4099, generator=g) * 1e-6 + 1e4, hist=False),  # large mean, no histogram
        ds.partials(nanny, fmt="e4m3"),
        ds.partials(torch.zeros(300), fmt="e4m3", scale=1.0),  # all zeros: rms 0, kurtosis and crest NaN
        ds.partials(torch.tensor([3.5])),
        ds.partials(torch.zeros(0)),  # empty: observed (parts 1), n 0
        ds.partials(torch.full((64,), float("nan")), fmt="e5m2", scale=4.0),  # nothing finite
        ds.empty(1)[0],  # not observed this step: left out of the block
        ds.partials(torch.randn(777, generator=g) ** 5, fmt="e5m2", scale=0.25),  # heavy tail
    ]
    return torch.stack(cases).numpy()


def _same(got, want) -> bool:
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, int):
        return isinstance(got, int) and got == want
    if math.isnan(want):
        return math.isnan(got)
    return math.isclose(got, want, rel_tol=1e-13, abs_tol=0.0)


def test_block_equals_the_oracle_row_by_row():
    rows = _rows()
    keys = [(f"layer{i}", "input") for i in range(len(rows))]
    block = tensors_block(9, 0, keys, rows)
    seen = [i for i in range(len(rows)) if rows[i, ds.PARTS] > 0]
    assert block["step"] == 9 and block["rank"] == 0
    assert block["layer"] == [keys[i][0] for i in seen] and "layer8" not in block["layer"]
    assert tuple(block["stats"]) == TENSOR_STATS
    for j, i in enumerate(seen):
        want = ds.to_moments(rows[i].tolist()).to_stats()
        for name in TENSOR_STATS:
            got = block["stats"][name][j]
            assert _same(got, want[name]), (keys[i], name, got, want[name])
        assert block["log2_hist"][j] == want.get("log2_hist"), keys[i]


def test_block_without_histograms_or_rows():
    rows = _rows()[2:3]  # the row computed without a histogram
    block = tensors_block(1, -1, [("a", "output")], rows)
    assert "log2_hist" not in block and block["rank"] == -1
    assert tensors_block(1, 0, [("a", "output")], ds.empty(1).numpy()) is None
