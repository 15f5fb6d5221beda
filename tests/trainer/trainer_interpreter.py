"""fp8mon under Triton's interpreter, inside the pytest process.

``TRITON_INTERPRET=1`` takes effect for kernels decorated after it is set, and other test modules import fp8mon (and
decorate its kernels) without it. ``fresh_fp8mon()`` sets it and imports fp8mon afresh: for its duration
``sys.modules`` holds a second copy of every ``fp8mon`` and ``triton`` module, whose kernels run on CPU tensors in the
interpreter;
afterwards the first copy is back, untouched. Tests that use it import fp8mon inside the test (through the
``interpreted`` fixture of tests/trainer/conftest.py), never at the top of their module.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest


def skip_if_interpreter_broken() -> None:
    """Skip where Triton's interpreter cannot run our kernels at all: Triton 3.6's turns a 1-element array into a
    Python int (``range`` over ``tl.num_programs``), which NumPy >= 2.4 refuses. Later Triton (3.9) runs them."""
    triton = pytest.importorskip("triton")
    import numpy as np

    def version(v: str) -> tuple[int, int]:
        return tuple(int(p) for p in v.split(".")[:2])

    if version(triton.__version__) < (3, 7) and version(np.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails under NumPy {np.__version__}")


def _ours(name: str) -> bool:
    """The modules imported afresh: fp8mon's, and Triton's Python modules (its language functions are jitted at its
    import too; its compiled extension cannot load twice). Not fp8mon.agent.compiled: its torch.library ops are the
    process's, registered once (imported afresh, they would call the fresh copy's layer registry from then on)."""
    if name == "triton._C" or name.startswith("triton._C.") or name == "fp8mon.agent.compiled":
        return False
    return any(name == top or name.startswith(top + ".") for top in ("fp8mon", "triton"))


@contextlib.contextmanager
def fresh_fp8mon():
    """fp8mon imported afresh with TRITON_INTERPRET=1 for the block (see the module docstring)."""
    skip_if_interpreter_broken()
    saved = {name: mod for name, mod in sys.modules.items() if _ours(name)}
    old_env = os.environ.get("TRITON_INTERPRET")
    for name in saved:
        del sys.modules[name]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from interpreter_speed import patch_once

        import fp8mon.agent.stats.launch  # noqa: F401  (decorated now, in the interpreter)
        import fp8mon.trainer.kernels  # noqa: F401

        patch_once()  # (on the fresh Triton, dropped with it)
        yield
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env
