"""Helpers of the statistics tests (tests/agent, tests/trainer): ``row_problems`` says what differs between two rows,
``agent_rows`` trains a model under an agent and returns the rows it ships, ``sync_free`` finds host syncs."""

import torch

from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.transport import NullTransport

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
            bad.append(f"underflow {a[..., ds.UNDERFLOW].tolist()} vs {b[..., ds.UNDERFLOW].tolist()} "
                       f"(slack {under_slack})")
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


def rows_close(a: torch.Tensor, b: torch.Tensor, *, rtol=1e-6, under_slack=None) -> tuple[bool, str]:
    """``row_problems`` as (ok, detail), M2 with a floor of 1e-9 · n · scale² (large-mean tensors on the GPU)."""
    problems = row_problems(a, b, rtol=rtol, under_slack=under_slack, m2_floor=1e-9)
    return not problems, problems


def adversarial(device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    big = r(300_001)
    big[::9973] = float("nan")
    big[5::7919] = float("inf")
    big[7::7919] = -float("inf")
    cases = {
        "gaussian fp32 1M": r(1 << 20),
        "gaussian bf16 3M+5": r(3 * (1 << 20) + 5).to(torch.bfloat16),
        "fp16 odd": (r(100_003) * 10).half(),
        "nan/inf": big,
        "zeros": torch.zeros(70_000),
        "one element": torch.tensor([3.5]),
        "empty": torch.zeros(0),
        "all equal 0.1": torch.full((200_000,), 0.1),
        "large mean": r(500_000) * 1e-3 + 1e4,
        "subnormal range": r(100_000) * 1e-39,
        "huge": r(100_000) * 1e30,
        "heavy tail": r(400_000) ** 5,
        "first tile zeros then 1000": torch.cat([torch.zeros(8192), r(200_000) + 1000.0]),
        "non-contiguous": r(512, 768).t(),
        "tiny gradients": r(300_000) * 1e-12,
        # bf16 with the histogram takes the word loop and the shared-memory table: every binade, zeros and
        # subnormals in one tensor, and a non-finite one (the careful path's histogram)
        "bf16 every binade": (r(700_001) * torch.exp2(torch.randint(-140, 60, (700_001,), generator=g).float()))
        .to(torch.bfloat16),
        "bf16 nan/inf": big.to(torch.bfloat16),
    }
    return {k: v.to(device) for k, v in cases.items()}


def sync_free(name: str, fn) -> str:
    """Run ``fn`` under torch's sync debug mode; '' or the Python stack of every host sync it does."""
    import traceback
    import warnings

    torch.cuda.synchronize()
    stacks = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "ynchroniz" in str(message) and "prototype feature" not in str(message):
            stacks.append(f"{str(message).splitlines()[0]} at {filename}:{lineno}\n"
                          + "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return f"{name}: {len(stacks)} host syncs; first:\n{stacks[0]}" if stacks else ""


def agent_rows(model, make_input, steps: int, watch=None, micro_batches: int = 2,
               **agent_kw) -> tuple[list[torch.Tensor | None], list]:
    """(the packed rows the agent ships at each step, its slot keys), training ``micro_batches`` per step;
    ``watch``: the module watched, when ``make_input`` runs the model itself (``model`` is then applied to its
    output)."""
    from fp8mon.agent import Agent

    agent = Agent(transport=NullTransport(), every=1, **{"hist_every": 1, **agent_kw}).watch(watch or model)
    shipped = []
    agent._ship = lambda step, rows, values: shipped.append(None if rows is None else rows.clone())
    for step in range(steps):  # step 0 has no outlier center yet; the later ones use the previous step's
        (watch or model).zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            y = model(make_input(step, micro))
            y.float().square().mean().backward()
        agent.log(step)
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0, agent.last_error
    return shipped, keys
