"""Bandwidth of the one-pass Triton statistics kernel as a fraction of the device copy bandwidth measured in the
same run (SPEC section 7: >= 0.80, stretch 0.90), with the naive torch path beside it.

    python3 bench/stats_kernel.py                 # sizes 16, 64, 256 MiB, bf16 and fp32, and batched small tensors

Copy bandwidth: torch ``dst.copy_(src)`` of the same bytes, counted read + write. The statistics kernel reads each
byte once and writes a few hundred bytes, so its bandwidth is bytes read / time. Two times per case:
- ``fraction_of_copy``: the statistics kernels' device time (torch.profiler), the figure of the SPEC target;
- ``call_fraction_of_copy``: a whole ``partials`` call (``triton.testing.do_bench``, CUDA events), which includes
  the launcher's host work whenever that is longer than the kernel.
Buffers rotate over >= 512 MiB so no size is served from L2. Variants: ``hist`` (every statistic and the log2
histogram, E4M3 with a scale), ``nohist`` (the same without the histogram), ``current_hist`` (no scale before the
read, as a current-scaled cast's row). The figures are appended to bench/results/stats_kernel.csv (bench/record.py;
``--no-record`` skips it).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.record import Recorder  # noqa: E402
from fp8mon.agent.stats import launch as ts  # noqa: E402
from fp8mon.agent.stats import torch_path as ds  # noqa: E402

MiB = 1 << 20


def rotating(nbytes: int, dtype, total: int = 512 * MiB) -> list[torch.Tensor]:
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    return [torch.randn(n, device="cuda").to(dtype) for _ in range(max(2, total // nbytes))]


def call_ms(fn, bufs, rep=200) -> float:
    """Median ms of fn(buf) over CUDA events, rotating over bufs."""
    it = [0]

    def call():
        fn(bufs[it[0] % len(bufs)])
        it[0] += 1

    return triton.testing.do_bench(call, warmup=25, rep=rep, return_mode="median")


def kernel_ms(fn, bufs, reps: int = 20, name: str = "stats") -> float:
    """Device ms per call of the kernels whose names hold ``name`` (torch.profiler)."""
    fn(bufs[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(bufs[i % len(bufs)])
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA" and name in e.name)
    return us / reps / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="MiB")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the figures to bench/results/stats_kernel.csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/stats_kernel.py needs a CUDA GPU")
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rec = Recorder("stats_kernel")
    scale = torch.tensor(2.0, device="cuda")
    center = torch.tensor([0.0, 1.0], dtype=torch.float64, device="cuda")
    variants = {
        "hist": dict(fmt="e4m3", scale=scale, center=center, hist=True),
        "nohist": dict(fmt="e4m3", scale=scale, center=center, hist=False),
        "current_hist": dict(fmt="e4m3", center=center, hist=True),
    }
    for dtype in (torch.bfloat16, torch.float32):
        dt = str(dtype).split(".")[1]
        for mib in (int(s) for s in args.sizes.split(",")):
            nbytes = mib * MiB
            bufs = rotating(nbytes, dtype)
            dst = torch.empty_like(bufs[0])
            copy_gbs = 2 * nbytes / call_ms(lambda b: dst.copy_(b), bufs) / 1e6  # read + write
            rec.add(f"copy_bandwidth/{dt}/{mib}MiB", copy_gbs / 1e3, "TB/s")
            line = [f"{dt} {mib:4} MiB: copy {copy_gbs / 1e3:.2f} TB/s"]
            for name, kw in variants.items():
                k = kernel_ms(lambda b: ts.partials(b, **kw), bufs)
                c = call_ms(lambda b: ts.partials(b, **kw), bufs)
                rec.add(f"fraction_of_copy/{dt}/{mib}MiB/{name}", nbytes / k / 1e6 / copy_gbs, "ratio")
                rec.add(f"kernel_us/{dt}/{mib}MiB/{name}", k * 1e3, "us")
                rec.add(f"call_fraction_of_copy/{dt}/{mib}MiB/{name}", nbytes / c / 1e6 / copy_gbs, "ratio")
                line.append(f"{name} {nbytes / k / 1e6 / copy_gbs:.3f} ({k * 1e3:.1f} us; call "
                            f"{nbytes / c / 1e6 / copy_gbs:.3f})")
            if mib == 64:
                t = call_ms(lambda b: ds.partials(b, fmt="e4m3", scale=scale), bufs, rep=50)
                rec.add(f"call_fraction_of_copy/{dt}/{mib}MiB/naive_torch", nbytes / t / 1e6 / copy_gbs, "ratio")
                line.append(f"naive torch {nbytes / t / 1e6 / copy_gbs:.3f} ({t:.2f} ms)")
            print("  ".join(line), flush=True)
            del bufs, dst
            torch.cuda.empty_cache()
    # many small tensors in one launch: the shapes one GPT-124M step hands the agent (per layer: input, weight,
    # output, grad_output, grad_weight of qkv/proj/fc1/fc2 at batch 16 x 1024)
    d, tok = 768, 16 * 1024
    shapes = []
    for (i, o) in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)):
        shapes += [(tok * i, torch.bfloat16), (o * i, torch.float32), (tok * o, torch.bfloat16),
                   (tok * o, torch.bfloat16), (o * i, torch.float32)]
    sets = [[torch.randn(n, device="cuda").to(dt) for n, dt in shapes] for _ in range(4)]
    nbytes = sum(x.numel() * x.element_size() for x in sets[0])
    dst = [torch.empty_like(x) for x in sets[0]]
    copy_gbs = 2 * nbytes / call_ms(lambda xs: torch._foreach_copy_(dst, xs), sets) / 1e6
    k = kernel_ms(lambda xs: ts.rows(xs, fmt="e4m3", scale=scale, center=center), sets)
    each = call_ms(lambda xs: [ts.partials(x, fmt="e4m3", scale=scale, center=center) for x in xs], sets, rep=100)
    rec.add("fraction_of_copy/multi20_124m_layer/one_launch", nbytes / k / 1e6 / copy_gbs, "ratio")
    rec.add("call_fraction_of_copy/multi20_124m_layer/per_tensor", nbytes / each / 1e6 / copy_gbs, "ratio")
    print(f"20 tensors of a 124M layer, {nbytes / MiB:.0f} MiB: one launch {nbytes / k / 1e6 / copy_gbs:.3f} of copy "
          f"({k:.3f} ms), a call per tensor {nbytes / each / 1e6 / copy_gbs:.3f}")
    print("(ratios: the kernel's read bandwidth / copy bandwidth of the same bytes, read + write)")
    if args.record:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
