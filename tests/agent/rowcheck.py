"""Row comparisons for the statistics tests: ``row_problems`` says what differs between two rows."""

import torch

from fp8mon.agent.stats import torch_path as ds

NO_CENTER = (0.0, float("nan"))  # no outlier counted: the Triton path before a center is known


def row_problems(a: torch.Tensor, b: torch.Tensor, *, rtol=1e-6, under_slack=None, m2_floor=0.0) -> str:
    """'' when the statistics rows ``a`` and ``b`` agree, else what differs: counts, amax, scale, histogram
    exactly (underflow within ``under_slack`` if given); mean, M3 and M4 to ``rtol`` of the data's scale; M2 to
    ``rtol`` of (M2 + ``m2_floor`` · n · scale²)."""
    a, b = a.double().cpu(), b.double().cpu()
    exact = [ds.PARTS, ds.NUMEL, ds.N, ds.NONFINITE, ds.ZEROS, ds.NONZERO, ds.OUTLIERS, ds.OVERFLOW, ds.AMAX,
             ds.SCALE, ds.AMAX_HISTORY_MAX] + list(range(ds.HIST, ds.WIDTH))
    if under_slack is None:
        exact.append(ds.UNDERFLOW)
    bad = []
    for i in exact:
        x, y = a[..., i], b[..., i]
        same = (x == y) | (x.isnan() & y.isnan())
        if not bool(same.all()):
            where = (~same).flatten().nonzero().flatten()[:4].tolist()  # the differing rows, not the first ones
            diff = ", ".join(f"[{j}] {x.flatten()[j].item()!r} vs {y.flatten()[j].item()!r}" for j in where)
            bad.append(f"{ds.FIELDS[i] if i < ds.HIST else 'hist'}: {diff}")
    if under_slack is not None:
        d = (a[..., ds.UNDERFLOW] - b[..., ds.UNDERFLOW]).abs()
        if bool((d > under_slack).any()):
            bad.append(f"underflow {a[..., ds.UNDERFLOW].tolist()} vs {b[..., ds.UNDERFLOW].tolist()} (slack {under_slack})")
    n = b[..., ds.N].clamp(min=1)
    sd = (b[..., ds.M2] / n).sqrt()
    scale = b[..., ds.MEAN].abs() + sd
    tol = {ds.MEAN: rtol * scale, ds.M2: rtol * (b[..., ds.M2].abs() + m2_floor * n * scale**2) + 1e-300,
           ds.M3: rtol * n * sd**3 + 1e-300, ds.M4: rtol * b[..., ds.M4].abs() + 1e-300}
    for i, t in tol.items():
        x, y = a[..., i], b[..., i]
        ok = ((x - y).abs() <= t) | (x.isnan() & y.isnan())
        if not bool(ok.all()):
            bad.append(f"{ds.FIELDS[i]}: {x.flatten()[:3].tolist()} vs {y.flatten()[:3].tolist()}")
    return "; ".join(bad)


def bf16_pairs(n: int, device) -> tuple[torch.Tensor, list]:
    """For the bf16 words path (two elements per word, bf16x2 instructions; with the histogram too, on hardware): a
    tensor of ``n`` elements with zeros of both signs, underflows, values on and just past bf16 outlier bounds, and
    the (center, k, keyword arguments) to try on it: a zero-width center, a scale under which some overflow (counted
    lazily on the careful path), delayed scaling, no format."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    x[::17] = 0.0
    x[5::29] = -0.0
    x[7::31] = 1e-6
    x[11::37] = 1.0
    x[13::41] = -1.0
    x[15::43] = 1.0078125  # the next bf16 above 1
    x[19::47] = -1.0078125
    kws = (dict(fmt="e4m3", scale=torch.tensor(3.0, device=device)), dict(fmt="e5m2", scale=1e4),
           dict(fmt="e4m3", amax_history_max=0.75), dict())
    centers = (((0.0, 0.5), 2.0), ((0.1, 0.37), 2.0), ((0.0, 0.0), 6.0), ((0.25, 0.125), 6.0))
    return x.to(device), [(c, k, kw) for c, k in centers for kw in kws]
