"""agent/stats/torch_path.py (on-device partial statistics, packed rows, exact merge) against the oracle
agent/stats/reference.py on adversarial tensors, and the absence of any host-synchronising op."""

import math
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8mon.agent.formats import E4M3, E5M2, delayed_scale
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.reference import Moments, merge_moments, tensor_stats
from fp8mon.agent.wire import LOG2_HIST_BINS, TENSOR_STATS

NAN = float("nan")
RTOL = 1e-9
EXACT = ("numel", "nonfinite", "amax", "zero_frac", "outlier_frac", "underflow_frac", "overflow_frac", "scale",
         "amax_history_max", "log2_hist")

# Ops that make the host wait for the device on CUDA: values read back, data-dependent shapes, host data
# copied in (lift_fresh: `t[i] = 1.0`, torch.tensor(...)). histc with explicit bounds does not sync.
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount", "is_nonzero", "equal",
            "repeat_interleave",
            "lift_fresh", "item")


class OpRecorder(TorchDispatchMode):
    """Records the aten ops dispatched on this thread."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("aten::index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for a in args if isinstance(a, (list, tuple)) for i in a):
            name = "aten::index(bool mask)"  # boolean indexing: nonzero inside
        self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def syncs(self) -> list[str]:
        return [op for op in self.ops if any(s in op for s in SYNC_OPS) or "bool mask" in op]


def _cases():
    r = np.random.default_rng(99)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))  # noqa: E731
    special = r.standard_normal(2000).astype(np.float32)
    special[[1, 2, 3, 500, 1999]] = [np.nan, np.inf, -np.inf, np.nan, 0.0]
    shifted = (300 + r.standard_normal(4000)).astype(np.float32)
    shifted[[0, 10]] = [np.inf, 400.0]
    wide = (np.sign(r.standard_normal(6000)) * 10.0 ** r.uniform(-45, 6, 6000)).astype(np.float32)
    wide[:30] = 0.0
    tiny = (r.standard_normal(3000) * 2.0**-11).astype(np.float32)  # underflows in E4M3 at scale 1
    return {
        "normal": t(r.standard_normal((32, 48))),
        "large_mean": t(1e4 + 1e-2 * r.standard_normal(8000)),
        "heavy_tails": t(0.05 * r.standard_t(2.2, 12000)),
        "lognormal": t(np.exp(2 * r.standard_normal(5000))),
        "wide_range_subnormals": t(wide),
        "tiny": t(tiny),
        "zeros": torch.zeros(513),
        "constant": torch.full((999,), 0.1),
        "nonfinite": t(special),
        "nonfinite_shifted": t(shifted),
        "all_nonfinite": torch.tensor([NAN, math.inf, -math.inf]),
        "single": torch.tensor([-7.25]),
        "single_zero": torch.tensor([0.0]),
        "empty": torch.empty(0, 4),
        "bf16": (0.02 * torch.from_numpy(r.standard_normal((40, 24)))).to(torch.bfloat16),
        "fp16_with_inf": torch.tensor([1.0, 65504.0, -3.0, math.inf], dtype=torch.float16),
        "fp64": torch.from_numpy(r.standard_normal(700) * 1e-3),
    }


CASES = _cases()
CONFIGS = {
    "nofmt": {},
    "e4m3_current": {"fmt": "e4m3"},
    "e5m2_current": {"fmt": "e5m2"},
    "e4m3_delayed_stale": {"fmt": "e4m3", "amax_history_max": 0.25},
    "e5m2_delayed_tensor": {"fmt": E5M2, "amax_history_max": torch.tensor(0.1)},
    "e4m3_scale_tensor": {"fmt": "e4m3", "scale": torch.tensor(3.0e3), "amax_history_max": 1.5},
    "e5m2_scale_float_k3_nohist": {"fmt": "e5m2", "scale": 0.37, "outlier_k": 3.0, "hist": False},
}


def oracle_kwargs(kw):
    out = dict(kw)
    for key in ("scale", "amax_history_max"):
        if isinstance(out.get(key), torch.Tensor):
            out[key] = float(out[key])
    return out


def assert_same_stats(got: dict, want: dict, rtol=RTOL):
    assert list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        if key in EXACT or w is None or isinstance(w, int):
            same = g == w or (isinstance(w, float) and math.isnan(w) and math.isnan(g))
            assert same, (key, g, w)
        elif math.isnan(w):
            assert math.isnan(g), (key, g)
        else:
            assert math.isclose(g, w, rel_tol=rtol), (key, g, w)


def row_stats(row: torch.Tensor) -> dict:
    return ds.to_moments(row.tolist()).to_stats()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_partials_equal_the_oracle(case, config):
    x, kw = CASES[case], CONFIGS[config]
    row = ds.partials(x, **kw)
    assert row.shape == (ds.WIDTH,) and row.dtype == torch.float64 and row[ds.PARTS] == 1
    want = tensor_stats(x, **oracle_kwargs(kw))
    assert_same_stats(row_stats(row), want)
    m, w = ds.to_moments(row.tolist()), Moments.from_tensor(x, **oracle_kwargs(kw))
    assert (m.numel, m.n, m.zeros, m.nonzero, m.nonfinite, m.outliers, m.underflow, m.overflow, m.hist) == (
        w.numel, w.n, w.zeros, w.nonzero, w.nonfinite, w.outliers, w.underflow, w.overflow, w.hist)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partials_on_cuda_equal_the_oracle():
    cuda = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v  # noqa: E731
    for case, x in CASES.items():
        for config, kw in CONFIGS.items():
            row = ds.partials(x.cuda(), **{k: cuda(v) for k, v in kw.items()})
            assert row.device.type == "cuda"
            assert_same_stats(row_stats(row.cpu()), tensor_stats(x, **oracle_kwargs(kw)))
    rows = torch.stack([ds.partials(p.cuda(), fmt="e5m2", scale=512.0) for p in split(CASES["heavy_tails"], [5, 999])])
    want = Moments.from_tensor(CASES["heavy_tails"], fmt="e5m2", scale=512.0).to_stats()
    got = row_stats(ds.merge_all(rows).cpu())
    assert_same_stats({k: v for k, v in got.items() if k != "outlier_frac"},
                      {k: v for k, v in want.items() if k != "outlier_frac"})


def test_long_tensor_against_the_oracles_blockwise_merge():
    """The oracle merges 1000-element blocks; partials reads the tensor at once: same statistics."""
    x = torch.randn(20_011, generator=torch.Generator().manual_seed(3)) * 4 + 50
    x[::997] = 0.0
    want = Moments.from_tensor(x, fmt="e4m3", block_size=1000).to_stats()
    assert_same_stats(row_stats(ds.partials(x, fmt="e4m3")), want)


@pytest.mark.parametrize("case", CASES)
def test_outliers_against_a_given_center_equal_the_oracle(case):
    """The reference of the Triton path's outliers: counted against a given (mean, std), e.g. the previous
    step's; as numbers or as an fp64 tensor of 2. A NaN std counts none."""
    x = CASES[case]
    for center in ((0.0, 1.0), (0.25, 0.01)):
        want = Moments.from_tensor(x, outlier_center=center, outlier_k=3.0).outliers
        assert ds.partials(x, outlier_center=center, outlier_k=3.0)[ds.OUTLIERS] == want
        t = torch.tensor(center, dtype=torch.float64)
        assert ds.partials(x, outlier_center=t, outlier_k=3.0)[ds.OUTLIERS] == want
    assert ds.partials(x, outlier_center=(0.0, NAN))[ds.OUTLIERS] == 0


def test_underflow_and_overflow_are_counted():
    """Non-vacuous: the adversarial configurations do produce underflow and overflow."""
    tiny = row_stats(ds.partials(CASES["tiny"], fmt="e4m3", scale=1.0))
    assert 0 < tiny["underflow_frac"] < 1
    stale = row_stats(ds.partials(CASES["heavy_tails"], fmt="e4m3", amax_history_max=0.25))
    assert stale["overflow_frac"] > 0 and stale["scale"] == 448 / 0.25 and stale["amax_history_max"] == 0.25
    assert row_stats(ds.partials(CASES["heavy_tails"], fmt="e4m3"))["overflow_frac"] == 0.0


def test_scale_from_amax_is_rounded_once_like_the_oracle():
    r = torch.Generator().manual_seed(5)
    amax = torch.cat([torch.rand(3000, generator=r) * 10.0 ** torch.randint(-30, 30, (3000,), generator=r),
                      torch.tensor([0.0, NAN, math.inf, -1.0])])
    for fmt in (E4M3, E5M2):
        for margin in (0, 2):
            got = ds.scale_from_amax(amax, fmt, margin)
            want = torch.tensor([delayed_scale([float(a)], fmt, margin) for a in amax], dtype=torch.float32)
            assert got.dtype == torch.float32 and torch.equal(got, want)


# ---- merging ------------------------------------------------------------------------------------

def split(x, cuts):
    flat = x.reshape(-1)
    bounds = [0, *sorted(min(c, flat.numel()) for c in cuts), flat.numel()]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", ["large_mean", "heavy_tails", "nonfinite", "nonfinite_shifted", "zeros",
                                  "wide_range_subnormals", "lognormal"])
def test_merge_equals_the_whole_tensor(case):
    x = CASES[case]
    n = x.numel()
    kw = {"fmt": "e5m2", "scale": 512.0}  # one scale for all parts: every count merges exactly
    parts = split(x, [0, 0, 1, 2, 2, 5, n // 3, n // 3 + 1, n - 1, n])
    rows = [ds.partials(p, **kw) for p in parts]
    whole = Moments.from_tensor(x, **kw).to_stats()
    oracle_merge = merge_moments(Moments.from_tensor(p, **kw) for p in parts).to_stats()
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    candidates = [ds.merge_all(torch.stack(rows)), ds.merge_all(torch.stack([rows[i] for i in order]))]
    acc = ds.empty(1)[0]
    for r in reversed(rows):
        acc = ds.merge(r, acc)
    candidates.append(acc)
    for merged in candidates:
        assert merged[ds.PARTS] == len(parts)
        got = row_stats(merged)
        assert_same_stats({k: v for k, v in got.items() if k != "outlier_frac"},
                          {k: v for k, v in whole.items() if k != "outlier_frac"})
        assert got["outlier_frac"] == oracle_merge["outlier_frac"]  # per part, as the oracle documents


def test_merge_has_every_cross_term():
    """Parts with different sizes, means and skew, so a dropped M3/M4 term is far outside tolerance."""
    r = np.random.default_rng(7)
    a = torch.from_numpy((r.exponential(1.0, 300) ** 2).astype(np.float32))
    b = torch.from_numpy((8.0 - 3.0 * r.exponential(1.0, 1700)).astype(np.float32))
    whole = Moments.from_tensor(torch.cat([a, b]))
    for merged in (ds.merge(ds.partials(a), ds.partials(b)), ds.merge(ds.partials(b), ds.partials(a))):
        m = ds.to_moments(merged.tolist())
        assert math.isclose(m.M3, whole.M3, rel_tol=1e-11) and math.isclose(m.M4, whole.M4, rel_tol=1e-11)
        assert math.isclose(m.M2, whole.M2, rel_tol=1e-12) and math.isclose(m.mean, whole.mean, rel_tol=1e-13)


def test_merge_is_vectorised_over_rows_and_keeps_absent_fields():
    xs = [CASES["normal"], CASES["single"], CASES["empty"], CASES["all_nonfinite"]]
    a = torch.stack([ds.partials(x, fmt="e4m3") for x in xs])
    b = torch.stack([ds.partials(x * 3 - 1) for x in reversed(xs)])  # no format: absent fields
    merged = ds.merge(a, b)
    for i in range(len(xs)):
        assert torch.equal(merged[i].nan_to_num(-7), ds.merge(a[i], b[i]).nan_to_num(-7))
        m = ds.to_moments(merged[i].tolist())
        want = Moments.from_tensor(xs[i], fmt="e4m3").merge(Moments.from_tensor(xs[-1 - i] * 3 - 1))
        assert (m.underflow, m.overflow, m.scale) == (want.underflow, want.overflow, want.scale)
        assert (m.numel, m.n, m.nonfinite, m.hist) == (want.numel, want.n, want.nonfinite, want.hist)
    # an untouched (all-zero) row is the identity, whatever the other row holds
    for row in a:
        assert torch.equal(ds.merge(ds.empty(1)[0], row)[1:].nan_to_num(-7), row[1:].nan_to_num(-7))
        assert torch.equal(ds.merge(row, ds.empty(1)[0])[1:].nan_to_num(-7), row[1:].nan_to_num(-7))


def test_history_max_merges_as_a_maximum_and_absent_hist_stays_absent():
    a = ds.partials(torch.ones(3), fmt="e4m3", amax_history_max=4.0)
    b = ds.partials(torch.ones(2), fmt="e4m3", amax_history_max=2.0, hist=False)
    m = ds.to_moments(ds.merge(a, b).tolist())
    assert m.amax_history_max == 4.0 and m.hist is None and m.scale == 112.0


def test_moments_round_trip():
    m = Moments.from_tensor(CASES["nonfinite"], fmt="e5m2")
    assert ds.to_moments(ds.from_moments(m).tolist()) == m
    n = Moments.from_tensor(CASES["normal"], hist=False)
    assert ds.to_moments(ds.from_moments(n).tolist()) == n


def test_amax_only_path():
    for x in CASES.values():
        want = Moments.from_tensor(x, hist=False).amax
        assert float(ds.amax(x)) == want


# ---- no host synchronisation --------------------------------------------------------------------

def test_no_host_sync_op_in_partials_and_merge():
    rec = OpRecorder()
    with rec:
        rows = [ds.partials(x, **kw) for x in CASES.values() for kw in list(CONFIGS.values())[::2]]
        ds.merge_all(torch.stack(rows))
        ds.scale_from_amax(torch.stack([r[ds.AMAX] for r in rows]), E4M3, 1)
        ds.amax(CASES["nonfinite"])
    assert len(rec.ops) > 100 and rec.syncs() == []


def test_the_recorder_catches_syncs():
    rec = OpRecorder()
    x = CASES["normal"]
    with rec:
        float(x.sum())
        x[x > 0]
        torch.nonzero(x)
    assert len(rec.syncs()) == 3


def test_runs_on_the_meta_device():
    """Meta tensors have no data: anything that reads a value or needs a data-dependent shape fails."""
    x = torch.empty(64, 32, device="meta")
    meta = torch.empty((), device="meta")
    row = ds.partials(x, fmt="e4m3", scale=meta, amax_history_max=meta)
    assert row.shape == (ds.WIDTH,) and row.device.type == "meta"
    assert ds.merge_all(torch.stack([row, ds.partials(x), row])).shape == (ds.WIDTH,)
    assert ds.partials(x, fmt="e5m2").shape == (ds.WIDTH,)


def test_layout():
    assert ds.WIDTH == len(ds.FIELDS) + LOG2_HIST_BINS
    assert set(TENSOR_STATS) - {"rms", "std", "kurtosis", "kurtosis_central", "crest", "underflow_frac",
                                "overflow_frac", "outlier_frac", "zero_frac"} <= set(ds.FIELDS)
    with pytest.raises(ValueError, match="format"):
        ds.partials(torch.ones(2), scale=2.0)
