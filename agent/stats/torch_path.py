"""The torch path: per-tensor partial statistics computed on the tensor's device, as rows of one fp64 buffer.

A row holds the mergeable fields of ``stats.Moments`` (counts, fp64 mean and central moments M2..M4,
amax, scale, log2 histogram) in the layout of ``layout``, so that

* a step's rows for every (layer, site) live in one device tensor and reach the host in one copy;
* micro-batches, repeated calls and ranks merge exactly on the device (``merge``, the Chan/Pebay
  formulas of ``Moments.merge``, vectorised over rows);
* the host turns a row back into a ``Moments`` (``to_moments``) and derives the SPEC statistics with the
  oracle's own ``Moments.to_stats``.

Nothing here reads a device value on the host: no ``.item()``, no boolean indexing, no data-dependent
shapes. ``partials`` is the plain torch implementation; the Triton path (``launch.rows`` and the fused kernels)
produces the same row for the same arguments.

Absent optional fields (no format: underflow, overflow, scale; no history; no histogram) are NaN.
Counts are exact in fp64 up to 2**53 elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..formats import Fp8Format, by_name
from ..wire import LOG2_HIST_BINS, LOG2_HIST_HI, LOG2_HIST_LO
from .layout import (
    AMAX,
    AMAX_HISTORY_MAX,
    FIELDS,
    HIST,
    M2,
    M3,
    M4,
    MEAN,
    NONFINITE,
    NONZERO,
    NUMEL,
    OUTLIERS,
    OVERFLOW,
    PARTS,
    SCALE,
    UNDERFLOW,
    WIDTH,
    ZEROS,
    N,
)
from .reference import Moments

NAN = float("nan")


def empty(rows: int, device=None) -> torch.Tensor:
    """``rows`` rows that observed nothing: the identity of ``merge``."""
    return torch.zeros(rows, WIDTH, dtype=torch.float64, device=device)


def as_scale(scale, device) -> torch.Tensor:
    """The scale as a float32 0-d tensor on ``device``, without a blocking host-to-device copy."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, margin: float = 0.0) -> torch.Tensor:
    """fmt.max / amax / 2**margin as float32 (1.0 where amax is 0 or non-finite), rounded once from the
    exact quotient like the oracle's Python-float scales. (``formats.current_scale`` on a tensor computes
    ``reciprocal(amax) * max``, which is an fp32 ulp off in ~1/3 of cases.)"""
    a = amax.to(torch.float64)
    ok = torch.isfinite(a) & (a > 0)
    s = torch.full_like(a, fmt.max) / torch.where(ok, a, 1.0) / 2.0**margin
    return torch.where(ok, s, 1.0).to(torch.float32)


def partials(
    x: torch.Tensor,
    *,
    fmt: Fp8Format | str | None = None,
    scale=None,
    amax_history_max=None,
    outlier_k: float = 6.0,
    hist: bool = True,
    outlier_center=None,
) -> torch.Tensor:
    """One row (shape ``[WIDTH]``, fp64, on ``x.device``) equal to ``Moments.from_tensor`` with the same
    arguments. ``scale`` and ``amax_history_max`` may be numbers or (device) tensors; ``fmt`` without
    ``scale`` uses the delayed scale of ``amax_history_max`` when given (margin 0), else current scaling.
    ``outlier_center`` = (mean, std) (numbers or an fp64 tensor of 2) counts outliers against that center
    instead of this tensor's own mean/std, as the Triton path (``stats.launch``) does; a NaN std counts none.

    Per-row scales (torchao's rowwise casts, ``torchao_sites``): ``scale`` may be a tensor that broadcasts to
    ``x.shape`` (x * scale is what the cast rounds), or a list of such scales and numbers, one per cast of the same
    tensor (an operand cast along its rows for one GEMM and along its columns for another): an element underflows
    or overflows when it does in any of them, and the row's ``scale`` is the smallest scale in use. (The oracle,
    ``Moments.from_tensor``, takes one number; these are tested against torchao's own casts.)
    """
    if fmt is None and scale is not None:
        raise ValueError("a scale needs an FP8 format (fmt='e4m3' or 'e5m2')")
    fmt = None if fmt is None else by_name(fmt)
    dev = x.device
    x32 = x.detach().reshape(-1).to(torch.float32)
    numel = x32.numel()

    fin = torch.isfinite(x32)
    v32 = torch.where(fin, x32, 0.0)  # a non-finite element adds 0 to every sum and count below
    a32 = v32.abs()
    nz = a32 != 0
    n = fin.sum().to(torch.float64)
    n1 = n.clamp(min=1.0)
    # two-pass mean with one refinement step, then the central moments, in fp64 as the oracle does
    d = v32.to(torch.float64)
    mu = d.sum() / n1
    d.sub_(mu).masked_fill_(~fin, 0.0)  # d = x - mean on finite elements, 0 elsewhere
    r = d.sum() / n1
    mu = mu + r
    d.sub_(r).masked_fill_(~fin, 0.0)
    d2 = d * d
    m2, m3, m4 = _dot(d, d), _dot(d2, d), _dot(d2, d2)
    amax32 = a32.amax() if numel else torch.zeros((), dtype=torch.float32, device=dev)
    if outlier_center is None:
        # with n == 0 the limit is 0 and every |d| is 0: no outlier, as the oracle's NaN limit gives
        outliers = (d.abs_() > outlier_k * (m2 / n1).sqrt()).sum()
    else:
        c = outlier_center
        c_mean, c_std = (c[0], c[1]) if not isinstance(c, torch.Tensor) else (c.reshape(2)[0], c.reshape(2)[1])
        c_mean, c_std = _f64(c_mean, dev), _f64(c_std, dev)
        outliers = (((x32.to(torch.float64) - c_mean).abs() > outlier_k * c_std) & fin).sum()

    if fmt is None:
        under = over = s = _f64(NAN, dev)
    else:
        if scale is not None and not is_scalar_scale(scale):
            under, over, s32 = _cast_losses(v32, x.shape, scale, fmt, nz)
        else:
            if scale is not None:
                s32 = as_scale(scale, dev)
            elif amax_history_max is not None:  # delayed scale from the history max, margin 0
                s32 = scale_from_amax(_f64(amax_history_max, dev), fmt)
            else:
                s32 = scale_from_amax(amax32, fmt)
            y = (v32 * s32).abs()
            under = ((y <= fmt.underflow_threshold) & nz).sum()
            over = (y > fmt.overflow_threshold).sum()
        s = s32
    ahm = _f64(NAN if amax_history_max is None else amax_history_max, dev)
    head = [n, numel - n, (x32 == 0).sum(), nz.sum(), outliers, under, over, amax32, mu, m2, m3, m4, s, ahm]
    # (`row[i] = 1.0` would copy a host scalar to the device: a synchronising copy on CUDA; fill_ is not)
    row = torch.empty(WIDTH, dtype=torch.float64, device=dev)
    row[PARTS].fill_(1.0)
    row[NUMEL].fill_(float(numel))
    row[N:HIST] = torch.stack([t.to(torch.float64) for t in head])
    if hist:
        # |x| in [2**e, 2**(e+1)) for frexp's exponent e + 1: exact at powers of two and for subnormals.
        # histc over the integer exponents (zeros and non-finite pushed below the range, where histc
        # ignores them) uses block-local atomics; fp64 keeps every count exact.
        e = torch.frexp(a32).exponent.sub_(1).clamp_(LOG2_HIST_LO, LOG2_HIST_HI - 1).masked_fill_(~nz, LOG2_HIST_LO - 8)
        row[HIST:] = torch.histc(e.to(torch.float64), LOG2_HIST_BINS, LOG2_HIST_LO, LOG2_HIST_HI)
    else:
        row[HIST:].fill_(NAN)
    return row


def is_scalar_scale(scale) -> bool:
    """Whether ``scale`` is one number for the whole tensor (what the Triton kernels take), not per-row scales nor
    the scales of several casts (see ``partials``)."""
    return not isinstance(scale, (list, tuple)) and not (isinstance(scale, torch.Tensor) and scale.numel() != 1)


def _cast_losses(v32: torch.Tensor, shape: torch.Size, scales, fmt: Fp8Format,
                 nz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(underflow count, overflow count, smallest scale) of the casts of a tensor (``v32``: its finite elements,
    flat, 0 elsewhere) with ``scales``: one per cast, each a number or a tensor that broadcasts to ``shape``
    (per-row scales). An element counts once when it is lost in any of the casts."""
    casts = list(scales) if isinstance(scales, (list, tuple)) else [scales]
    if not casts:
        raise ValueError("scale: an empty list of casts")
    v = v32.reshape(shape)
    lost_under = torch.zeros_like(nz)
    lost_over = torch.zeros_like(nz)
    smallest = []
    for s in casts:
        if isinstance(s, torch.Tensor) and s.numel() != 1:
            try:
                fits = torch.broadcast_shapes(tuple(shape), tuple(s.shape)) == tuple(shape)
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"a scale of shape {tuple(s.shape)} does not broadcast to the tensor's {tuple(shape)}")
            s32 = s.detach().to(device=v.device, dtype=torch.float32, non_blocking=True)
        else:
            s32 = as_scale(s, v.device)
        y = (v * s32).abs().reshape(-1)
        lost_under |= y <= fmt.underflow_threshold
        lost_over |= y > fmt.overflow_threshold
        if s32.numel():
            smallest.append(s32.amin())
    s = torch.stack(smallest).amin() if smallest else torch.full((), NAN, dtype=torch.float32, device=v.device)
    return (lost_under & nz).sum(), lost_over.sum(), s


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) without materialising the product (BLAS dot; its length is a 32-bit int)."""
    if a.numel() < 2**31:
        return torch.dot(a, b)
    return (a * b).sum()


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements (0 when none), as a float32 0-d tensor: the scale-only path."""
    a = x.detach().reshape(-1).to(torch.float32).abs()
    if not a.numel():
        return a.new_zeros(())
    return torch.where(torch.isfinite(a), a, 0.0).amax()


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact merge of rows ``a`` and ``b`` (any matching leading shape): ``Moments.merge`` in torch.
    A row that observed nothing (parts 0) is the identity, then one of an empty tensor (numel 0), as in
    the oracle; ``parts`` always adds up."""
    na, nb = a[..., N], b[..., N]
    n = na + nb
    n1 = n.clamp(min=1.0)
    d = b[..., MEAN] - a[..., MEAN]
    a2, b2, a3, b3 = a[..., M2], b[..., M2], a[..., M3], b[..., M3]
    mean = a[..., MEAN] + d * nb / n1
    m2 = a2 + b2 + d * d * na * nb / n1
    m3 = a3 + b3 + d**3 * na * nb * (na - nb) / n1**2 + 3.0 * d * (na * b2 - nb * a2) / n1
    m4 = (a[..., M4] + b[..., M4] + d**4 * na * nb * (na * na - na * nb + nb * nb) / n1**3
          + 6.0 * d * d * (na * na * b2 + nb * nb * a2) / n1**2 + 4.0 * d * (na * b3 - nb * a3) / n1)
    moments = torch.stack([mean, m2, m3, m4], -1)
    # one side without finite elements: keep the other side's moments as they are (no rounding)
    moments = torch.where((nb == 0).unsqueeze(-1), a[..., MEAN:M4 + 1], moments)
    moments = torch.where((na == 0).unsqueeze(-1), b[..., MEAN:M4 + 1], moments)

    out = torch.empty_like(a)
    out[..., :AMAX] = a[..., :AMAX] + b[..., :AMAX]  # counts; NaN (absent) propagates, as None does
    out[..., AMAX] = torch.maximum(a[..., AMAX], b[..., AMAX])
    out[..., MEAN:M4 + 1] = moments
    out[..., SCALE] = torch.minimum(a[..., SCALE], b[..., SCALE])
    out[..., AMAX_HISTORY_MAX] = torch.fmax(a[..., AMAX_HISTORY_MAX], b[..., AMAX_HISTORY_MAX])
    out[..., HIST:] = a[..., HIST:] + b[..., HIST:]
    # a row that observed nothing (parts 0) is the identity; then, as in the oracle, an empty tensor's
    out = torch.where((b[..., NUMEL] == 0).unsqueeze(-1), a, out)
    out = torch.where((a[..., NUMEL] == 0).unsqueeze(-1), b, out)
    out = torch.where((b[..., PARTS] == 0).unsqueeze(-1), a, out)
    out = torch.where((a[..., PARTS] == 0).unsqueeze(-1), b, out)
    out[..., PARTS] = a[..., PARTS] + b[..., PARTS]
    return out


def merge_all(rows: torch.Tensor) -> torch.Tensor:
    """Merge ``rows[0], rows[1], ...`` (the first dimension) pairwise, in order: ``[k, ..., WIDTH]`` to
    ``[..., WIDTH]``. log2(k) vectorised merges."""
    if rows.shape[0] == 0:
        return empty(1, rows.device).reshape(rows.shape[1:])
    while rows.shape[0] > 1:
        k = rows.shape[0] // 2
        merged = merge(rows[0:2 * k:2], rows[1:2 * k:2])
        rows = torch.cat([merged, rows[2 * k:]]) if rows.shape[0] % 2 else merged
    return rows[0]


# ---- host side ------------------------------------------------------------------------------------

def to_moments(row: Sequence[float]) -> Moments:
    """A row read back on the host (a list of floats) as the oracle's ``Moments``."""
    return Moments(
        numel=int(row[NUMEL]),
        n=int(row[N]),
        mean=row[MEAN],
        M2=row[M2],
        M3=row[M3],
        M4=row[M4],
        amax=row[AMAX],
        zeros=int(row[ZEROS]),
        nonfinite=int(row[NONFINITE]),
        nonzero=int(row[NONZERO]),
        outliers=int(row[OUTLIERS]),
        underflow=_opt_int(row[UNDERFLOW]),
        overflow=_opt_int(row[OVERFLOW]),
        scale=_opt(row[SCALE]),
        amax_history_max=_opt(row[AMAX_HISTORY_MAX]),
        hist=None if math.isnan(row[HIST]) else tuple(int(c) for c in row[HIST:]),
    )


def from_moments(m: Moments, device=None) -> torch.Tensor:
    """The row of a ``Moments`` (e.g. computed on the host by a layer), on ``device``."""
    row = [NAN] * WIDTH
    row[PARTS] = 1.0
    for i, name in enumerate(FIELDS[1:], 1):
        value = getattr(m, name)
        row[i] = NAN if value is None else float(value)
    if m.hist is not None:
        row[HIST:] = [float(c) for c in m.hist]
    return torch.tensor(row, dtype=torch.float64).to(device)


def _f64(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64, non_blocking=True).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _opt(v: float):
    return None if math.isnan(v) else v


def _opt_int(v: float):
    return None if math.isnan(v) else int(v)
