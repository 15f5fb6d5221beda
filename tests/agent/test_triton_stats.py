"""The one-pass Triton statistics (fp8mon.agent.stats.launch) against the torch path (stats.torch_path.partials,
itself tested against the fp64 oracle), on the CPU in Triton's interpreter.

``TRITON_INTERPRET=1`` only takes effect for kernels defined after it is set, so the checks run in one
child process (``python tests/agent/test_triton_stats.py``) that sets it first, with a small chunk and
tile (``CHUNK``/``BLOCK``) so that small tensors still span several programs and exercise the merge.
Each check prints a JSON line; the tests below assert them. On a GPU: ``python bench/stats_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_CENTER = (0.0, float("nan"))  # the Triton path counts no outlier before it has a center


# ---------------------------------------------------------------------------------------------------
# child process (TRITON_INTERPRET=1)


def _cases(torch):
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


def _child(names: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "agent"))
    sys.path.insert(0, str(ROOT / "tests"))
    from interpreter_child import emit, run_each
    import torch
    from torch import nn

    from fp8mon.agent import Agent
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats.engine import engine
    from rowcheck import bf16_pairs as bf16_pairs_cases
    from rowcheck import row_problems

    torch.set_num_threads(1)
    cpu = engine("cpu")
    cpu.chunk, cpu.tile_rows = 4096, 128  # several programs per tensor (5000 elements: 2), several tiles per program

    def rows_vs_torch():
        for i, (case, x) in enumerate(_cases(torch).items()):
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
        for case, x in list(_cases(torch).items())[::2]:
            got = ts.partials(x, fmt="e4m3")
            want = ds.partials(x, fmt="e4m3", outlier_center=NO_CENTER)
            binade = float(got[ds.HIST:].max()) if x.numel() else 0.0  # the documented bound
            emit(f"current_scaling:{case}", row_problems(got, want, under_slack=binade))

    def outliers_with_center():
        for i, (case, x) in enumerate(_cases(torch).items()):
            fin = x.float()[torch.isfinite(x.float())].double()
            own = (float(fin.mean()) if fin.numel() else 0.0, float(fin.std()) if fin.numel() > 1 else 0.0)
            for center in ((0.5, 1.0), own) if i % 4 == 0 else (own,):
                got = ts.partials(x, center=torch.tensor(center, dtype=torch.float64), outlier_k=2.0)
                want = ds.partials(x, outlier_center=center, outlier_k=2.0)
                emit(f"outliers_with_center:{case}:{center[0]:.3g}", row_problems(got, want))

    def bf16_pairs():
        """bf16 without the histogram: the fast path takes two elements per 32-bit word (counts, outliers and
        amax straight from the words), on stats_check's adversarial tensor and cases."""
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
        (``_launch_pending``)."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        xs = [torch.randn(8, 32) * (1 + i) for i in range(3)]

        class Null:
            def set_run_meta(self, **kw): ...
            def flush(self, timeout=None): return True
            def close(self, timeout=None): return True

        shipped = {}
        for backend in ("triton", "torch"):
            model.load_state_dict(state)
            agent = Agent(transport=Null(), every=1, stats_backend=backend).watch(model)
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

        class Null:
            def set_run_meta(self, **kw): ...
            def flush(self, timeout=None): return True
            def close(self, timeout=None): return True

        agent = Agent(transport=Null(), every=1, stats_backend="triton", sites=("input",), outlier_k=1.0).watch(lin)
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

    checks = dict(rows_vs_torch=rows_vs_torch, current_scaling=current_scaling,
                  outliers_with_center=outliers_with_center, bf16_pairs=bf16_pairs, multi_tensor=multi_tensor,
                  merged_later=merged_later, many_partials=many_partials, far_first_partial=far_first_partial,
                  agent_backends=agent_backends, agent_waiting_grad_output=agent_waiting_grad_output,
                  agent_outlier_centers=agent_outlier_centers)
    run_each(checks, names)


# ---------------------------------------------------------------------------------------------------
# tests

GROUPS = ["rows_vs_torch", "current_scaling", "outliers_with_center", "bf16_pairs", "multi_tensor", "merged_later",
          "many_partials", "far_first_partial", "agent_backends", "agent_waiting_grad_output", "agent_outlier_centers"]


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreter_child import run_checks  # tests/ is on the path under pytest, not in the child

    return run_checks(__file__, GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_triton_rows_match_torch_path(results, group):
    from interpreter_child import assert_group

    assert_group(results, group)


@pytest.mark.gpu
@pytest.mark.timeout(1500)  # more than the suite's 300 s: on an H200 it ran past 480 s (166 checks by then)
def test_gpu_self_check():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "stats_check.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=1400)
    assert out.returncode == 0, out.stdout[-4000:]


if __name__ == "__main__":
    _child(sys.argv[1:])


def test_table_row_is_packed_in_the_kernel_field_order():
    """The launcher packs a tensor's table row as bytes; the kernel reads its fields at the _T_* indices."""
    import numpy as np

    from fp8mon.agent.stats import layout

    buf = bytearray(layout.TABLE_ROW.size)
    layout.TABLE_ROW.pack_into(buf, 0, 101, 102, 1, 104, 105, 106, 1, 2, 109, 0.5, 111, -1.25, 3.5, 113, 7.0, 2, 6.0, 117, 0, 0)
    q, d = np.frombuffer(bytes(buf), "<i8"), np.frombuffer(bytes(buf), "<f8")
    want_int = {"ADDR": 101, "NUMEL": 102, "CODE": 1, "FIRST": 104, "NWORK": 105, "DST": 106, "MERGE": 1, "SMODE": 2,
                "SCALE_ADDR": 109, "CENTER_ADDR": 111, "AHM_ADDR": 113, "FMT": 2, "CHUNK": 117}
    want_float = {"SCALE": 0.5, "MEAN": -1.25, "STD": 3.5, "AHM": 7.0, "K": 6.0}
    for name, v in want_int.items():
        assert q[getattr(layout, f"T_{name}")] == v, name
    for name, v in want_float.items():
        assert d[getattr(layout, f"T_{name}")] == v, name
    assert len(q) == layout.TABW


def test_per_tensor_lists_of_two():
    """Two tensors, two per-tensor values: a list of two merge flags or scales is one value per tensor; only
    ``center`` reads two numbers as one (mean, std) for all (a replaced grad_weight row was once merged)."""
    from fp8mon.agent.stats.launch import each as _each

    assert _each([True, False], 2) == [True, False]
    assert _each([2.0, 3.0], 2) == [2.0, 3.0]
    assert _each((0.5, 2.0), 2, pair=True) == [(0.5, 2.0), (0.5, 2.0)]
    assert _each([(0.5, 2.0), (1.0, 3.0)], 2, pair=True) == [(0.5, 2.0), (1.0, 3.0)]
    assert _each(None, 3) == [None, None, None]


def test_rows_into_one_row_go_to_launches_in_their_order(monkeypatch):
    """A launch's programs run in any order on a GPU: the tensors of one launch whose rows are the same row (a
    deferred micro-batch's tensor and the next one's, merged into it) go to successive launches, in their order, each
    launch writing a row at most once."""
    import torch

    from fp8mon.agent.stats.engine import Engine

    launched = []
    monkeypatch.setattr(Engine, "launch_once", lambda self, tensors, fmts, scales, centers, k, ahms, hist, out, index,
                        merges, aouts, later: launched.append((list(tensors), list(index), list(merges))))
    cpu = Engine(torch.device("cpu"))
    names, index, merges = ["a", "b", "a2", "c", "b2"], [3, 5, 3, 7, 5], [False, False, True, False, True]
    cpu.launch(names, [None] * 5, [None] * 5, [None] * 5, 6.0, [None] * 5, False, None, index, merges)
    assert launched == [(["a", "b"], [3, 5], [False, False]), (["a2", "c", "b2"], [3, 7, 5], [True, False, True])]
    launched.clear()
    cpu.launch(names[:2], [None] * 2, [None] * 2, [None] * 2, 6.0, [None] * 2, False, None, [3, 5], merges[:2])
    assert launched == [(["a", "b"], [3, 5], [False, False])]
