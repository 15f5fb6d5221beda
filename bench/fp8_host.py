"""Host time of ``Fp8Linear``'s Triton path with and without the agent, every Triton launch a no-op so that
it runs on a CPU: what the layer's Python, its autograd function, the kernel wrappers and the agent's fused
statistics targets cost per step, Triton's own launcher excluded.

    python bench/fp8_host.py            # 8 Fp8Linear layers (256 wide), forward + backward, agent off / on

A small model's FP8 step is host-bound on a GPU (GPT-124M), so this is where the agent's overhead goes there.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent import Agent  # noqa: E402
from fp8mon.agent.stats import launch as ts  # noqa: E402
from bench.agent_host import NoLaunch  # noqa: E402
from fp8mon.agent.transport import NullTransport  # noqa: E402
from fp8mon.trainer.fp8_linear import Fp8Linear  # noqa: E402

KERNELS = {
    "fp8mon.trainer.kernels.quantize": ("_amax_partials_kernel", "_delayed_update_kernel", "_quantize_stats_kernel",
                                 "_quantize_kernel"),
    "fp8mon.trainer.kernels.quantize_transpose": ("_quantize_transpose_stats_kernel", "_quantize_transpose_kernel"),
    "fp8mon.trainer.kernels.fp8_gemm": ("_fp8_gemm_ptr_kernel", "_fp8_gemm_tma_kernel", "_splitk_reduce_kernel",
                                 "_ptr_tuned", "_tma_tuned"),
    "fp8mon.agent.stats.kernels.standalone": ("stats_kernel",),
}


def main(layers: int = 8, width: int = 256, steps: int = 200) -> None:
    launches = [0]
    for module, names in KERNELS.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(mod, name, NoLaunch(launches))
    ts.available = lambda device=None: True
    torch.manual_seed(0)
    model = nn.Sequential(*[Fp8Linear(width, width) for _ in range(layers)])
    for m in model:
        m.backend = "triton"
    x = torch.randn(64, width, requires_grad=True)

    def timed(agent) -> tuple[float, float]:
        times, before = [], launches[0]
        for i in range(steps):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(x).float().sum().backward()
            if agent is not None:
                agent.log(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[steps // 4:]), (launches[0] - before) / steps

    timed(None)
    off, n_off = timed(None)
    agent = Agent("http://127.0.0.1:9", run="fp8-host", every=1, transport=NullTransport(),
                  stats_backend="triton").watch(model)
    agent.step(0)
    timed(agent)
    on, n_on = timed(agent)
    agent.close()
    print(f"{layers} Fp8Linear layers, Triton path, every launch a no-op: agent off {off * 1e6:.0f} us/step "
          f"({n_off:.0f} launches), on {on * 1e6:.0f} us/step ({n_on:.0f} launches): +{(on - off) * 1e6:.0f} us, "
          f"{(on - off) * 1e6 / layers:.0f} us per layer; agent errors {agent.errors}")


if __name__ == "__main__":
    main()
