"""The agent's own host cost per statistics launch on its Triton path, the kernel launch itself excluded:
the hooks, the slot bookkeeping and ``triton_stats.rows``' launcher (table, staging copy), with the
statistics kernel replaced by a no-op so that this runs on a CPU.

    python bench/agent_host.py              # an 8-layer MLP on the CPU, every linear watched at all five sites

On a host-bound step (GPT-124M on an H100: 144 launches per step) this cost, plus Triton's own launcher and
the kernels, is what the agent adds. Prints host time per step with the agent off and on, and per launch.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent import Agent  # noqa: E402
from fp8mon.agent.stats import launch as ts  # noqa: E402
from fp8mon.agent.stats.kernels import standalone  # noqa: E402
from fp8mon.agent.transport import NullTransport  # noqa: E402


class NoLaunch:
    """Stands in for a compiled or autotuned kernel: counts launches in ``counter[0]``, computes nothing, and
    reports no autotuned config."""

    best_config = None

    def __init__(self, counter: list):
        self.counter = counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[0] += 1
        return launch


def main(layers: int = 8, width: int = 256, steps: int = 200) -> None:
    launches = [0]
    standalone.stats_kernel = NoLaunch(launches)
    ts.available = lambda device=None: True
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(64, width)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def timed(agent) -> float:
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            step()
            if agent is not None:
                agent.log(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[steps // 4:])

    timed(None)
    off = timed(None)
    agent = Agent("http://127.0.0.1:9", run="host-cost", every=1, transport=NullTransport(),
                  stats_backend="triton").watch(model)
    agent.step(0)
    timed(agent)
    launches[0] = 0
    on = timed(agent)
    per_step = launches[0] / steps
    agent.close()
    print(f"agent off {off * 1e6:.0f} us/step, on {on * 1e6:.0f} us/step (kernel a no-op): "
          f"+{(on - off) * 1e6:.0f} us for {per_step:.0f} launches, {(on - off) * 1e6 / per_step:.1f} us per launch; "
          f"agent errors {agent.errors}")


if __name__ == "__main__":
    main()
