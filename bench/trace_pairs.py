"""What each statistics launch costs over the amax pass it replaces, from the Chrome traces of
``FP8MON_PROFILE_TRACE=DIR python3 bench/agent_overhead.py ... --cuda-graph --profile device``.

The agent-on steps run the agent-off steps' kernels in the same order, with each current-scaled cast's amax pass
(``_amax_partials_kernel``) replaced by a ``_stats_kernel`` launch, plus the grad_weights' launch at the end of the
backward pass (a step's last). The i-th of one pairs with the i-th of the other. The pairs are grouped by the amax
pass's time (a proxy for the tensor's size), and each group's extra time is printed, with the GPU's idle time per
step (span minus the time of kernels, copies and memsets).

    python3 bench/trace_pairs.py DIR --steps 3
"""

import argparse
import collections
import gzip
import json
import statistics
from pathlib import Path


def kernels(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    return sorted(ks, key=lambda e: e["ts"])


def trace(directory: Path, phase: str) -> Path:
    return next(p for p in (directory / f"{phase}.json.gz", directory / f"{phase}.json") if p.exists())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="FP8MON_PROFILE_TRACE's directory (off.json[.gz], triton.json[.gz])")
    p.add_argument("--steps", type=int, default=3, help="the profiled steps per phase (--steps of agent_overhead)")
    args = p.parse_args(argv)
    off, on = kernels(trace(args.dir, "off")), kernels(trace(args.dir, "triton"))
    for name, ks in (("off", off), ("on", on)):
        span = (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) / args.steps / 1e3
        busy = sum(k["dur"] for k in ks) / args.steps / 1e3
        print(f"agent {name}: span {span:.2f} ms per step, busy {busy:.2f} ms, idle {span - busy:.2f} ms")
    amax = [k for k in off if k["name"] == "_amax_partials_kernel"]
    stats = [k for k in on if k["name"] == "_stats_kernel"]
    amax = amax[: len(amax) // args.steps]  # one step's
    stats = stats[: len(stats) // args.steps]
    print(f"launches per step: {len(amax)} amax passes, {len(stats)} statistics launches")
    if len(stats) == len(amax) + 1:
        last = stats.pop()
        print(f"  the last, the grad_weights' ({last['args']['grid'][0]} programs): {last['dur']:.1f} us")
    groups = collections.defaultdict(list)
    for a, s in zip(amax, stats):
        groups[round(a["dur"] / 5) * 5].append((a["dur"], s["dur"]))
    total = 0.0
    for key in sorted(groups):
        pairs = groups[key]
        extra = [s - a for a, s in pairs]
        total += sum(extra)
        print(f"  amax ~{key:4.0f} us: {len(pairs):3d} launches, statistics median "
              f"{statistics.median(s for _, s in pairs):7.1f} us, extra median {statistics.median(extra):6.1f} us, "
              f"extra in all {sum(extra) / 1e3:.2f} ms")
    print(f"extra over the amax passes, per step: {total / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
