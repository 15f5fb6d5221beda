"""The one-pass Triton statistics (fp8mon.agent.stats.launch) against the torch path (stats.torch_path.partials,
itself tested against the fp64 oracle), on the CPU in Triton's interpreter.

``TRITON_INTERPRET=1`` only takes effect for kernels defined after it is set, and this pytest process may have
defined them already: the checks (``interpreted_stats``) run in one worker process per test module, started with it
set. On a GPU the same comparisons run compiled: tests/agent/test_gpu_stats.py.
"""

from __future__ import annotations

import multiprocessing
import os

import interpreted_stats
import pytest

CHECKS = ["rows_vs_torch", "current_scaling", "outliers_with_center", "bf16_pairs", "multi_tensor", "merged_later",
          "many_partials", "far_first_partial", "agent_backends", "agent_waiting_grad_output", "agent_outlier_centers"]


def _interpreter_runs_our_kernels() -> None:
    """Skip where Triton's interpreter cannot run our kernels at all: Triton 3.6's turns a 1-element array into a
    Python int, which NumPy >= 2.4 refuses. Later Triton runs them."""
    triton = pytest.importorskip("triton")
    import numpy as np

    def version(v: str) -> tuple[int, int]:
        return tuple(int(p) for p in v.split(".")[:2])

    if version(triton.__version__) < (3, 7) and version(np.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails under NumPy {np.__version__}")


@pytest.fixture(scope="module")
def interpreter():
    """A worker process whose Triton kernels run in the interpreter (the variable is inherited at its start)."""
    _interpreter_runs_our_kernels()
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = multiprocessing.get_context("spawn").Pool(1, initializer=interpreted_stats.setup)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield pool
    pool.terminate()
    pool.join()


@pytest.mark.timeout(120)  # the worker's start (torch, triton) is paid by the first test
@pytest.mark.parametrize("check", CHECKS)
def test_triton_rows_match_torch_path(interpreter, check):
    interpreter.apply(interpreted_stats.run, (check,))


def test_table_row_is_packed_in_the_kernel_field_order():
    """The launcher packs a tensor's table row as bytes; the kernel reads its fields at the _T_* indices."""
    import numpy as np

    from fp8mon.agent.stats import layout

    buf = bytearray(layout.TABLE_ROW.size)
    layout.TABLE_ROW.pack_into(buf, 0, 101, 102, 1, 104, 105, 106, 1, 2, 109, 0.5, 111, -1.25, 3.5, 113, 7.0, 2, 6.0,
                               117, 0, 0)
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
