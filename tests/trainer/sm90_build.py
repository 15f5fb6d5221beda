"""Offline sm_90a builds of the trainer's kernels, no GPU needed: Triton's driver is replaced by a stand-in that reports
an sm_90 device, each launch compiles only (``JITFunction.warmup``), and Triton's bundled cuobjdump reads the static
shared memory of the cubin. ``launch_verdict`` says whether a kernel so built would launch."""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

import torch

DEFAULT_SMEM = 48 * 1024  # a launch's shared memory without opting in
OPTIN_SMEM = 227 * 1024  # the most an H100's or H200's block may opt in to (shared_memory_per_block_optin)
# The 1 KiB that sm_90 reserves for the system in a block that uses shared memory: cuobjdump counts it in SHARED, but
# it is not the kernel's.
RESERVED_SMEM = 1024
STATS_MODULES = ("fp8mon.agent.stats.kernels.standalone", "fp8mon.agent.stats.kernels.merge",
                 "fp8mon.trainer.kernels.quantize",
                 "fp8mon.trainer.kernels.quantize_transpose", "fp8mon.trainer.kernels.swiglu",
                 "fp8mon.trainer.kernels.residual", "fp8mon.trainer.kernels.rope", "fp8mon.trainer.kernels.rmsnorm",
                 "fp8mon.trainer.kernels.weight_casts")


def launch_verdict(static: int, dynamic: int) -> str:
    """Whether a kernel with ``static`` bytes of shared memory by cuobjdump and ``dynamic`` of Triton's launches:
    Triton's driver opts in only when the dynamic part is above 48 KiB, and then to the opt-in limit; below it the
    kernel's own static part and the dynamic one share the default 48 KiB."""
    if dynamic > DEFAULT_SMEM:
        return "ok" if static + dynamic <= OPTIN_SMEM else "FAILS: over the opt-in limit"
    if max(static - RESERVED_SMEM, 0) + dynamic <= DEFAULT_SMEM:
        return "ok"
    return "FAILS: over 48 KiB, and Triton does not opt in"


def tools() -> Path | None:
    """The folder of Triton's bundled ptxas and cuobjdump, or None where this Triton brings none."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return bin_dir if (bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists() else None


class _Sm90:
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 128)

    def get_current_device(self):
        return 0

    def get_current_stream(self, *args):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _CompileOnly:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles it and keeps the compiled kernel in ``built``."""

    def __init__(self, fn, name: str, built: dict):
        self.fn, self.name, self.built = fn, name, built

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.built[self.name] = self.fn.warmup(*args, grid=grid, **kwargs)
        return launch


@contextlib.contextmanager
def sm90_builds(built: dict):
    """For the block, every launch of a kernel of ``STATS_MODULES`` compiles it for sm_90a into ``built`` (name ->
    compiled kernel) instead of running."""
    import triton
    from triton.runtime import driver

    kernels = {}
    for name in STATS_MODULES:
        module = importlib.import_module(name)
        kernels.update({(module, attr): fn for attr, fn in vars(module).items()  # launched ones (not the helpers)
                        if isinstance(fn, triton.runtime.jit.JITFunction) and attr.endswith("_kernel")})
    before = driver._active  # (reset_active would create the default driver, which needs a GPU)
    driver.set_active(_Sm90())
    for (module, attr), fn in kernels.items():
        setattr(module, attr, _CompileOnly(fn, attr, built))
    try:
        yield
    finally:
        # What the builds left queued (a current-scaled cast's deferred row, partials waiting for their merge) is built
        # too: left queued, the next flush in this process would launch it for real, on a machine without a GPU.
        from fp8mon.agent.stats import launch

        try:
            launch.flush_deferred()
        finally:
            for (module, attr), fn in kernels.items():
                setattr(module, attr, fn)
            driver._active = before


def shared_memory(compiled) -> tuple[int, int]:
    """(static bytes by cuobjdump, Triton's dynamic bytes) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools() / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True).stdout
    return int(re.search(r"SHARED:(\d+)", usage).group(1)), compiled.metadata.shared
