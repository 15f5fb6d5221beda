"""The Triton statistics compiled on a GPU (marked ``gpu``: skipped without CUDA), against the torch path (itself
tested against the fp64 oracle): adversarial tensors (NaN, +-Inf, zeros, subnormals, huge values, large mean, all
equal, empty, one element, bf16/fp16/fp32, non-contiguous) with a scale, current and delayed scaling and an outlier
center; one multi-tensor launch; rows deferred into one row; no host sync; the agent's hooks on the Triton path
against the torch path. Run with ``pytest -m gpu tests/agent tests/trainer`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from rowcheck import NO_CENTER, adversarial, agent_rows, bf16_pairs, rows_close, sync_free

from fp8mon.agent.stats import launch as ts
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.engine import engine
from fp8mon.agent.stats.tuning import MAXNREG_FP32

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = ["gaussian fp32 1M", "gaussian bf16 3M+5", "fp16 odd", "nan/inf", "zeros", "one element", "empty",
         "all equal 0.1", "large mean", "subnormal range", "huge", "heavy tail", "first tile zeros then 1000",
         "non-contiguous", "tiny gradients", "bf16 every binade", "bf16 nan/inf"]


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda")


@pytest.fixture(scope="module")
def cases(device):
    return adversarial(device)


def _check(problems: list[str]) -> None:
    failed = [p for p in problems if p]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("case", CASES)
def test_standalone_rows_equal_the_torch_path(cases, device, case):
    x, problems = cases[case], []
    for hist in (True, False):
        kw = dict(fmt="e4m3", scale=torch.tensor(3.0, device=device))
        got = ts.partials(x, **kw, hist=hist)
        problems.append(rows_close(got, ds.partials(x, **kw, hist=hist, outlier_center=NO_CENTER))[1])
    ahm = torch.tensor(2.5, device=device)
    got = ts.partials(x, fmt="e5m2", amax_history_max=ahm)
    problems.append(rows_close(got, ds.partials(x, fmt="e5m2", amax_history_max=ahm, outlier_center=NO_CENTER))[1])
    got = ts.partials(x, fmt="e4m3")
    binade = got[ds.HIST:].max().item() if x.numel() else 0  # documented bound: one binade's count
    problems.append(rows_close(got, ds.partials(x, fmt="e4m3", outlier_center=NO_CENTER), under_slack=binade)[1])
    x32 = x.float()
    fin = x32[torch.isfinite(x32)].double()
    c = (fin.mean().item(), fin.std(unbiased=False).item()) if fin.numel() else (0.0, float("nan"))
    got = ts.partials(x, center=torch.tensor(c, dtype=torch.float64, device=device))
    problems.append(rows_close(got, ds.partials(x, outlier_center=c))[1])
    want_self = ds.partials(x)  # the center as the two-pass path computes it
    n = want_self[ds.N].clamp(min=1)
    own = torch.stack([want_self[ds.MEAN], (want_self[ds.M2] / n).sqrt()])
    got = ts.partials(x, center=own)
    if fin.numel() and got[ds.OUTLIERS].item() != want_self[ds.OUTLIERS].item():
        problems.append(f"outliers {got[ds.OUTLIERS].item()} vs two-pass {want_self[ds.OUTLIERS].item()}")
    _check(problems)


def test_bf16_words_path(device):
    x, kinds = bf16_pairs(300_001, device)
    problems = []
    for center, k, kw in kinds:
        for hist in (False, True):
            got = ts.partials(x, center=center, outlier_k=k, hist=hist, **kw)
            want = ds.partials(x, outlier_center=center, outlier_k=k, hist=hist, **kw)
            why = rows_close(got, want)[1]
            problems.append(why and f"center {center} k {k} {sorted(kw)} hist={hist}: {why}")
    _check(problems)


def test_merge_about_the_grand_mean_when_the_first_partial_is_far(device):
    """An fp32 tensor (mean 1e4, std 1) whose first chunk is all NaN leaves partial 0 empty, far from the grand mean:
    the merge must take the moments about the grand mean again."""
    n = 3 << 20
    x = torch.randn(n, device=device, dtype=torch.float64) + 1e4
    x[: engine(device).chunk_elems([n], MAXNREG_FP32)] = float("nan")  # the launch's first chunk
    x = x.float()
    _check([rows_close(ts.partials(x, hist=False), ds.partials(x, hist=False, outlier_center=NO_CENTER))[1]])


@pytest.mark.parametrize("later", [False, True])
def test_two_tensors_deferred_into_one_row(device, later):
    """The second merged into the first (two micro-batches' rows of one site, in one flush): a large one, whose last
    program finishes late, then a small one. In one launch the small one's merge could read the row before the
    large one wrote it."""
    g = torch.Generator(device="cpu").manual_seed(9)
    a = (torch.randn(48 << 20, generator=g) * 2).to(torch.bfloat16).to(device)
    b = (torch.randn(3000, generator=g) * 5 + 1).to(torch.bfloat16).to(device)
    rows = torch.zeros(1, ds.WIDTH, dtype=torch.float64, device=device)
    ts.defer(a, ts.Target(rows, 0, False, (0.0, 2.0), 6.0, True, None, "e4m3"))
    ts.defer(b, ts.Target(rows, 0, True, (0.0, 2.0), 6.0, True, None, "e4m3"))
    if later:  # as a current-scaled cast's launch takes them, its rows merged by the next merge_later
        eng = engine(device)
        eng.launch_items(eng.take_deferred(), later=True)
    ts.flush_deferred()
    want = ds.merge(ds.partials(a, fmt="e4m3", outlier_center=(0.0, 2.0))[None],
                    ds.partials(b, fmt="e4m3", outlier_center=(0.0, 2.0))[None])
    binade = want[0, ds.HIST:].nan_to_num(0).max().item()  # current scaling's underflow: the histogram's bound
    _check([rows_close(rows[0], want[0], under_slack=binade)[1]])


def test_one_multi_tensor_launch(device):
    g = torch.Generator(device="cpu").manual_seed(2)
    xs = []
    for i in range(60):
        n = int(torch.randint(1, 300_000, (1,), generator=g))
        dt = (torch.bfloat16, torch.float32, torch.float16)[i % 3]
        xs.append((torch.randn(n, generator=g) * (i + 1) + i).to(dt).to(device))
    xs[7][3] = float("nan")
    fmts = [("e4m3", "e5m2", None)[i % 3] for i in range(len(xs))]
    scales = [None if f is None else torch.tensor(1.0 + i, device=device) for i, f in enumerate(fmts)]
    got = ts.rows(xs, fmt=fmts, scale=scales)
    each = torch.stack([ts.partials(x, fmt=f, scale=s) for x, f, s in zip(xs, fmts, scales)])
    # chunks are sized to the launch's total, so a tensor's programs, and the rounding of their fp32 sums, differ
    # between the two: the fp32 tolerance of the other checks, not equality
    problems = [rows_close(got, each)[1]]
    want = torch.stack([ds.partials(x, fmt=f, scale=s, outlier_center=NO_CENTER) for x, f, s in zip(xs, fmts, scales)])
    problems.append(rows_close(got, want)[1])
    base = torch.stack([ds.partials(x[: x.numel() // 2 + 1], fmt=f, scale=s, outlier_center=NO_CENTER)
                        for x, f, s in zip(xs, fmts, scales)])
    out = torch.zeros(2 * len(xs), ds.WIDTH, dtype=torch.float64, device=device)
    idx = list(range(1, 2 * len(xs), 2))
    out[idx] = base
    ts.rows(xs, fmt=fmts, scale=scales, out=out, index=idx, merge=True)
    problems.append(rows_close(out[idx], ds.merge(base, want))[1])
    _check(problems)


def test_launches_do_no_host_sync(device):
    xs = [torch.randn(1000 + 70_000 * i, device=device).to((torch.bfloat16, torch.float32)[i % 2]) for i in range(5)]
    scale = torch.tensor(2.0, device=device)
    center = torch.zeros(2, dtype=torch.float64, device=device)
    out = torch.zeros(8, ds.WIDTH, dtype=torch.float64, device=device)
    ahm = torch.tensor(3.0, device=device)

    def standalone():
        for i in range(30):
            ts.rows(xs, fmt="e4m3", scale=scale, center=center)
            ts.rows(xs, fmt=["e4m3", None, "e5m2", "e4m3", None], out=out, index=[0, 2, 4, 6, 7], merge=i > 0)
            ts.partials(xs[1], fmt="e5m2", amax_history_max=ahm, center=(0.0, 1.0))
            ts.rows(xs[:2], center=center, out=out, index=[1, 3], merge=True, later=True)
        ts.flush_deferred()

    standalone()  # warm: compiles, grows the staging ring
    _check([sync_free("stats.launch.rows (multi-tensor, device scale/center, merge, delayed, later)", standalone)])


@pytest.mark.parametrize("autocast,frozen", [(True, False), (True, True), (False, True)])
def test_agent_rows_on_the_triton_path_equal_the_torch_path(device, autocast, frozen):
    """The hooks' rows on the Triton path (merged later, at the step's end) against the torch path, for a bf16
    autocast step and an fp32 one, with the first linear frozen: its grad_output waits for a grad_weight that never
    comes and must still be merged into its own step."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device)
    if frozen:
        for p in model[0].parameters():
            p.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cpu").manual_seed(7)
    xs = [(torch.randn(8, 256, 1024, generator=g) * (1 + i)).to(device).requires_grad_(frozen) for i in range(6)]

    def make(step, micro):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return model(xs[2 * step + micro])

    rows = {}
    for backend in ("triton", "torch"):
        model.load_state_dict(state)
        rows[backend] = agent_rows(torch.nn.Identity(), make, 3, stats_backend=backend, watch=model)
    (tri, keys), (tor, keys2) = rows["triton"], rows["torch"]
    order = [keys2.index(k) for k in keys]
    problems = []
    for step in range(3):
        a, b = tri[step].clone(), tor[step][order].clone()
        a[:, ds.OUTLIERS] = b[:, ds.OUTLIERS] = 0  # the Triton path counts them against the last step's center
        present = int((b[:, ds.NUMEL] > 0).sum())
        if present != (9 if frozen else 10):
            problems.append(f"step {step}: {present} rows")
        why = rows_close(a, b, under_slack=b[:, ds.HIST:].max().item())[1]
        problems.append(why and f"step {step}: {why}")
    _check(problems)
