"""The cross-rank reduction of packed rows (``distributed.reduce_rows``) on 4 CPU processes (gloo), and on a group
of 2 of them: equal to the pairwise merge of every rank's gathered rows and to the fp64 oracle of the
concatenated tensors, with O(rows) bytes through the collectives and no gather."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8mon.agent import distributed
from fp8mon.agent.stats import torch_path as ds
from fp8mon.agent.stats.layout import WIDTH
from fp8mon.agent.stats.reference import Moments, merge_moments
from fp8mon.monitor.localserver import free_port
from tests.agent.ranks import join_group

WORLD = 4
FMTS = ["e4m3", "e5m2", None, "e4m3", None, "e4m3", None]  # one per slot
SLOTS = len(FMTS)


def slot_tensors(rank: int, world: int) -> list[list[torch.Tensor] | None]:
    """Each slot's tensors on ``rank`` (several: micro-batches merged into the slot's row; None: slot unused)."""
    g = torch.Generator().manual_seed(1000 * world + rank)
    size = 40 + 37 * rank

    def rnd(k=size):
        return torch.randn(k, generator=g, dtype=torch.float64).float() * (1 + 2 * rank) + 3 * rank

    bad = torch.tensor([float("nan"), float("inf"), -float("inf")] * (rank + 1))
    with_zeros = rnd()
    with_zeros[::5] = 0
    with_zeros[3] = float("nan")
    return [
        [rnd()],  # differing sizes, means, spreads: current scaling at each rank's own amax
        [bad] if rank == 1 else [rnd()],  # one rank without any finite element
        None if rank == world - 1 else [rnd(), rnd(7)],  # one rank leaves the slot unused; two micro-batches
        [torch.empty(0)] if rank == 0 else [with_zeros],  # an empty tensor on one rank
        None,  # unused everywhere
        [rnd()] if rank == 0 else [bad],  # one rank with finite elements: its moments as they are
        [bad] if rank % 2 else [torch.empty(0)],  # no finite element anywhere
    ]


def local_rows(tensors) -> torch.Tensor:
    rows = ds.empty(SLOTS)
    for i, (ts, fmt) in enumerate(zip(tensors, FMTS)):
        for t in ts or []:
            row = ds.partials(t, fmt=fmt)
            rows[i] = row if rows[i, ds.PARTS] == 0 else ds.merge(rows[i], row)
    return rows


class Counting:
    """Every collective the reduction calls, with its bytes; any gather fails."""

    def __init__(self):
        self.calls = []
        self.all_reduce = dist.all_reduce

    def __enter__(self):
        def counted(t, *a, **kw):
            self.calls.append(t.numel() * t.element_size())
            return self.all_reduce(t, *a, **kw)

        def refused(*a, **kw):
            raise AssertionError("a gather in the reduction")

        self.saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "all_gather_into_tensor", "gather")}
        dist.all_reduce = counted
        for n in ("all_gather", "all_gather_into_tensor", "gather"):
            setattr(dist, n, refused)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _worker(rank, port, outdir, backend="gloo", size=WORLD):
    dev = join_group(rank, port, size, backend)
    try:
        pair = dist.new_group([0, 1])  # every rank creates it
        out = {}
        for name, group, world in (("four", None, size), ("two", pair, 2)):
            if rank >= world:
                continue
            rows = local_rows(slot_tensors(rank, world)).to(dev)
            gathered = [torch.empty_like(rows) for _ in range(world)]
            dist.all_gather(gathered, rows, group=group)
            with Counting() as c:
                reduced = distributed.reduce_rows(rows, group)
            out[name] = {"reduced": reduced.cpu(), "pairwise": ds.merge_all(torch.stack(gathered)).cpu(),
                         "bytes": c.calls}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("reduce")
    mp.start_processes(_worker, args=(free_port(), str(outdir)), nprocs=WORLD, join=True, start_method="spawn")
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


CASES = [("four", WORLD), ("two", 2)]


def same(g: float, w: float, scale: float = 0.0) -> bool:
    if math.isnan(w):
        return math.isnan(g)
    return math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-12 * scale)


@pytest.mark.parametrize("case,world", CASES)
def test_every_rank_gets_the_pairwise_merge_of_all_ranks(ranks, case, world):
    want = ranks[0][case]["pairwise"]
    moments = slice(ds.MEAN, ds.M4 + 1)
    exact = [i for i in range(WIDTH) if i not in range(ds.MEAN, ds.M4 + 1)]
    for r in range(world):
        got = ranks[r][case]["reduced"]
        assert torch.equal(got[:, exact].nan_to_num(-7.0), want[:, exact].nan_to_num(-7.0)), r
        for s in range(SLOTS):
            scale = float(want[s, ds.N]) * float(want[s, ds.AMAX]) ** 4
            assert all(same(float(g), float(w), scale) for g, w in zip(got[s, moments], want[s, moments])), (r, s)
    first, last = (ranks[r][case]["reduced"].nan_to_num(-7.0) for r in (0, world - 1))
    assert torch.equal(first, last)  # bit for bit on every rank


@pytest.mark.parametrize("case,world", CASES)
def test_merged_rows_equal_the_oracle_of_the_concatenated_tensors(ranks, case, world):
    got = ranks[0][case]["reduced"]
    per_rank = [slot_tensors(r, world) for r in range(world)]
    for s, fmt in enumerate(FMTS):
        parts = [t for tensors in per_rank for t in tensors[s] or []]
        row = got[s].tolist()
        if not parts:
            assert row[ds.PARTS] == 0
            continue
        assert row[ds.PARTS] == len(parts)
        m = ds.to_moments(row)
        whole = Moments.from_tensor(torch.cat([p.reshape(-1) for p in parts]), fmt=fmt)
        merged = merge_moments([Moments.from_tensor(p, fmt=fmt) for p in parts])
        for key in ("numel", "n", "nonfinite", "zeros", "nonzero", "amax", "hist"):
            assert getattr(m, key) == getattr(whole, key), (s, key)
        # per rank: outliers against each rank's mean/std, under/overflow at each rank's scale, the minimum scale
        for key in ("outliers", "underflow", "overflow", "scale"):
            assert getattr(m, key) == getattr(merged, key), (s, key)
        scale = whole.n * whole.amax**4
        for key in ("mean", "M2", "M3", "M4"):
            assert same(getattr(m, key), getattr(whole, key), scale), (s, key)
    # the cases are not trivial: ranks differ, one has no finite element, one leaves a slot unused
    assert got[0, ds.N] > 0 and got[1, ds.NONFINITE] > 0 and got[5, ds.N] == per_rank[0][5][0].numel()


@pytest.mark.parametrize("case,world", CASES)
def test_the_collectives_move_o_rows_bytes_whatever_the_ranks(ranks, case, world):
    calls = ranks[0][case]["bytes"]
    one = SLOTS * WIDTH * 8
    assert len(calls) == 3 and sum(calls) < 2.5 * one  # the same for 2 and 4 ranks
    assert calls == ranks[0]["two"]["bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_gives_the_same_merge(tmp_path):
    size = 4 if torch.cuda.device_count() >= 4 else 2
    mp.start_processes(_worker, args=(free_port(), str(tmp_path), "nccl", size), nprocs=size, join=True,
                       start_method="spawn")
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(size)]
    for case, world in ([("four", size)] if size == 4 else []) + [("two", 2)]:
        test_every_rank_gets_the_pairwise_merge_of_all_ranks(outs, case, world)
        test_merged_rows_equal_the_oracle_of_the_concatenated_tensors(outs, case, world)
