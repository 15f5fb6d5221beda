"""Two ranks on CPU (gloo over 127.0.0.1): per-rank records carry their rank; with reduce_ranks=True the
rank reduction of each reporting step merges them exactly and only rank 0 sends, as rank -1."""

import math
import os
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fp8mon.agent import Agent, distributed
from fp8mon.agent.stats.reference import Moments, merge_moments
from fp8mon.agent.wire import SITES, TENSOR_STATS
from fp8mon.monitor.localserver import free_port
from tests.agent.ranks import join_group

WORLD = 2
STEPS = 4
EVERY = 2
FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}
SHARED_SCALE = 2.0**-8  # layer "0" input, both ranks: underflow counts then merge exactly too


class Capture:
    def __init__(self):
        self.tensors, self.scalars = [], []

    def send_tensors(self, block):
        self.tensors.append(block)

    def send_scalars(self, block):
        self.scalars.append(block)

    def set_run_meta(self, **meta):
        pass

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        return True


def records(blocks):
    out = {}
    for b in blocks:
        for i, key in enumerate(zip(b["layer"], b["site"])):
            full = (b["step"], *key, b["rank"])
            assert full not in out
            out[full] = {name: col[i] for name, col in b["stats"].items()} | {"log2_hist": b["log2_hist"][i]}
    return out


def _worker(rank, port, outdir, backend="gloo"):
    dev = join_group(rank, port, WORLD, backend)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dev)
        seen = defaultdict(list)
        step_now = [0]
        for name in ("0", "2"):
            mod = model.get_submodule(name)

            def fwd(m, args, out, name=name):
                key = (step_now[0], name)
                seen[(*key, "input")].append(args[0].detach().clone())
                seen[(*key, "output")].append(out.detach().clone())
                seen[(*key, "weight")].append(m.weight.detach().clone())
                out.register_hook(lambda g: seen[(*key, "grad_output")].append(g.detach().clone()))

            mod.register_forward_hook(fwd)
            mod.weight.register_post_accumulate_grad_hook(
                lambda p, name=name: seen[(step_now[0], name, "grad_weight")].append(p.grad.detach().clone()))
        reduced_cap, local_cap = Capture(), Capture()
        reduced = Agent(transport=reduced_cap, hist_every=1, every=EVERY, reduce_ranks=True).watch(model)
        reduced.set_scale("0", "input", SHARED_SCALE)
        local = Agent(transport=local_cap, hist_every=1, every=EVERY).watch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS):
            step_now[0] = step
            x = torch.randn(3 + 2 * rank, 6, generator=g) * (1 + 3 * rank) + rank  # ranks differ in n, scale, mean
            x = x.to(dev)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            reduced.log(step, loss=loss)
            local.log(step, loss=loss)
        reduced.close()
        local.close()
        torch.save({"reduced": reduced_cap.tensors, "reduced_scalars": reduced_cap.scalars, "local": local_cap.tensors,
                    "errors": (reduced.errors, local.errors), "rank": (reduced.rank, reduced.world, reduced.reduce),
                    "seen": {k: [t.cpu() for t in v] for k, v in seen.items()}}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(outdir, backend):
    mp.start_processes(_worker, args=(free_port(), str(outdir), backend), nprocs=WORLD, join=True,
                       start_method="spawn")
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ranks"), "gloo")


def oracle(tensors, site, **kw):
    fmt = FORMATS[site]
    return [Moments.from_tensor(t, fmt=fmt, **({} if fmt is None else kw)) for t in tensors]


def per_step(seen, step, layer, site):
    tensors = seen[(step, layer, site)]
    return tensors[:1] if site == "weight" else tensors[-1:] if site == "grad_weight" else tensors


EXACT = ("numel", "nonfinite", "amax", "zero_frac", "scale", "amax_history_max", "outlier_frac", "underflow_frac",
         "overflow_frac", "log2_hist")
GPU_MOMENTS = 1e-5  # a GPU rank's row sums fp32 partials; on the CPU the rows are fp64


def close(g, w, key, rel=1e-9, rms=0.0):
    """The counts, amax and histogram exactly; the moments' statistics to ``rel`` (the mean also to ``rel`` of the
    data's rms: it may be near 0)."""
    if w is None or g is None:
        return g is None and w is None
    if isinstance(w, float) and math.isnan(w):
        return math.isnan(g)
    if key in EXACT:
        return g == w
    return math.isclose(g, w, rel_tol=rel, abs_tol=rel * rms if key == "mean" else 0.0)


def differing(rec, want, rel):
    return {k: (rec[k], want[k]) for k in [*TENSOR_STATS, "log2_hist"]
            if not close(rec[k], want[k], k, rel, want.get("rms") or 0.0)}


def test_every_rank_reports_its_own_records(two_ranks):
    check_local(two_ranks)


def test_reduced_records_equal_the_statistics_of_the_concatenation(two_ranks):
    check_reduced(two_ranks)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus(tmp_path):
    outs = run_ranks(tmp_path, "nccl")
    check_local(outs, rel=GPU_MOMENTS)
    check_reduced(outs, rel=GPU_MOMENTS)


def check_local(two_ranks, rel=1e-9):
    for rank, out in enumerate(two_ranks):
        assert out["errors"] == (0, 0) and out["rank"] == (rank, WORLD, True)
        recs = records(out["local"])
        assert set(recs) == {(s, layer, site, rank) for s in range(0, STEPS, EVERY) for layer in ("0", "2")
                             for site in SITES}
        for (step, layer, site, _), rec in recs.items():
            want = merge_moments(oracle(per_step(out["seen"], step, layer, site), site)).to_stats()
            assert not differing(rec, want, rel), (step, layer, site, differing(rec, want, rel))


def check_reduced(two_ranks, rel=1e-9):
    assert two_ranks[1]["reduced"] == [] and two_ranks[1]["reduced_scalars"] == []  # only rank 0 sends
    recs = records(two_ranks[0]["reduced"])
    assert set(recs) == {(s, layer, site, -1) for s in range(0, STEPS, EVERY) for layer in ("0", "2") for site in SITES}
    assert {b["rank"] for b in two_ranks[0]["reduced_scalars"]} == {0}  # scalars: rank 0's own
    shared_checked = 0
    for (step, layer, site, _), rec in recs.items():
        parts = [t for out in two_ranks for t in per_step(out["seen"], step, layer, site)]
        kw = {"scale": SHARED_SCALE} if (layer, site) == ("0", "input") else {}
        whole = Moments.from_tensor(torch.cat([p.reshape(-1) for p in parts]), fmt=FORMATS[site], **kw).to_stats()
        merged = merge_moments(oracle(parts, site, **kw)).to_stats()
        # per-rank counts: outliers against each rank's mean/std; under current scaling, each rank's own scale
        per_rank = ["outlier_frac"] + (["underflow_frac", "overflow_frac"] if not kw else [])
        for key in [*TENSOR_STATS, "log2_hist"]:
            want = merged[key] if key in per_rank else whole[key]
            assert close(rec[key], want, key, rel, whole["rms"] or 0.0), (step, layer, site, key, rec[key], want)
        if kw:
            assert 0 < rec["underflow_frac"] < 1
            shared_checked += 1
    assert shared_checked == 2
    # the ranks really differ, so the merge is not trivial
    a, b = (out["seen"][(0, "0", "input")][0] for out in two_ranks)
    assert a.shape != b.shape and abs(float(a.mean()) - float(b.mean())) > 0.5


def test_without_process_group_reduce_is_a_no_op():
    assert distributed.rank_and_world() == (0, 1)
    cap = Capture()
    lin = nn.Linear(2, 2)
    agent = Agent(transport=cap, reduce_ranks=True).watch(lin)
    lin(torch.ones(1, 2)).sum().backward()
    agent.log(0)
    agent.close()
    assert (agent.rank, agent.world, agent.reduce) == (0, 1, False)
    assert {b["rank"] for b in cap.tensors} == {0} and len(records(cap.tensors)) == 5
