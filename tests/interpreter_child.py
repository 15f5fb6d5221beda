"""Checks that must run under Triton's interpreter run in one child process: TRITON_INTERPRET=1 has to be set
before Triton is imported, which this pytest process has done already. The child (the test module run as a
script) prints one JSON line {"check": "group:name", "problem": ""} per check; an empty problem is a pass."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def skip_if_interpreter_broken() -> None:
    """Skip where Triton's interpreter cannot run our kernels at all: Triton 3.6's turns a 1-element array into a
    Python int (``range`` over ``tl.num_programs``), which NumPy >= 2.4 refuses (TypeError; seen with Triton 3.6
    and NumPy 2.4.6 / 2.5.2). Later Triton (3.9, CI) runs them."""
    triton = pytest.importorskip("triton")
    import numpy as np

    def version(v: str) -> tuple[int, int]:
        return tuple(int(p) for p in v.split(".")[:2])

    if version(triton.__version__) < (3, 7) and version(np.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails under NumPy {np.__version__}")


def run_checks(module_file: str, groups: list[str]) -> dict[str, str]:
    """Every check of ``groups``, the groups dealt round-robin to one child per CPU this pytest process may take (at
    most 4; the children use one thread each), which run at once: the interpreter is slow and the pytest process only
    waits. Under pytest-xdist the CPUs are shared out among its workers: more children would only slow the tests that
    time something (a hung server's queue, a webhook's send) on the other workers."""
    skip_if_interpreter_broken()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    n = max(1, min(len(groups), cpus, 4))
    children = [subprocess.Popen([sys.executable, module_file, *groups[i::n]], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(n)]
    results = {}
    try:
        for child in children:
            out, err = child.communicate(timeout=900)
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert lines, err[-3000:]
            results.update((d["check"], d["problem"]) for d in lines)
    finally:  # a child that timed out or printed nothing: the others are not left running
        for child in children:
            child.kill()
            child.wait()
    return results


def emit(name: str, problem: str) -> None:
    """In the child: one check's line ("" problem: a pass)."""
    print(json.dumps({"check": name, "problem": problem}), flush=True)


def run_each(checks: dict, names: list[str]) -> None:
    """In the child: each of the ``checks`` named (all without names); a crash is one failed check, its traceback on
    stderr, and the others still run."""
    for name in names or checks:
        try:
            checks[name]()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            emit(f"{name}:raised", repr(exc))


def assert_group(results: dict[str, str], group: str) -> None:
    mine = {k: v for k, v in results.items() if k.split(":")[0] == group}
    assert mine, f"check group {group} produced nothing"
    failed = {k: v for k, v in mine.items() if v}
    assert not failed, failed
