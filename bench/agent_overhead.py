"""Step time of a GPT-style model with the agent off vs on (every step, all block linears, all five sites),
as a ratio measured in one process: off, on, off again (the two off phases bracket drift).

    python bench/agent_overhead.py --device cpu --config tiny
    python bench/agent_overhead.py --device cuda --config 124m --dtype bf16

The agent posts to --url (a real `fp8mon serve`), or by default to bench/sink.py, a stdlib endpoint in a
subprocess that acknowledges every batch, so the agent's whole client side (statistics, copy, encoding,
gzip, HTTP) is in the measurement.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent import Agent  # noqa: E402
from bench.gpt import CONFIGS, GPT  # noqa: E402


def timed_steps(model, opt, batch, n, device, dtype, agent=None, start=0) -> list[float]:
    idx, targets = batch
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if agent is not None:
            agent.log(start + i, loss=loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--url", default=None, help="monitor URL; default: a local acknowledging sink")
    parser.add_argument("--stats-backend", default="auto", choices=["auto", "triton", "torch"],
                        help="the agent's statistics path: one-pass Triton kernel or plain torch")
    args = parser.parse_args()

    device = torch.device(args.device)
    config = CONFIGS[args.config or ("124m" if device.type == "cuda" else "tiny")]
    batch_size = args.batch or (16 if device.type == "cuda" else 8)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    torch.manual_seed(0)
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    idx = torch.randint(0, config.vocab, (batch_size, config.seq_len), device=device)
    batch = (idx, torch.roll(idx, -1, dims=1))

    sink = None
    url = args.url
    if url is None:
        sink = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sink.py"))], stdout=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
    try:
        timed_steps(model, opt, batch, args.warmup, device, dtype)
        off1 = timed_steps(model, opt, batch, args.steps, device, dtype)
        with tempfile.TemporaryDirectory() as spool:
            agent = Agent(url, run=f"bench-{int(time.time())}", every=args.every, modules=r"^blocks\.",
                          spool_dir=spool, stats_backend=args.stats_backend).watch(model)
            n_linears = len(agent._layers)
            timed_steps(model, opt, batch, args.warmup, device, dtype, agent, start=0)
            on = timed_steps(model, opt, batch, args.steps, device, dtype, agent, start=args.warmup)
            delivered = agent.close(timeout=120)
            errors = agent.errors
        off2 = timed_steps(model, opt, batch, args.steps, device, dtype)
    finally:
        if sink is not None:
            sink.terminate()

    # Means, not medians: with every=N only one step in N reports, and its cost must be averaged in.
    mean_off = statistics.fmean(off1 + off2)
    mean_on = statistics.fmean(on)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, config {args.config or ''} "
          f"(layers {config.n_layer}, d {config.d_model}, seq {config.seq_len}), batch {batch_size}, {dtype}")
    print(f"agent: every={args.every}, {n_linears} linears x 5 sites, stats {args.stats_backend}, "
          f"delivered={delivered}, errors={errors}")
    print(f"{'phase':<10}{'mean ms':>10}{'median ms':>12}{'min ms':>10}")
    for label, ts in (("off", off1), ("on", on), ("off again", off2)):
        print(f"{label:<10}{statistics.fmean(ts) * 1e3:>10.2f}{statistics.median(ts) * 1e3:>12.2f}{min(ts) * 1e3:>10.2f}")
    print(f"overhead: on/off = {mean_on / mean_off:.3f}  ({(mean_on / mean_off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
