"""The interpreter-side checks of tests/agent/test_triton_stats.py: each runs in a worker process that Triton runs
in its interpreter (TRITON_INTERPRET=1 must be set before the kernels are defined), compares the Triton path's rows
with the torch path's (itself tested against the fp64 oracle) and raises AssertionError listing every difference."""

from __future__ import annotations

import torch
from rowcheck import NO_CENTER, row_problems
from rowcheck import bf16_pairs as bf16_pairs_cases
from torch import nn

from fp8mon.agent import Agent
from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.engine import engine

_problems: list[tuple[str, str]] = []
cpu = engine("cpu")


def setup() -> None:
    """The worker's set-up: one thread, and a small chunk and tile, so that small tensors still span several
    programs (5000 elements: 2) and several tiles per program (the merge and the tile loop are exercised)."""
    from interpreter_speed import patch_once

    patch_once()
    torch.set_num_threads(1)
    cpu.chunk, cpu.tile_rows = 4096, 128


def run(check: str) -> None:
    """Run the check of that name; AssertionError with every problem it found."""
    _problems.clear()
    globals()[check]()
    failed = [f"{name}: {problem}" for name, problem in _problems if problem]
    assert not failed, "\n".join(failed)


def emit(name: str, problem: str) -> None:
    _problems.append((name, problem))


class _Null:
    def set_run_meta(self, **kw): ...
    def flush(self, timeout=None): return True
    def close(self, timeout=None): return True


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nanny = r(5000)
    nanny[::701] = float("nan")
    nanny[3::997] = float("inf")
    nanny[5::997] = -float("inf")
    return {
        "gaussian_fp32": r(5000) * 3 + 1,
        "gaussian_bf16_odd": r(4099).to(torch.bfloat16),
        "fp16": (r(3000) * 10).half(),
        "nan_inf": nanny,
        "zeros": torch.zeros(3000),
        "one_element": torch.tensor([3.5]),
        "empty": torch.zeros(0),
        "all_equal": torch.full((5000,), 0.1),
        "large_mean": r(5000) * 1e-3 + 1e4,
        "subnormal_range": r(3000) * 1e-39,
        "huge": r(3000) * 1e30,
        "heavy_tail": r(5000) ** 5,
        "first_tile_zeros": torch.cat([torch.zeros(1024), r(3000) + 1000.0]),
        "tiny": r(3000) * 1e-12,
        "non_contiguous": r(40, 70).t(),
    }


def rows_vs_torch():
    for i, (case, x) in enumerate(_cases().items()):
        s = torch.tensor(3.0)
        got = ts.partials(x, fmt="e4m3", scale=s)
        emit(f"rows_vs_torch:{case}:scale",
             row_problems(got, ds.partials(x, fmt="e4m3", scale=s, outlier_center=NO_CENTER)))
        if i % 3 == 0:
            got = ts.partials(x, fmt="e4m3", scale=s, hist=False)
            emit(f"rows_vs_torch:{case}:no_hist",
                 row_problems(got, ds.partials(x, fmt="e4m3", scale=s, hist=False, outlier_center=NO_CENTER)))
        if i % 3 == 1:
            got = ts.partials(x, fmt="e5m2", amax_history_max=2.5)
            emit(f"rows_vs_torch:{case}:delayed",
                 row_problems(got, ds.partials(x, fmt="e5m2", amax_history_max=2.5, outlier_center=NO_CENTER)))
        if i % 3 == 2:
            got = ts.partials(x)  # no format: underflow, overflow, scale absent
            emit(f"rows_vs_torch:{case}:no_format", row_problems(got, ds.partials(x, outlier_center=NO_CENTER)))


def current_scaling():
    for case, x in list(_cases().items())[::2]:
        got = ts.partials(x, fmt="e4m3")
        want = ds.partials(x, fmt="e4m3", outlier_center=NO_CENTER)
        binade = float(got[ds.HIST:].max()) if x.numel() else 0.0  # the documented bound
        emit(f"current_scaling:{case}", row_problems(got, want, under_slack=binade))


def outliers_with_center():
    for i, (case, x) in enumerate(_cases().items()):
        fin = x.float()[torch.isfinite(x.float())].double()
        own = (float(fin.mean()) if fin.numel() else 0.0, float(fin.std()) if fin.numel() > 1 else 0.0)
        for center in ((0.5, 1.0), own) if i % 4 == 0 else (own,):
            got = ts.partials(x, center=torch.tensor(center, dtype=torch.float64), outlier_k=2.0)
            want = ds.partials(x, outlier_center=center, outlier_k=2.0)
            emit(f"outliers_with_center:{case}:{center[0]:.3g}", row_problems(got, want))


def bf16_pairs():
    """bf16 without the histogram: the fast path takes two elements per 32-bit word (counts, outliers and
    amax straight from the words), on rowcheck's adversarial tensor and cases."""
    x, cases = bf16_pairs_cases(9001, "cpu")
    for center, k, kw in cases:
        got = ts.partials(x, center=center, outlier_k=k, hist=False, **kw)
        want = ds.partials(x, outlier_center=center, outlier_k=k, hist=False, **kw)
        emit(f"bf16_pairs:{center}:{sorted(kw)}:{kw.get('scale', '')}", row_problems(got, want))


def multi_tensor():
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(int(torch.randint(1, 6000, (1,), generator=g)), generator=g) * (i + 1) + i)
          .to((torch.bfloat16, torch.float32, torch.float16)[i % 3]) for i in range(12)]
    xs[4][2] = float("nan")
    fmts = [("e4m3", "e5m2", None)[i % 3] for i in range(len(xs))]
    scales = [None if f is None else torch.tensor(1.0 + i) for i, f in enumerate(fmts)]
    one = ts.rows(xs, fmt=fmts, scale=scales)
    each = torch.stack([ts.partials(x, fmt=f, scale=s) for x, f, s in zip(xs, fmts, scales)])
    emit("multi_tensor:one_launch_equals_per_tensor", row_problems(one, each, rtol=1e-12))
    want = torch.stack([ds.partials(x, fmt=f, scale=s, outlier_center=NO_CENTER) for x, f, s in zip(xs, fmts, scales)])
    emit("multi_tensor:equals_torch", row_problems(one, want))
    base = torch.stack([ds.partials(x[: x.numel() // 2], fmt=f, scale=s, outlier_center=NO_CENTER)
                        for x, f, s in zip(xs, fmts, scales)])
    base[3] = ds.empty(1)[0]  # a row that observed nothing: the merge identity
    out = torch.zeros(2 * len(xs), ds.WIDTH, dtype=torch.float64)
    idx = list(range(1, 2 * len(xs), 2))
    out[idx] = base
    ts.rows(xs, fmt=fmts, scale=scales, out=out, index=idx, merge=True)
    emit("multi_tensor:merged_into_rows", row_problems(out[idx], ds.merge(base, want)))
    emit("multi_tensor:other_rows_untouched", "" if bool((out[0::2] == 0).all()) else "rows written outside index")


def merged_later():
    """Rows launched with ``later``: the rows stay as they were until ``flush_deferred`` merges them, then equal
    the rows merged by the launch's last program, written over or merged into (twice into one row before a
    flush: the first merge goes first); a scale known before the read is refused, as the merge knows none."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(5000, generator=g) * 2 + 1, (torch.randn(3001, generator=g) * 40).to(torch.bfloat16)]
    xs[1][5] = float("nan")
    for hist in (True, False):
        base = torch.stack([ds.partials(x[:1000], fmt="e4m3", hist=hist) for x in xs])
        want = torch.zeros(3, ds.WIDTH, dtype=torch.float64)
        want[:2] = base
        ts.rows(xs, fmt="e4m3", center=(0.5, 3.0), hist=hist, out=want, index=[0, 1], merge=[False, True])
        ts.rows(xs[:1], fmt="e4m3", center=(0.5, 3.0), hist=hist, out=want, index=[2])
        ts.rows(xs[:1], fmt="e4m3", center=(0.5, 3.0), hist=hist, out=want, index=[2], merge=True)
        got = torch.zeros(3, ds.WIDTH, dtype=torch.float64)
        got[:2] = base
        ts.rows(xs, fmt="e4m3", center=(0.5, 3.0), hist=hist, out=got, index=[0, 1], merge=[False, True],
                later=True)
        ts.rows(xs[:1], fmt="e4m3", center=(0.5, 3.0), hist=hist, out=got, index=[2], later=True)
        untouched = torch.equal(got[:2].nan_to_num(7.0), base.nan_to_num(7.0)) and bool((got[2] == 0).all())
        waiting = "" if untouched else "rows written before the merge"
        ts.rows(xs[:1], fmt="e4m3", center=(0.5, 3.0), hist=hist, out=got, index=[2], merge=True, later=True)
        ts.flush_deferred()
        emit(f"merged_later:hist={hist}", waiting or row_problems(got, want, rtol=1e-12))
    try:
        ts.rows(xs, fmt="e4m3", scale=2.0, later=True)
        emit("merged_later:scale_refused", "a scale was taken")
    except ValueError:
        emit("merged_later:scale_refused", "")


def many_partials():
    """One tensor cut into more programs than the finalize step merges per block (8 lanes in the
    interpreter, several blocks' worth of partials and of histograms): the per-lane merges."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(30011, generator=g) * 3 + 1).to(torch.bfloat16)
    x[7] = 0.0
    chunk = cpu.chunk
    cpu.chunk = 512  # 59 programs
    try:
        s = torch.tensor(3.0)
        emit("many_partials:scale", row_problems(ts.partials(x, fmt="e4m3", scale=s),
                                                 ds.partials(x, fmt="e4m3", scale=s, outlier_center=NO_CENTER)))
        got = ts.partials(x, fmt="e5m2", amax_history_max=2.5, hist=False)
        emit("many_partials:delayed_no_hist", row_problems(
            got, ds.partials(x, fmt="e5m2", amax_history_max=2.5, hist=False, outlier_center=NO_CENTER)))
    finally:
        cpu.chunk = chunk


def far_first_partial():
    """The merge shifts every partial's moments to partial 0's mean; where that mean is far from the grand
    mean in units of the std (a first chunk all NaN), it merges again about the grand mean. A step between
    the first chunk and the rest stays within the shift's bound (about 1.4 std here) and takes one round."""
    g = torch.Generator().manual_seed(3)
    body = torch.randn(2 * cpu.chunk, generator=g, dtype=torch.float64) + 1e4
    for name, head in (("nan_first_chunk", torch.full((cpu.chunk,), float("nan"), dtype=torch.float64)),
                       ("step_between_chunks", torch.randn(cpu.chunk, generator=g, dtype=torch.float64) * 1e-3)):
        x = torch.cat([head, body]).float()
        emit(f"far_first_partial:{name}", row_problems(ts.partials(x, hist=False),
                                                       ds.partials(x, hist=False, outlier_center=NO_CENTER)))


def agent_backends(name="agent_backends", frozen=False):
    """The agent on the Triton path vs the torch path: same rows, except outliers, which the Triton
    path counts against the previous reporting step's mean/std of the slot. ``frozen``: the first linear's
    weight and bias frozen after watch() (and the input requiring grad), so its grad_output, the backward's last,
    waits for a grad_weight that never comes and is launched as the step ends, before the rows merged later are
    (``HookSink.launch_pending``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    xs = [torch.randn(8, 32) * (1 + i) for i in range(3)]

    shipped = {}
    for backend in ("triton", "torch"):
        model.load_state_dict(state)
        agent = Agent(transport=_Null(), every=1, stats_backend=backend).watch(model)
        for p in model[0].parameters():
            p.requires_grad_(not frozen)
        shipped[backend] = []
        agent._ship = lambda step, rows, values, b=backend: shipped[b].append(rows.clone())
        for step, x in enumerate(xs):
            model.zero_grad(set_to_none=True)
            model(x.requires_grad_(frozen)).square().mean().backward()
            agent.log(step)
        errors = agent.errors
        agent.close()
        emit(f"{name}:{backend}:no_errors", "" if errors == 0 else agent.last_error)
    tri, tor = shipped["triton"], shipped["torch"]
    for step in range(len(xs)):
        a, b = tri[step].clone(), tor[step].clone()
        # outliers: none before a center exists (step 0); later steps see agent_outlier_centers
        problem = "" if step or bool((a[:, ds.OUTLIERS] == 0).all()) else "outliers before any center"
        a[:, ds.OUTLIERS] = b[:, ds.OUTLIERS] = 0
        # the torch path emulates current scaling exactly; the kernel derives underflow from the histogram
        slack = float(b[:, ds.HIST:].max())
        if frozen and not bool((b[:, ds.NUMEL] > 0).sum() == 9):  # 2 x 5 sites, less the frozen grad_weight
            problem = f"{int((b[:, ds.NUMEL] > 0).sum())} rows on the torch path, not 9"
        emit(f"{name}:step{step}:rows", problem or row_problems(a, b, under_slack=slack))


def agent_waiting_grad_output():
    agent_backends("agent_waiting_grad_output", frozen=True)


def agent_outlier_centers():
    """Step 1's outliers on the Triton path = torch count against step 0's (mean, std) of the slot."""
    torch.manual_seed(1)
    lin = nn.Linear(16, 16)
    x0, x1 = torch.randn(64, 16), torch.randn(64, 16) * 3

    agent = Agent(transport=_Null(), every=1, stats_backend="triton", sites=("input",), outlier_k=1.0).watch(lin)
    rows = []
    agent._ship = lambda step, r, values: rows.append(r.clone())
    for step, x in enumerate((x0, x1)):
        with torch.no_grad():
            lin(x)
        agent.log(step)
    agent.close()
    fin = x0.double()
    center = (float(fin.mean()), float(fin.std(unbiased=False)))
    want = ds.partials(x1, outlier_center=center, outlier_k=1.0)[ds.OUTLIERS]
    got = rows[1][0, ds.OUTLIERS]
    emit("agent_outlier_centers", "" if float(got) == float(want) and float(want) > 0 else f"{got} vs {want}")
