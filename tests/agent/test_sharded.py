"""FSDP2, DDP and tensor parallelism on two CPU ranks (gloo over 127.0.0.1), in one two-process job for the module.

FSDP2 (``fully_shard``, uneven shards: 5 rows over 2 ranks): the weight and grad_weight rows each rank sends are those
of the whole unsharded tensor (the fp64 oracle on ``full_tensor()``), amax, underflow at the whole tensor's scale,
outliers, kurtosis and histogram included; under ``reduce_ranks``, delayed scaling and on the Triton path (in Triton's
interpreter) too. DDP: the names are the user's whether the agent watches the wrapper or the module, and grad_weight
is the gradient averaged across ranks, the one the optimizer sees. Tensor parallelism: weights sharded by columns and
an input sharded by columns. FSDP1: its wrappers leave no trace in the names.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fp8mon.agent import Agent
from fp8mon.agent.hooks import select_modules
from fp8mon.agent.stats.reference import Moments, merge_moments
from fp8mon.agent.wire import SITES, TENSOR_STATS
from fp8mon.monitor.localserver import free_port
from tests.agent.capture import CaptureTransport
from tests.agent.ranks import join_group

WORLD = 2
STEPS = 4
EVERY = 2
FORMATS = {"input": "e4m3", "weight": "e4m3", "output": None, "grad_output": "e5m2", "grad_weight": "e5m2"}
LAYERS = ("0", "2")


def _model(hidden: int = 5) -> nn.Sequential:
    """5 and 3 output rows: uneven shards over 2 ranks. Weights over a wide range of magnitudes, the rows a rank 1
    holds 2**-12 times smaller, so that its shard's own scale is not the whole tensor's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    with torch.no_grad():
        for lin in (model[0], model[2]):
            w = lin.weight
            w.copy_(torch.sign(torch.randn_like(w)) * 2.0 ** (torch.rand_like(w) * 24 - 20))
            w[3:] *= 2.0**-12
    return model


def _train(model, agents, rank, full):
    """STEPS steps, each rank on its own data (``rank`` None: the same data); ``full(tensor)`` is the whole tensor of
    a parameter or gradient. Returns what the optimizer saw per (step, layer, site) for weight and grad_weight."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = rank or 0
    g = torch.Generator().manual_seed(100 + rank)
    seen = {}
    for step in range(STEPS):
        x = torch.randn(3 + 2 * rank, 6, generator=g) * (1 + 3 * rank)
        loss = model(x).pow(2).mean()
        loss.backward()
        for name in LAYERS:
            w = _linear(model, name).weight
            seen[(step, name, "weight")] = full(w.detach()).clone()
            seen[(step, name, "grad_weight")] = full(w.grad).clone()
        opt.step()
        opt.zero_grad()
        for agent in agents:
            agent.log(step, loss=loss)
    return seen


def _linear(model, name):
    inner = getattr(model, "module", model)
    return inner.get_submodule(name)


def _fsdp(rank):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for name in LAYERS:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    local, reduced, delayed, triton = (CaptureTransport() for _ in range(4))
    agents = [Agent(transport=local, every=EVERY, hist_every=1).watch(model),
              Agent(transport=reduced, every=EVERY, hist_every=1, reduce_ranks=True).watch(model),
              Agent(transport=delayed, every=EVERY, hist_every=1, scaling="delayed").watch(model),
              # the sharded rows on the Triton path (in Triton's interpreter: TRITON_INTERPRET=1)
              Agent(transport=triton, every=EVERY, hist_every=1, stats_backend="triton", sites=["weight", "grad_weight"]
                    ).watch(model)]
    shards = {name: tuple(_linear(model, name).weight.to_local().shape) for name in LAYERS}
    seen = _train(model, agents, rank, lambda t: t.full_tensor())
    for agent in agents:
        agent.close()
    return {"local": local.records(), "reduced": reduced.records(), "delayed": delayed.records(),
            "triton": triton.records(), "seen": seen,
            "shards": shards, "errors": [a.errors for a in agents], "last_error": [a.last_error for a in agents]}


def _tensor_parallel(rank):
    """Tensor parallelism: weights sharded by rows (Shard(0)) and by columns (Shard(1)); even (DTensor's matmul
    takes no uneven shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = parallelize_module(_model(4), init_device_mesh("cpu", (WORLD,)),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    cap = CaptureTransport()
    agent = Agent(transport=cap, every=EVERY, hist_every=1).watch(model)
    inputs = []  # layer 2's input: a DTensor sharded by columns
    model.get_submodule("2").register_forward_hook(lambda m, args, out: inputs.append(args[0].full_tensor()))
    seen = _train(model, [agent], None, lambda t: t.full_tensor())  # the ranks of a TP group share their data
    for step, x in enumerate(inputs):
        seen[(step, "2", "input")] = x
    agent.close()
    placements = {name: str(_linear(model, name).weight.placements) for name in LAYERS}
    return {"records": cap.records(), "seen": seen, "placements": placements, "errors": agent.errors,
            "last_error": agent.last_error}


def _fsdp1_names():
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"), use_orig_params=True,
                                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    return [name for name, _ in select_modules(model, None)], [name for name, _ in model.named_modules()]


def _ddp(rank):
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    own = {}  # the rank's own gradient, as autograd accumulates it (before DDP's reduction)
    for name in LAYERS:
        model.get_submodule(name).weight.register_post_accumulate_grad_hook(
            lambda p, name=name: own.__setitem__(name, p.grad.clone()))
    ddp = DistributedDataParallel(model)
    wrapped, inner = CaptureTransport(), CaptureTransport()
    agents = [Agent(transport=wrapped, every=EVERY, hist_every=1).watch(ddp),
              Agent(transport=inner, every=EVERY, hist_every=1).watch(ddp.module)]
    seen = _train(ddp, agents, rank, lambda t: t)
    for agent in agents:
        agent.close()
    return {"wrapped": wrapped.records(), "inner": inner.records(), "seen": seen, "own": own,
            "errors": [a.errors for a in agents], "last_error": [a.last_error for a in agents]}


def _worker(rank, port, outdir):
    join_group(rank, port, WORLD)
    try:
        out = {"fsdp": _fsdp(rank), "ddp": _ddp(rank), "fsdp1": _fsdp1_names(), "tp": _tensor_parallel(rank)}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("sharded")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # (read by the ranks as they start)
    try:
        mp.start_processes(_worker, args=(free_port(), str(outdir)), nprocs=WORLD, join=True, start_method="spawn")
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(got, want, key, rel=1e-9, floor=1e-300):
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(got)
    if key in ("numel", "nonfinite", "amax", "zero_frac", "scale", "outlier_frac", "underflow_frac",
               "overflow_frac", "log2_hist"):
        return got == want
    return math.isclose(got, want, rel_tol=rel, abs_tol=floor)


def _check(rec, tensor, site, where, rel=1e-9, **kw):
    want = Moments.from_tensor(tensor, fmt=FORMATS[site], **kw).to_stats()
    floor = {"mean": rel * want["std"]}  # a mean near 0: to the data's scale
    bad = {k: (rec[k], want[k]) for k in [*TENSOR_STATS, "log2_hist"]
           if not _close(rec[k], want[k], k, rel, floor.get(k, 1e-300))}
    assert not bad, (where, bad)


REPORTED = [(s, layer, site) for s in range(0, STEPS, EVERY) for layer in LAYERS for site in ("weight", "grad_weight")]


def test_fsdp2_rows_are_those_of_the_whole_tensors(ranks):
    for rank, out in enumerate(ranks):
        fsdp = out["fsdp"]
        assert fsdp["errors"] == [0, 0, 0, 0], fsdp["last_error"]
        assert {k[:3] for k in fsdp["local"]} == {(s, layer, site) for s in range(0, STEPS, EVERY) for layer in LAYERS
                                                  for site in SITES}
        for step, layer, site in REPORTED:
            _check(fsdp["local"][(step, layer, site, rank)], fsdp["seen"][(step, layer, site)], site,
                   (rank, step, layer, site))
    # uneven shards (padding on the last rank), and a shard's own scale is not the whole tensor's: the per-shard merge
    # would count another underflow
    assert [out["fsdp"]["shards"]["0"] for out in ranks] == [(3, 6), (2, 6)]
    whole = ranks[0]["fsdp"]["seen"][(0, "0", "weight")]
    per_shard = merge_moments([Moments.from_tensor(t, fmt="e4m3") for t in whole.split(3)]).to_stats()
    got = ranks[0]["fsdp"]["local"][(0, "0", "weight", 0)]
    assert got["underflow_frac"] > 0 and got["underflow_frac"] != per_shard["underflow_frac"]


def test_fsdp2_reduced_rows_are_those_of_the_whole_tensors(ranks):
    fsdp = ranks[0]["fsdp"]
    assert ranks[1]["fsdp"]["reduced"] == {}  # only rank 0 sends
    for step, layer, site in REPORTED:
        _check(fsdp["reduced"][(step, layer, site, -1)], fsdp["seen"][(step, layer, site)], site, (step, layer, site))


def test_ddp_names_and_the_averaged_gradient(ranks):
    for rank, out in enumerate(ranks):
        ddp = out["ddp"]
        assert ddp["errors"] == [0, 0], ddp["last_error"]
        assert {k[1] for k in ddp["wrapped"]} == set(LAYERS)
        assert ddp["wrapped"].keys() == ddp["inner"].keys()
        for step, layer, site in REPORTED:
            for which in ("wrapped", "inner"):
                _check(ddp[which][(step, layer, site, rank)], ddp["seen"][(step, layer, site)], site,
                       (rank, which, step, layer, site))
        # the rank's own gradient is not what the optimizer saw: the row is of the averaged one
        assert not torch.equal(ddp["own"]["0"], ddp["seen"][(STEPS - 1, "0", "grad_weight")])
    assert torch.equal(ranks[0]["ddp"]["seen"][(0, "0", "grad_weight")], ranks[1]["ddp"]["seen"][(0, "0", "grad_weight")])


def test_fsdp2_delayed_scaling_takes_the_whole_tensors_amax(ranks):
    for rank, out in enumerate(ranks):
        fsdp = out["fsdp"]
        for step, layer, site in REPORTED:
            # the history holds the whole tensors' amax of the steps before, reporting or not
            hmax = max([float(fsdp["seen"][(s, layer, site)].abs().max()) for s in range(step)], default=0.0)
            rec = fsdp["delayed"][(step, layer, site, rank)]
            _check(rec, fsdp["seen"][(step, layer, site)], site, (rank, step, layer, site), amax_history_max=hmax)
            assert rec["amax_history_max"] == hmax


def test_fsdp1_names_leave_out_its_wrappers(ranks):
    names, qualified = ranks[0]["fsdp1"]
    assert "_fsdp_wrapped_module.0._fsdp_wrapped_module" in qualified
    assert names == list(LAYERS)


def test_tensor_parallel_weights_any_placement(ranks):
    for rank, out in enumerate(ranks):
        tp = out["tp"]
        assert tp["errors"] == 0, tp["last_error"]
        assert tp["placements"] == {"0": "(Shard(dim=0),)", "2": "(Shard(dim=1),)"}
        for step, layer, site in [*REPORTED, (0, "2", "input"), (2, "2", "input")]:
            _check(tp["records"][(step, layer, site, rank)], tp["seen"][(step, layer, site)], site,
                   (rank, step, layer, site))


def test_fsdp2_rows_on_the_triton_path(ranks):
    for rank, out in enumerate(ranks):
        fsdp = out["fsdp"]
        for step, layer, site in REPORTED:
            # (the kernel's moments: fp32 power sums about a shift, to ~1e-7 of the oracle's; every count exact)
            _check(fsdp["triton"][(step, layer, site, rank)], fsdp["seen"][(step, layer, site)], site,
                   (rank, step, layer, site), rel=1e-6)
