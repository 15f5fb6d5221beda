"""The torch reference statistics (agent/stats/reference.py) and FP8 formats (agent/formats.py) against independent
fp64 numpy references, scipy, and real float8 casts."""

import math
import random

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8mon.agent.formats import E4M3, E5M2, by_name, current_scale, delayed_scale, quantize
from fp8mon.agent.stats.reference import Moments, merge_moments, merge_stats, per_sample_kurtosis, tensor_stats
from fp8mon.agent.wire import LOG2_HIST_BINS, LOG2_HIST_HI, LOG2_HIST_LO, TENSOR_STATS

NAN = float("nan")
RTOL = 1e-9


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------
def ref_stats(x, fmt=None, scale=None, k=6.0):
    """fp64 two-pass numpy reference of SPEC section 4 on fp32(x)."""
    x32 = x.detach().float().reshape(-1).numpy()
    fin = np.isfinite(x32)
    v32 = x32[fin]
    v = v32.astype(np.float64)
    n, total = v.size, x32.size
    out = {"numel": total, "nonfinite": int(total - n), "amax": float(np.abs(v).max()) if n else 0.0}
    if n:
        mean = v.mean()
        mean += (v - mean).mean()
        d = v - mean
        std = math.sqrt((d**2).mean())
        ms, m4 = (v**2).mean(), (v**4).mean()
        M2, M4 = (d**2).sum(), (d**4).sum()
        rms = math.sqrt(ms)
        out.update(
            mean=mean,
            std=std,
            rms=rms,
            kurtosis=m4 / ms**2 if ms > 0 else NAN,
            kurtosis_central=n * M4 / M2**2 if M2 > 0 else NAN,
            crest=out["amax"] / rms if rms > 0 else NAN,
        )
        outliers = int((np.abs(d) > k * std).sum())
    else:
        out.update(mean=NAN, std=NAN, rms=NAN, kurtosis=NAN, kurtosis_central=NAN, crest=NAN)
        outliers = 0
    frac = lambda c, t: c / t if t else 0.0  # noqa: E731
    out["zero_frac"] = frac(int((x32 == 0).sum()), total)
    out["outlier_frac"] = frac(outliers, total)
    if fmt is not None:
        y = np.abs(v32 * np.float32(scale))  # fp32 product, as the cast sees it
        nz = int((v32 != 0).sum())
        out["underflow_frac"] = frac(int(((y <= fmt.min_subnormal / 2) & (v32 != 0)).sum()), nz)
        out["overflow_frac"] = frac(int((np.abs(rne_unbounded(y, fmt)) > fmt.max).sum()), total)
    return out


def rne_unbounded(y, fmt):
    """Round fp32 values to fmt's grid with round-half-to-even and an unbounded exponent (numpy)."""
    mbits = {"e4m3": 3, "e5m2": 2}[fmt.name]
    a = np.abs(y.astype(np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, math.log2(fmt.min_normal))  # subnormals share the min-normal binade's ulp
    ulp = 2.0 ** (e - mbits)
    return np.sign(y) * np.round(a / ulp) * ulp  # np.round: half to even


def ref_hist(x):
    a = np.abs(x.detach().float().reshape(-1).numpy().astype(np.float64))
    a = a[np.isfinite(a) & (a != 0)]
    edges = 2.0 ** np.arange(LOG2_HIST_LO, LOG2_HIST_HI + 1)
    idx = np.clip(np.searchsorted(edges, a, side="right") - 1, 0, LOG2_HIST_BINS - 1)
    return np.bincount(idx, minlength=LOG2_HIST_BINS).tolist()


def close(a, b, rtol=RTOL, atol=0.0):
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


def assert_stats(got, want, skip=()):
    for key, w in want.items():
        if key in skip:
            continue
        g = got[key]
        if key in ("numel", "nonfinite"):
            assert type(g) is int and g == w, (key, g, w)
        elif key == "log2_hist":
            assert g == w
        else:
            assert close(g, w), (key, g, w)


# ---------------------------------------------------------------------------------------------
# adversarial tensors
# ---------------------------------------------------------------------------------------------
def _cases():
    r = np.random.default_rng(1234)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))  # noqa: E731
    nonfinite = r.standard_normal(1000).astype(np.float32)
    nonfinite[[3, 50, 51, 700]] = [np.nan, np.inf, -np.inf, np.nan]
    nonfinite[[10, 11]] = 0.0
    shifted = (100 + r.standard_normal(3000)).astype(np.float32)
    shifted[[5, 9, 2000]] = [np.nan, np.inf, np.nan]
    shifted[[7, 8]] = [120.0, 0.0]  # an outlier and a zero (also an outlier)
    wide = np.sign(r.standard_normal(8000)) * 10.0 ** r.uniform(-44, 6, 8000)
    wide[:50] = 0.0
    return {
        "normal": t(r.standard_normal(5000)),
        "large_mean": t(1e4 + 1e-2 * r.standard_normal(10000)),
        "student_t": t(0.05 * r.standard_t(2.5, 20000)),
        "lognormal": t(np.exp(2 * r.standard_normal(8000))),
        "wide_range": t(wide),
        "zeros": torch.zeros(1000),
        "constant": torch.full((777,), 0.1),
        "nonfinite": t(nonfinite),
        "nonfinite_shifted": t(shifted),
        "all_nan": torch.full((10,), NAN),
        "single": torch.tensor([3.5]),
        "single_zero": torch.tensor([0.0]),
        "empty": torch.empty(0),
        "bf16": (0.02 * torch.from_numpy(r.standard_normal((64, 64)))).to(torch.bfloat16),
        "fp16": (0.1 * torch.from_numpy(r.standard_normal(3000))).to(torch.float16),
        "3d": t(r.standard_normal((4, 8, 16)) * 3 - 1),
    }


CASES = _cases()
CONFIGS = {
    "nofmt": {},
    "e4m3_current": {"fmt": "e4m3"},
    "e5m2_current": {"fmt": "e5m2"},
    "e4m3_stale": {"fmt": "e4m3", "amax_history_max": 0.25},  # delayed scale from a stale history
    "e5m2_fixed": {"fmt": "e5m2", "scale": 3.0e3},
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_stats_against_fp64_reference(case, config):
    x, kw = CASES[case], CONFIGS[config]
    got = tensor_stats(x, **kw)
    assert list(got) == [*TENSOR_STATS, "log2_hist"]
    assert got["amax_history_max"] == kw.get("amax_history_max")
    fmt = by_name(kw["fmt"]) if "fmt" in kw else None
    if fmt is None:
        assert got["scale"] is got["underflow_frac"] is got["overflow_frac"] is None
        want_scale = None
    elif "scale" in kw:
        want_scale = kw["scale"]
    elif "amax_history_max" in kw:
        want_scale = fmt.max / kw["amax_history_max"]
    else:
        want_scale = current_scale(float(x.float().nan_to_num(0, 0, 0).abs().max()) if x.numel() else 0, fmt)
    if want_scale is not None:
        assert got["scale"] == float(np.float32(want_scale))
    assert_stats(got, ref_stats(x, fmt, got["scale"]))
    assert got["log2_hist"] == ref_hist(x)
    assert sum(got["log2_hist"]) == int((torch.isfinite(x) & (x != 0)).sum())


@pytest.mark.parametrize("case", ["normal", "large_mean", "student_t", "lognormal", "wide_range", "3d", "bf16"])
def test_kurtosis_central_matches_scipy(case):
    x = CASES[case].float().reshape(-1).double().numpy()
    want = scipy.stats.kurtosis(x, fisher=False, bias=True)
    assert close(tensor_stats(CASES[case])["kurtosis_central"], want)


def test_heavy_tails_have_outliers_and_high_kurtosis():
    s = tensor_stats(CASES["student_t"], outlier_k=3.0)
    assert s["outlier_frac"] > 0 and s["kurtosis_central"] > 10
    g = tensor_stats(torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    assert abs(g["kurtosis"] - 3) < 0.1 and abs(g["kurtosis_central"] - 3) < 0.1


def test_low_precision_input_equals_its_fp32_value():
    for x in (CASES["bf16"], CASES["fp16"]):
        assert_stats(tensor_stats(x, fmt="e4m3"), tensor_stats(x.float(), fmt="e4m3"))


def test_edge_case_conventions():
    z = tensor_stats(torch.zeros(8), fmt="e4m3")
    assert (z["rms"], z["mean"], z["std"], z["amax"], z["zero_frac"]) == (0, 0, 0, 0, 1)
    assert math.isnan(z["kurtosis"]) and math.isnan(z["kurtosis_central"]) and math.isnan(z["crest"])
    assert z["underflow_frac"] == 0.0 and z["overflow_frac"] == 0.0 and z["scale"] == 1.0

    e = tensor_stats(torch.empty(0, 3), fmt="e5m2")
    assert e["numel"] == 0 and e["amax"] == 0.0 and e["nonfinite"] == 0 and e["scale"] == 1.0
    assert all(math.isnan(e[k]) for k in ("rms", "mean", "std", "kurtosis", "kurtosis_central", "crest"))
    assert all(e[k] == 0.0 for k in ("underflow_frac", "overflow_frac", "outlier_frac", "zero_frac"))
    assert e["log2_hist"] == [0] * LOG2_HIST_BINS

    one = tensor_stats(torch.tensor([-2.0]))
    assert (one["std"], one["kurtosis"], one["crest"], one["mean"]) == (0, 1, 1, -2)
    assert math.isnan(one["kurtosis_central"])

    nan = tensor_stats(torch.tensor([NAN, math.inf, -math.inf]), fmt="e4m3")
    assert nan["nonfinite"] == 3 and nan["amax"] == 0.0 and math.isnan(nan["mean"])
    assert nan["overflow_frac"] == 0.0 and nan["scale"] == 1.0

    mixed = tensor_stats(torch.tensor([1.0, NAN, 3.0, math.inf]))
    assert mixed["nonfinite"] == 2 and mixed["mean"] == 2.0 and mixed["amax"] == 3.0 and mixed["numel"] == 4

    assert "log2_hist" not in tensor_stats(torch.ones(3), hist=False)
    with pytest.raises(ValueError, match="format"):
        tensor_stats(torch.ones(3), scale=2.0)


# ---------------------------------------------------------------------------------------------
# merging
# ---------------------------------------------------------------------------------------------
def assert_moments_equal(got, want):
    assert (got.numel, got.n, got.amax, got.zeros, got.nonfinite, got.nonzero) == (
        want.numel, want.n, want.amax, want.zeros, want.nonfinite, want.nonzero)
    assert (got.underflow, got.overflow, got.hist) == (want.underflow, want.overflow, want.hist)
    if want.n == 0:
        return
    spread = math.sqrt(want.M2 / want.n)
    assert close(got.mean, want.mean, atol=1e-13 * (abs(want.mean) + spread))
    assert close(got.M2, want.M2, atol=1e-300)
    assert close(got.M4, want.M4, atol=1e-300)
    assert close(got.M3, want.M3, atol=RTOL * math.sqrt(want.M2 * want.M4))  # |M3| <= sqrt(M2 M4)


def split(x, cuts):
    flat = x.reshape(-1)
    bounds = [0, *sorted(cuts), flat.numel()]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def tree_merge(parts):
    if len(parts) == 1:
        return parts[0]
    h = len(parts) // 2
    return tree_merge(parts[:h]).merge(tree_merge(parts[h:]))


@pytest.mark.parametrize("case", ["large_mean", "student_t", "nonfinite", "lognormal", "zeros", "wide_range"])
def test_merge_equals_whole_tensor(case):
    x = CASES[case]
    n = x.numel()
    # uneven blocks, including empty and single-element ones
    cuts = [0, 0, 1, 2, 2, 3, 17, n // 3, n // 3 + 1, n // 2, n - 1, n - 1, n]
    kw = {"fmt": "e5m2", "scale": 1024.0}  # a shared (delayed-style) scale: counts merge exactly
    whole = Moments.from_tensor(x, **kw)
    parts = [Moments.from_tensor(p, **kw) for p in split(x, cuts)]
    assert any(p.numel == 0 for p in parts) and any(p.numel == 1 for p in parts)
    rng = random.Random(0)
    shuffled = parts[:]
    rng.shuffle(shuffled)
    candidates = [
        merge_moments(parts),
        merge_moments(reversed(parts)),
        tree_merge(parts),
        tree_merge(shuffled),
        sum(shuffled[1:], shuffled[0]),
    ]
    for m in candidates:
        assert_moments_equal(m, whole)
        assert_stats(m.to_stats(), whole.to_stats(), skip=("outlier_frac",))
    assert merge_stats(parts)["log2_hist"] == whole.to_stats()["log2_hist"]


def test_merge_exact_global_outliers_via_outlier_center():
    x = CASES["student_t"]
    pieces = split(x, [5, 900, 12000])
    merged = merge_moments(Moments.from_tensor(p) for p in pieces)
    centre = (merged.mean, merged.std)
    second = merge_moments(Moments.from_tensor(p, outlier_center=centre) for p in pieces)
    assert second.outliers == Moments.from_tensor(x).outliers > 0
    # without the second pass each part uses its own mean/std: documented, and here different
    assert merged.outliers == sum(Moments.from_tensor(p).outliers for p in pieces)


def test_m4_merge_has_every_term():
    """Two blocks with different sizes, means and skew: each cross term of the M3/M4 merge is far above
    the tolerance, so a merge that drops any of them fails."""
    r = np.random.default_rng(7)
    a = torch.from_numpy((r.exponential(1.0, 300) ** 2).astype(np.float32))
    b = torch.from_numpy((8.0 - 3.0 * r.exponential(1.0, 1700)).astype(np.float32))
    A, B, W = Moments.from_tensor(a), Moments.from_tensor(b), Moments.from_tensor(torch.cat([a, b]))
    na, nb, n, d = A.n, B.n, A.n + B.n, B.mean - A.mean
    m3_terms = [d**3 * na * nb * (na - nb) / n**2, 3 * d * (na * B.M2 - nb * A.M2) / n]
    m4_terms = [
        d**4 * na * nb * (na**2 - na * nb + nb**2) / n**3,
        6 * d**2 * (na**2 * B.M2 + nb**2 * A.M2) / n**2,
        4 * d * (na * B.M3 - nb * A.M3) / n,
    ]
    assert min(abs(t) for t in m3_terms) > 1e-4 * abs(W.M3)
    assert min(abs(t) for t in m4_terms) > 1e-4 * W.M4
    for m in (A.merge(B), B.merge(A)):
        assert close(m.M3, W.M3, rtol=1e-11) and close(m.M4, W.M4, rtol=1e-11) and close(m.M2, W.M2, rtol=1e-12)


def test_empty_and_nonfinite_partials_are_moment_identities():
    x = CASES["large_mean"][:100]
    m = Moments.from_tensor(x)
    nan_part = Moments.from_tensor(torch.tensor([NAN, math.inf]))
    for other in (Moments.empty(), Moments(), Moments.from_tensor(torch.empty(0))):
        assert m.merge(other) == m and other.merge(m) == m
    for got in (m.merge(nan_part), nan_part.merge(m)):
        assert (got.mean, got.M2, got.M3, got.M4, got.n) == (m.mean, m.M2, m.M3, m.M4, m.n)
        assert got.nonfinite == 2 and got.numel == 102
    assert merge_moments([]).to_stats()["numel"] == 0


def test_merge_of_scales_and_history():
    a = Moments.from_tensor(torch.tensor([1.0, 2.0]), fmt="e4m3")  # current scale 224
    b = Moments.from_tensor(torch.tensor([8.0]), fmt="e4m3")  # current scale 56
    assert a.merge(b).scale == 56.0 == Moments.from_tensor(torch.tensor([1.0, 2.0, 8.0]), fmt="e4m3").scale
    c = Moments.from_tensor(torch.tensor([1.0]), fmt="e4m3", amax_history_max=4.0)
    d = Moments.from_tensor(torch.tensor([1.0]), fmt="e4m3", amax_history_max=2.0)
    assert c.merge(d).amax_history_max == 4.0 and c.merge(d).scale == 112.0
    nofmt = Moments.from_tensor(torch.tensor([1.0]))
    assert a.merge(nofmt).underflow is None and a.merge(nofmt).scale is None


_f32 = st.floats(-1e6, 1e6, width=32, allow_subnormal=False)


@settings(max_examples=120, deadline=None)
@given(
    values=st.lists(_f32, max_size=40),
    offset=st.sampled_from([0.0, 1e4, -3e5]),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    special=st.lists(st.sampled_from([NAN, math.inf, -math.inf, 0.0]), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_merge_property(values, offset, cuts, special, seed):
    x = torch.tensor(values + special, dtype=torch.float32) + offset
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))]
    cuts = [min(c, x.numel()) for c in cuts]
    kw = {"fmt": "e4m3", "scale": 0.5}
    parts = [Moments.from_tensor(p, **kw) for p in split(x, cuts)]
    whole = Moments.from_tensor(x, **kw)
    order = parts[:]
    random.Random(seed).shuffle(order)
    assert_moments_equal(merge_moments(parts), whole)
    assert_moments_equal(tree_merge(order) if order else Moments.empty(), whole)


# ---------------------------------------------------------------------------------------------
# underflow / overflow against real casts
# ---------------------------------------------------------------------------------------------
def _neighbours(v):
    """[v0-, v0, v0+, v1-, v1, v1+, ...] in fp32 (- and + the adjacent fp32 values toward 0 and away)."""
    t = torch.tensor(v, dtype=torch.float32)
    away = torch.where(t < 0, -math.inf, math.inf)
    return torch.stack([torch.nextafter(t, torch.zeros_like(t)), t, torch.nextafter(t, away)], 1).reshape(-1)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 2.0**-4, 2.0**7, 0.37, 448 / 3.7, 1 / 3])
def test_underflow_matches_real_cast(fmt, scale):
    s32 = float(np.float32(scale))
    ms = fmt.min_subnormal
    ys = [ms / 2, ms, 0.75 * ms, 0.25 * ms, 1.5 * ms, 2.5 * ms, 2.0**-149, fmt.min_normal]
    xs = _neighbours([y / s32 for y in ys] + [-y / s32 for y in ys])
    r = torch.Generator().manual_seed(1)
    rand = torch.sign(torch.randn(4000, generator=r)) * 2.0 ** (torch.rand(4000, generator=r) * 50 - 40) / s32
    x = torch.cat([xs, rand, torch.tensor([0.0, -0.0, NAN, math.inf, -math.inf])])
    q = quantize(x, scale, fmt).float()
    real = int(((q == 0) & (x != 0) & torch.isfinite(x)).sum())
    m = Moments.from_tensor(x, fmt=fmt, scale=scale)
    assert m.underflow == real > 0
    assert m.nonzero == int(((x != 0) & torch.isfinite(x)).sum())
    y = (x * s32).abs()
    if math.log2(scale).is_integer():  # the exact tie is present, and the cast sends it to zero
        tie = y == ms / 2
        assert tie.any() and (q[tie] == 0).all()
    assert (q[y == torch.nextafter(torch.tensor(ms / 2), torch.tensor(1.0))] != 0).all()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_overflow_with_stale_delayed_scale_matches_rounding(fmt):
    r = torch.Generator().manual_seed(2)
    history = [1.0, 0.5, 0.8]  # stale: the tensor's amax has grown to ~5
    s = delayed_scale(history, fmt)
    assert s == fmt.max
    edge = _neighbours([fmt.max, fmt.overflow_threshold, 464.0, 480.0, 61440.0, 65536.0])
    x = torch.cat([torch.randn(5000, generator=r) * 1.2, edge / s, -edge / s, torch.tensor([NAN, math.inf])])
    m = Moments.from_tensor(x, fmt=fmt, amax_history_max=max(history))
    assert m.scale == s
    y = (x * s)[torch.isfinite(x)]
    lost = np.abs(rne_unbounded(y.numpy(), fmt)) > fmt.max  # independent RNE emulation
    assert m.overflow == int(lost.sum()) > 0
    assert m.overflow < int((y.abs() > fmt.max).sum())  # values rounding to max are not overflow
    q = quantize(x, s, fmt).float()[torch.isfinite(x)]
    assert (q[torch.from_numpy(lost)].abs() == fmt.max).all() and torch.isfinite(q).all()
    if fmt is E5M2:  # a real non-saturating cast: overflow is exactly what becomes Inf
        assert int(torch.isinf(y.to(fmt.dtype).float()).sum()) == m.overflow
    s_ = tensor_stats(x, fmt=fmt, amax_history_max=max(history))
    assert s_["overflow_frac"] == m.overflow / x.numel() and s_["amax_history_max"] == 1.0


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_current_scaling_never_overflows(fmt):
    r = torch.Generator().manual_seed(3)
    for _ in range(300):
        x = torch.randn(16, generator=r) * float(torch.rand(1, generator=r) * 100)
        assert Moments.from_tensor(x, fmt=fmt).overflow == 0


# ---------------------------------------------------------------------------------------------
# histogram, per-sample kurtosis, formats
# ---------------------------------------------------------------------------------------------
def test_log2_hist_exact_powers_of_two_and_clamping():
    ks = list(range(LOG2_HIST_LO - 5, LOG2_HIST_HI + 5))
    pw = torch.tensor([2.0**k for k in ks], dtype=torch.float32)
    x = torch.cat([
        pw, -pw, _neighbours([2.0**k for k in ks]),
        torch.tensor([2.0**-149, 2.0**-130, 1e30, 3.0e38, 0.0, NAN, math.inf]),
        torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 1e3,
    ])
    h = tensor_stats(x)["log2_hist"]
    assert h == ref_hist(x)
    single = [tensor_stats(torch.tensor([2.0**k]))["log2_hist"] for k in (LOG2_HIST_LO, 0, 3, LOG2_HIST_HI - 1)]
    for k, hk in zip((LOG2_HIST_LO, 0, 3, LOG2_HIST_HI - 1), single):
        assert hk[k - LOG2_HIST_LO] == 1 and sum(hk) == 1
    below = tensor_stats(torch.tensor([2.0**-120, 1.0 - 2.0**-24]))["log2_hist"]
    assert below[0] == 1 and below[-LOG2_HIST_LO - 1] == 1  # 1 - ulp is in [2^-1, 1)
    assert tensor_stats(torch.tensor([2.0**LOG2_HIST_HI, 1e38]))["log2_hist"][-1] == 2


def test_per_sample_kurtosis():
    r = np.random.default_rng(5)
    a = r.standard_t(4, (6, 32, 16)).astype(np.float32)
    a[2] = 0.0  # an all-zero sample is left out of the average
    a[4, 0, 0] = np.nan
    x = torch.from_numpy(a)

    def ref(arr):
        ks = []
        for smp in arr:
            v = smp[np.isfinite(smp)].astype(np.float64)
            m2 = (v**2).mean()
            if m2 > 0:
                ks.append((v**4).mean() / m2**2)
        return float(np.mean(ks))

    assert close(per_sample_kurtosis(x), ref(a))
    assert close(per_sample_kurtosis(x, sample_dim=1), ref(np.moveaxis(a, 1, 0)))
    assert math.isnan(per_sample_kurtosis(torch.zeros(3, 4)))
    big = torch.randn(8, 20000, generator=torch.Generator().manual_seed(6))
    assert abs(per_sample_kurtosis(big) - 3) < 0.1


def test_formats_and_scales():
    assert by_name("E4M3") is E4M3 and by_name("e5m2") is E5M2 and by_name(E5M2) is E5M2
    assert (E4M3.max, E4M3.min_normal, E4M3.min_subnormal, E4M3.dtype) == (448, 2**-6, 2**-9, torch.float8_e4m3fn)
    assert (E5M2.max, E5M2.min_normal, E5M2.min_subnormal, E5M2.dtype) == (57344, 2**-14, 2**-16, torch.float8_e5m2)
    with pytest.raises(ValueError, match="e4m3"):
        by_name("e3m4")
    assert current_scale(2.0, E4M3) == 224.0 and current_scale(4.0, "e5m2") == 14336.0
    for bad in (0.0, -1.0, NAN, math.inf):
        assert current_scale(bad, E4M3) == 1.0 and delayed_scale([bad], E4M3) == 1.0
    t = current_scale(torch.tensor([2.0, 0.0, NAN]), E4M3)
    assert t.dtype == torch.float32 and t.tolist() == [224.0, 1.0, 1.0]
    assert delayed_scale([1.0, 4.0, 2.0], E4M3, margin=1) == 56.0
    assert delayed_scale(torch.tensor([1.0, 4.0]), E4M3).item() == 112.0
    assert delayed_scale([], E4M3) == 1.0 and delayed_scale([1.0, NAN], E4M3) == 1.0
    # the format thresholds are where a real round-to-nearest-even cast lands
    for f in (E4M3, E5M2):
        thr = torch.tensor([f.underflow_threshold, f.overflow_threshold])
        assert quantize(thr, 1.0, f).float().tolist() == [0.0, f.max]
        assert quantize(_neighbours(thr.tolist()), 1.0, f).float().tolist()[2::3] == [f.min_subnormal, f.max]
        assert np.abs(rne_unbounded(np.array([f.overflow_threshold], np.float32), f))[0] == f.max
        above = torch.nextafter(torch.tensor(f.overflow_threshold), torch.tensor(math.inf))
        assert np.abs(rne_unbounded(above.numpy()[None], f))[0] > f.max


def test_quantize_saturates():
    x = torch.tensor([1e6, -1e6, 12.0, NAN, math.inf, -math.inf])
    for f in (E4M3, E5M2):
        q = quantize(x, 2.0, f)
        assert q.dtype == f.dtype
        v = q.float().tolist()
        assert v[:3] == [f.max, -f.max, 24.0] and math.isnan(v[3]) and v[4:] == [f.max, -f.max]
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()  # why we clamp
