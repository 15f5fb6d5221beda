"""Every kernel that takes a statistics row must launch on an sm_90 GPU (H100, H200). The histogram's tables are
static shared memory on top of Triton's own, and Triton opts a launch into more than 48 KiB only when its own part is
above that: a kernel whose own part lands just under 48 KiB fails with "invalid argument", on a GPU only (an fp32
SwiGLU backward once did). Each test builds one launcher's kernels for sm_90a with the Triton installed here, no GPU
needed (tests/trainer/sm90_build.py), and checks their shared memory. The builds take the histogram: without it a
kernel's static shared memory is the 1 KiB the system reserves, and Triton's own part alone either fits the default
48 KiB or is opted in."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from sm90_build import launch_verdict, shared_memory, sm90_builds, tools


def test_the_launch_rule_is_what_an_h200_did():
    # (cuobjdump's static bytes, Triton's dynamic bytes), as an H200 ran them
    assert launch_verdict(1024, 49152) == "ok"  # 1 KiB the system reserves, and Triton's 48 KiB: launched
    assert launch_verdict(9216, 49152).startswith("FAILS")  # the 8 KiB table on top: "invalid argument"
    assert launch_verdict(9216, 57344) == "ok"  # above 48 KiB Triton opts in
    assert launch_verdict(9216, 227 * 1024).startswith("FAILS")  # past what a block may opt in to


def _target(fmt="e4m3"):
    from fp8mon.agent.stats import launch as ts

    return ts.Target.new(torch.device("cpu"), fmt=fmt, hist=True)


def _kernels(*names):
    return [importlib.import_module(f"fp8mon.trainer.kernels.{n}") for n in names]


def _builds(dt: torch.dtype) -> dict:
    """name -> a call of one launcher that runs kernels with a statistics row and the histogram, at a 1.5B step's
    shapes."""
    from fp8mon.agent.stats import launch as ts

    sw, res, norm, q, qt, wc, rope = _kernels("swiglu", "residual", "rmsnorm", "quantize", "quantize_transpose",
                                              "weight_casts", "rope")
    y, dh = torch.zeros(4096, 2 * 2048, dtype=dt), torch.zeros(4096, 2048, dtype=dt)
    x, b = torch.zeros(4096, 2048), torch.zeros(4096, 2048, dtype=dt)
    trig = torch.zeros(2048, 64)
    d = torch.zeros(2, 16, 2048, 128, dtype=dt)
    return {
        "standalone": lambda: ts.partials(torch.zeros(1 << 22, dtype=dt), fmt="e4m3", scale=4.0, hist=True),
        "cast, current scaling": lambda: q.quantize(y, "e4m3", stats=_target()),
        "cast and transpose, delayed scaling": lambda: qt.quantize_transpose(y, "e4m3", torch.tensor(4.0),
                                                                             torch.zeros(()), stats=_target()),
        "swiglu fwd + y, h rows": lambda: sw.swiglu_forward(y, stats=_target(), h_stats=_target()),
        "swiglu fwd + y row": lambda: sw.swiglu_forward(y, stats=_target()),
        "swiglu bwd + dy row": lambda: sw.swiglu_backward(y, dh, stats=_target("e5m2")),
        "residual add + row": lambda: res.residual_add_forward(x, b, stats=_target()),
        "residual grad cast + row": lambda: res.branch_grad(x, dt, _target("e5m2")),
        "rope fwd + row": lambda: rope.rope_qkv_forward(torch.zeros(2, 2048, 3 * 16 * 128, dtype=dt), trig, trig, 16,
                                                        stats=_target()),
        "rope bwd + row": lambda: rope.rope_qkv_backward(d, d, d, trig, trig, dt, stats=_target("e5m2")),
        "casts + rows, one launch": lambda: wc.casts_with_rows(
            [x.to(dt)], torch.float32 if dt == torch.bfloat16 else torch.bfloat16, [_target()]),
        **{f"rmsnorm fwd + row, {w}": (lambda w=w: norm.rms_norm_forward(torch.zeros(4096, w, dtype=dt), torch.zeros(w),
                                                                         1e-6, stats=_target()))
           for w in (768, 2048, 3072, 4096, 8192, 16384)},
    }


BUILDS = [
    "standalone", "cast, current scaling", "cast and transpose, delayed scaling", "swiglu fwd + y, h rows",
    "swiglu fwd + y row", "swiglu bwd + dy row", "residual add + row", "residual grad cast + row", "rope fwd + row",
    "rope bwd + row", "casts + rows, one launch"] + [f"rmsnorm fwd + row, {w}" for w in (768, 2048, 3072, 4096, 8192,
                                                                                           16384)]


@pytest.fixture
def sm90(monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("builds for sm_90a need Triton's compiler, not its interpreter")
    if tools() is None:
        pytest.skip("this Triton brings no ptxas/cuobjdump to build for sm_90a")


@pytest.mark.usefixtures("sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("build", BUILDS)
def test_a_kernel_with_a_row_and_the_histogram_would_launch_on_sm90(build, dtype):
    built: dict = {}
    with sm90_builds(built):
        _builds(dtype)[build]()
    assert built, "the launcher built no kernel"
    verdicts = {name: (launch_verdict(*shared_memory(k)), shared_memory(k)) for name, k in built.items()}
    assert all(v == "ok" for v, _ in verdicts.values()), verdicts
