"""Helpers of the trainer's statistics tests: comparing rows, and the rows an agent ships. They import fp8mon inside
each call, so that under the ``interpreted`` fixture they take its fresh copy."""

from __future__ import annotations

import torch


def row_problems(a: torch.Tensor, b: torch.Tensor, *, rtol=1e-6, under_slack=None, m2_floor=0.0) -> str:
    """'' when the statistics rows ``a`` and ``b`` agree, else what differs: counts, amax, scale, histogram
    exactly (underflow within ``under_slack`` if given); mean, M3 and M4 to ``rtol`` of the data's scale; M2 to
    ``rtol`` of (M2 + ``m2_floor`` · n · scale²)."""
    from fp8mon.agent.stats import torch_path as ds

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
            where = (~same).flatten().nonzero().flatten()[:4].tolist()
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


def hist_slack(row: torch.Tensor) -> float:
    """The underflow slack of a row whose underflow comes from the histogram (exact up to the threshold's binade)."""
    from fp8mon.agent.stats import torch_path as ds

    return float(row[ds.HIST:].nan_to_num(0).max())


def assert_rows(a: torch.Tensor, b: torch.Tensor, **kw) -> None:
    problems = row_problems(a, b, **kw)
    assert not problems, problems


class NullTransport:
    """A transport that sends nothing (the tests read the rows the agent would ship)."""

    def set_run_meta(self, **kw):
        pass

    def send_tensors(self, block):
        pass

    def send_scalars(self, block):
        pass

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        return True


def agent_rows(model, make_input, steps: int, device="cpu", micro_batches: int = 2, **agent_kw):
    """(the packed rows the agent ships at each step, its slot keys), training ``micro_batches`` per step."""
    from fp8mon.agent import Agent

    agent = Agent(transport=NullTransport(), every=1, **{"hist_every": 1, **agent_kw}).watch(model)
    shipped = []
    agent._ship = lambda step, rows, values: shipped.append(None if rows is None else rows.clone())
    for step in range(steps):  # step 0 has no outlier center yet; the later ones use the previous step's
        model.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            model(make_input(step, micro)).float().square().mean().backward()
        agent.log(step)
    keys = list(agent._slots.keys)
    agent.close()
    assert agent.errors == 0, agent.last_error
    return shipped, keys
