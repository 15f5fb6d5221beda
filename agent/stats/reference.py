"""Reference (torch, fp64) implementation of the per-tensor health statistics of SPEC section 4.

This is the oracle the fast kernels are tested against: correctness over speed. The tensor is cast to
fp32 (as the FP8 cast sees it), moments are computed in fp64 with a two-pass mean-then-central-moments
per block, and blocks, micro-batches and ranks are merged exactly with the Chan/Pebay pairwise formulas.

Definitions (x = fp32(input), n_total = x.numel(), "finite" = not NaN/Inf, n = number of finite elements,
s = fp32 scale in use, y = fp32(s * x) exactly as ``formats.quantize`` computes it):

==================  ==========================================================================
numel               n_total
amax                max |x| over finite elements; 0.0 when there is none
mean, std, rms      over finite elements; std is the population std; NaN when n == 0
kurtosis            mean(x^4) / mean(x^2)^2, non-central (FOG); NaN when mean(x^2) == 0
kurtosis_central    n * M4 / M2^2 (Pearson); NaN when M2 == 0 (n <= 1, constant tensor)
crest               amax / rms; NaN when rms == 0 or undefined
underflow_frac      #{finite x != 0 with |y| <= min_subnormal/2} / #{finite x != 0}; the tie
                    min_subnormal/2 is included because round-half-to-even casts it to 0
overflow_frac       #{finite x with |y| > fmt.overflow_threshold} / n_total: the elements that a
                    round-to-nearest-even cast without saturation would send past +-max (Inf/NaN),
                    i.e. that the clamp saturates beyond ordinary rounding: |y| > 464 for E4M3,
                    |y| >= 61440 for E5M2. Not the literal |y| > fmt.max: with current scaling the
                    fp32-rounded scale puts amax*s one fp32 ulp above max in ~9% of tensors, which
                    would report overflow where none is possible. Inf inputs count in `nonfinite`.
outlier_frac        #{finite x with |x - mean| > k * std} / n_total
zero_frac           #{x == 0} / n_total
nonfinite           number of NaN/+-Inf elements (int)
scale               the scale in use (its fp32 value), None without a format
amax_history_max    as given, None if not given
log2_hist           (optional) LOG2_HIST_BINS ints: bin i counts finite nonzero |x| with
                    2**(LO+i) <= |x| < 2**(LO+i+1), smaller values in bin 0, larger in the last
==================  ==========================================================================

Fractions whose denominator is zero (empty tensor, or no nonzero finite element for underflow) are 0.0:
nothing was seen to underflow, overflow or be an outlier. Ratios of moments that are 0/0 are NaN.
Without a format, underflow_frac, overflow_frac and scale are None.

Merging: every count, amax and the histogram merge exactly; mean/M2/M3/M4 merge with the pairwise formulas
in fp64 and agree with the whole-tensor two-pass result to ~1e-12 relative. Two exceptions, documented:
* outlier counts are per part, each against that part's own mean/std; for the exact global count, merge
  the moments first and call ``Moments.from_tensor(part, outlier_center=(mean, std))`` on each part.
* the merged ``scale`` is the minimum of the parts' scales (with current scaling per part this is
  fmt.max / max(amax), the scale of the concatenation); ``amax_history_max`` is the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import reduce

import torch

from ..formats import Fp8Format, by_name, current_scale, delayed_scale, scale_tensor
from ..wire import LOG2_HIST_BINS, LOG2_HIST_LO, TENSOR_STATS

NAN = float("nan")


@dataclass(frozen=True)
class Moments:
    """Mergeable partial statistics of a block of a tensor (see the module docstring)."""

    numel: int = 0  # all elements
    n: int = 0  # finite elements
    mean: float = 0.0  # mean of the finite elements
    M2: float = 0.0  # sum (x - mean)^2 over finite elements
    M3: float = 0.0
    M4: float = 0.0
    amax: float = 0.0
    zeros: int = 0
    nonfinite: int = 0
    nonzero: int = 0  # finite nonzero elements: the underflow denominator
    outliers: int = 0
    underflow: int | None = None  # None when no format/scale was given
    overflow: int | None = None
    scale: float | None = None
    amax_history_max: float | None = None
    hist: tuple | None = None  # LOG2_HIST_BINS ints, or None when not computed

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_tensor(
        cls,
        x: torch.Tensor,
        *,
        fmt: Fp8Format | str | None = None,
        scale=None,
        amax_history_max: float | None = None,
        outlier_k: float = 6.0,
        outlier_center: tuple[float, float] | None = None,
        hist: bool = True,
        block_size: int = 1 << 22,
    ) -> Moments:
        """Statistics of one tensor.

        ``fmt`` without ``scale`` uses delayed scaling from ``amax_history_max`` when that is given,
        else current scaling (fmt.max / amax(x)). ``scale`` without ``fmt`` is a ValueError.
        ``outlier_center=(mean, std)`` counts outliers against a given (e.g. globally merged) mean/std.
        The tensor is processed in blocks of ``block_size`` elements merged exactly (memory bound only).
        """
        if fmt is None and scale is not None:
            raise ValueError("a scale needs an FP8 format (fmt='e4m3' or 'e5m2')")
        fmt = None if fmt is None else by_name(fmt)
        flat = x.detach().reshape(-1)
        chunks = [c.to(torch.float32) for c in flat.split(block_size)] if flat.numel() else []
        m = reduce(cls.merge, (_block_moments(c, hist) for c in chunks), cls.empty(hist))

        if fmt is not None and scale is None:
            if amax_history_max is not None:
                scale = delayed_scale([amax_history_max], fmt)
            else:
                scale = current_scale(m.amax, fmt)
        mean, std = outlier_center if outlier_center is not None else (m.mean, m.std)
        limit = outlier_k * std
        outliers = under = over = 0
        s32 = None if fmt is None else scale_tensor(scale, flat.device)
        for c in chunks:
            v = c[torch.isfinite(c)]
            if not math.isnan(limit):
                outliers += int(((v.double() - mean).abs() > limit).sum())
            if s32 is not None:
                y = (v * s32).abs()
                under += int(((y <= fmt.underflow_threshold) & (v != 0)).sum())
                over += int((y > fmt.overflow_threshold).sum())
        if fmt is None:
            return replace(m, outliers=outliers, amax_history_max=_opt_float(amax_history_max))
        return replace(
            m,
            outliers=outliers,
            underflow=under,
            overflow=over,
            scale=float(s32),
            amax_history_max=_opt_float(amax_history_max),
        )

    @classmethod
    def empty(cls, hist: bool = True) -> Moments:
        return cls(hist=(0,) * LOG2_HIST_BINS if hist else None)

    # ---- merging -----------------------------------------------------------------------------
    def merge(self, other: Moments) -> Moments:
        """Exact pairwise merge (Chan et al. / Pebay 2008) in fp64. Empty parts are the identity."""
        a, b = self, other
        if a.numel == 0:
            return b
        if b.numel == 0:
            return a
        na, nb = a.n, b.n
        n = na + nb
        if nb == 0:
            mean, M2, M3, M4 = a.mean, a.M2, a.M3, a.M4
        elif na == 0:
            mean, M2, M3, M4 = b.mean, b.M2, b.M3, b.M4
        else:
            d = b.mean - a.mean
            mean = a.mean + d * nb / n
            M2 = a.M2 + b.M2 + d * d * na * nb / n
            M3 = (
                a.M3
                + b.M3
                + d**3 * na * nb * (na - nb) / n**2
                + 3.0 * d * (na * b.M2 - nb * a.M2) / n
            )
            M4 = (
                a.M4
                + b.M4
                + d**4 * na * nb * (na * na - na * nb + nb * nb) / n**3
                + 6.0 * d * d * (na * na * b.M2 + nb * nb * a.M2) / n**2
                + 4.0 * d * (na * b.M3 - nb * a.M3) / n
            )
        return Moments(
            numel=a.numel + b.numel,
            n=n,
            mean=mean,
            M2=M2,
            M3=M3,
            M4=M4,
            amax=max(a.amax, b.amax),
            zeros=a.zeros + b.zeros,
            nonfinite=a.nonfinite + b.nonfinite,
            nonzero=a.nonzero + b.nonzero,
            outliers=a.outliers + b.outliers,
            underflow=_opt_add(a.underflow, b.underflow),
            overflow=_opt_add(a.overflow, b.overflow),
            scale=None if a.scale is None or b.scale is None else min(a.scale, b.scale),
            amax_history_max=max(
                (h for h in (a.amax_history_max, b.amax_history_max) if h is not None), default=None
            ),
            hist=None if a.hist is None or b.hist is None else tuple(map(sum, zip(a.hist, b.hist))),
        )

    __add__ = merge

    # ---- derived statistics ------------------------------------------------------------------
    @property
    def var(self) -> float:
        return self.M2 / self.n if self.n else NAN

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.n else NAN

    def to_stats(self) -> dict:
        """The SPEC section-4 statistics: exactly TENSOR_STATS (+ "log2_hist" when computed)."""
        n, mu = self.n, self.mean
        if n:
            var = self.M2 / n
            ms = var + mu * mu  # mean(x^2)
            # mean(x^4) from the central moments; bounded condition number, no catastrophic cancellation
            m4 = self.M4 / n + 4.0 * mu * self.M3 / n + 6.0 * mu * mu * var + mu**4
            rms, std = math.sqrt(ms), math.sqrt(var)
        else:
            mu = var = ms = m4 = rms = std = NAN
        out = {
            "numel": self.numel,
            "amax": self.amax,
            "rms": rms,
            "mean": mu,
            "std": std,
            "kurtosis": m4 / (ms * ms) if ms > 0 else NAN,
            "kurtosis_central": n * self.M4 / (self.M2 * self.M2) if self.M2 > 0 else NAN,
            "crest": self.amax / rms if rms > 0 else NAN,
            "underflow_frac": None if self.underflow is None else _frac(self.underflow, self.nonzero),
            "overflow_frac": None if self.overflow is None else _frac(self.overflow, self.numel),
            "outlier_frac": _frac(self.outliers, self.numel),
            "zero_frac": _frac(self.zeros, self.numel),
            "nonfinite": self.nonfinite,
            "scale": self.scale,
            "amax_history_max": self.amax_history_max,
        }
        assert tuple(out) == TENSOR_STATS
        if self.hist is not None:
            out["log2_hist"] = list(self.hist)
        return out


def _block_moments(c: torch.Tensor, hist: bool) -> Moments:
    """Scale-free part of one fp32 block: two-pass fp64 moments, amax, counts, histogram."""
    fin = torch.isfinite(c)
    v = c[fin].double()
    n = v.numel()
    a = v.abs()
    nz = a[a != 0]
    h = None
    if hist:
        e = torch.frexp(nz).exponent.long() - 1  # |x| in [2**e, 2**(e+1)), exact at powers of two
        h = tuple(torch.bincount((e - LOG2_HIST_LO).clamp(0, LOG2_HIST_BINS - 1), minlength=LOG2_HIST_BINS).tolist())
    mean = M2 = M3 = M4 = 0.0
    if n:
        mu = v.mean()
        d = v - mu
        mu = mu + d.mean()  # one refinement step of the two-pass mean
        d = v - mu
        d2 = d * d
        mean, M2, M3, M4 = float(mu), float(d2.sum()), float((d2 * d).sum()), float((d2 * d2).sum())
    return Moments(
        numel=c.numel(),
        n=n,
        mean=mean,
        M2=M2,
        M3=M3,
        M4=M4,
        amax=float(a.max()) if n else 0.0,
        zeros=int((c == 0).sum()),
        nonfinite=c.numel() - n,
        nonzero=nz.numel(),
        hist=h,
    )


def _frac(count: int, total: int) -> float:
    return count / total if total else 0.0


def _opt_add(a, b):
    return None if a is None or b is None else a + b


def _opt_float(v):
    return None if v is None else float(v)


def merge_moments(parts: Iterable[Moments]) -> Moments:
    """Merge any number of partials (micro-batches, ranks, blocks) left to right."""
    return reduce(Moments.merge, parts, Moments.empty())


def merge_stats(parts: Iterable[Moments]) -> dict:
    """Statistics of the concatenation of the parts' tensors (see the module docstring for outliers)."""
    return merge_moments(parts).to_stats()


def tensor_stats(
    x: torch.Tensor,
    *,
    fmt: Fp8Format | str | None = None,
    scale=None,
    amax_history_max: float | None = None,
    outlier_k: float = 6.0,
    hist: bool = True,
) -> dict:
    """SPEC section-4 statistics of ``x``: a dict with exactly TENSOR_STATS (+ "log2_hist" if hist)."""
    return Moments.from_tensor(
        x, fmt=fmt, scale=scale, amax_history_max=amax_history_max, outlier_k=outlier_k, hist=hist
    ).to_stats()


def per_sample_kurtosis(x: torch.Tensor, sample_dim: int = 0) -> float:
    """FOG's kurtosis: mean(x^4)/mean(x^2)^2 per sample (the other dims flattened, e.g. tokens x channels
    of one sequence), averaged over samples. Finite elements only, fp64 on fp32 values. Samples with no
    finite element or mean(x^2) == 0 are left out of the average; NaN when none is left.
    """
    xs = x.detach().to(torch.float32).movedim(sample_dim, 0)
    xs = xs.reshape(xs.shape[0], -1).double()
    fin = torch.isfinite(xs)
    x2 = torch.where(fin, xs * xs, torch.zeros_like(xs))
    cnt = fin.sum(1)
    m2 = x2.sum(1) / cnt
    k = (x2 * x2).sum(1) / cnt / (m2 * m2)
    k = k[(cnt > 0) & (m2 > 0)]
    return float(k.mean()) if k.numel() else NAN
