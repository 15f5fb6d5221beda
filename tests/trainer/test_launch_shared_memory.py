"""Every kernel that takes a statistics row must launch on an sm_90 GPU (H100, H200). The histogram's tables are
static shared memory on top of Triton's own, and Triton opts a launch into more than 48 KiB only when its own part is
above that: a kernel whose own part lands just under 48 KiB fails with "invalid argument", on a GPU only (an fp32
SwiGLU backward did on an H200). ``bench/offline_sass.py --launch-check`` builds each such kernel for sm_90a with the
Triton installed here, no GPU needed, and checks its shared memory. The tests build the kernels with the histogram
only: without it a kernel's static shared memory is the 1 KiB the system reserves (every one of them, in a full
``--launch-check``), and Triton's own part alone either fits the default 48 KiB or is opted in."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_launch_rule_is_what_an_h200_did():
    pytest.importorskip("triton")
    from bench.offline_sass import launch_verdict

    # (cuobjdump's static bytes, Triton's dynamic bytes), as the H200 ran them (bench/RESULTS.md)
    assert launch_verdict(1024, 49152) == "ok"  # 1 KiB the system reserves, and Triton's 48 KiB: launched
    assert launch_verdict(9216, 49152).startswith("FAILS")  # the 8 KiB table on top: "invalid argument"
    assert launch_verdict(9216, 57344) == "ok"  # above 48 KiB Triton opts in
    assert launch_verdict(9216, 227 * 1024).startswith("FAILS")  # past what a block may opt in to


def _launch_check(*args: str, timeout: int) -> tuple[str, str]:
    """(stdout, report) of ``bench/offline_sass.py --launch-check ARGS``, asserted to find no failing launch."""
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip(f"Triton {triton.__version__} brings no ptxas/cuobjdump to build for sm_90a")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    run = subprocess.run([sys.executable, "bench/offline_sass.py", "--launch-check", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    report = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, report
    assert "0 would fail to launch" in run.stdout, report
    return run.stdout, report


@pytest.mark.timeout(900)
def test_every_kernel_with_a_statistics_row_and_the_histogram_would_launch_on_sm90():
    stdout, report = _launch_check("--histogram-only", timeout=880)
    assert "hist=False" not in stdout, report
    assert stdout.count(": ok") >= 30, report  # every launcher built its kernels (none skipped quietly)


@pytest.mark.timeout(300)
def test_rmsnorm_rows_whose_tiles_come_near_a_limit_would_launch_on_sm90():
    """RMSNorm's tile, and so its pipelined buffers, grows with the row: at 3072 (in chunks), 4096 and 8192 elements
    Triton's own part lies between 24 and 64 KiB, where the histogram's table could push it past 48 KiB without an
    opt-in; at 16384 three stages would pass the 227 KiB a block may opt in to (``rmsnorm.STAGE3_BYTES``). (Every
    power-of-two width and head size: ``bench/offline_sass.py --launch-check --widths``, ten minutes.)"""
    stdout, report = _launch_check("--widths", "3072,4096,8192,16384", "--histogram-only", timeout=280)
    assert stdout.count(": ok") == 8, report  # four widths x bf16/fp32, with the histogram
