"""Device time of the standalone statistics kernel alone (CUDA kernel time from torch.profiler), beside the
host time of a whole ``triton_stats.partials`` call, as fractions of the copy bandwidth measured in the same
run. bench/stats_kernel.py times whole calls with CUDA events, so its figures include the launcher's host
work whenever that is longer than the kernel; this one separates the two.

    python3 bench/stats_kernel_time.py            # on a GPU: sizes 16, 64, 256 MiB, bf16 and fp32,
                                                  # the 20 tensors of a GPT-124M layer, a launch-shape sweep
    python3 bench/stats_kernel_time.py --no-sweep # the same without the sweep
    python3 bench/stats_kernel_time.py --no-sweep --variants "default;agent.triton_stats.EXPONENT_ROWS=False"
                                                  # ... each size under each variant (bench/variants.py), in turn

With ncu (hardware counters) on the kernel: ``ncu --clock-control none -k regex:_stats_kernel --launch-count 8
--section SpeedOfLight --section Occupancy --section LaunchStats python3 bench/stats_kernel_time.py --ncu``
(``--ncu``: only 8 launches, 64 and 256 MiB bf16 with and without the histogram, nothing timed).

``--trace``: kernel time and a per-program timeline (GPU timer stamps: start, set-up done, loop done, partial
stored, end, and the last program's merge) for fixed 64k-element chunks and for one wave of programs (``WAVES``),
16, 64 and 256 MiB of bf16, 256 MiB of fp32. ``--trace-small``: the same for small tensors of a 124M step, beside
the amax pass a cast's statistics launch replaces. ``--cast-small``: per-cast device time of a 124M step's activation
casts with their rows (``cast_small``).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import launch as ts  # noqa: E402
from bench.variants import applied, parse_all  # noqa: E402

MiB = 1 << 20


def timed(fn, reps: int = 20, kernel: str = "stats") -> tuple[float, float, float]:
    """(host µs per call, wall µs per call, device µs per call of the kernels whose names hold ``kernel``)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernel = sum(e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type.name == "CUDA" and kernel in e.name)
    return host * 1e6, wall * 1e6, kernel / reps


def copy_tbs(x: torch.Tensor) -> float:
    """Copy bandwidth, TB/s counting read + write."""
    dst = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: dst.copy_(x), warmup=25, rep=100, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e12


def _partials(x, scale, center, hist):
    if scale is None:  # no format: no scale before the read, as a bf16 model's rows
        return lambda: ts.partials(x, center=center, hist=hist)
    return lambda: ts.partials(x, fmt="e4m3", scale=scale, center=center, hist=hist)


def timeline(stamps: torch.Tensor, cap: int) -> str:
    """Summary of one launch's [programs, 16] stamps (ns, low 32 bits of the GPU timer)."""
    t = stamps[:, :5].to(torch.int64).cpu()  # start, set-up done, loop done, partial stored, end
    t = (t - t[:, :1].min()) % (1 << 32)
    span = int(t[:, 4].max())
    med = [float((t[:, i + 1] - t[:, i]).float().median()) / 1e3 for i in range(4)]
    last = int(t[:, 4].argmax())
    # last program, from its partial stored (3): 7 counted in, 8 partials loaded, 5 reduced, 6 moments, 4 end
    f = (stamps[last].to(torch.int64).cpu() - int(stamps[last, 3])) % (1 << 32)
    fin = [int(f[7]), int(f[5] - f[7]), int(f[6] - f[5]), int(f[4] - f[6])]
    # stamped only where the merge reads its partials at once (up to P_BLOCK of them)
    loads = f"{int(f[8] - f[7]) / 1e3:.2f}" if int(stamps[last, 8]) else "n/a"
    busy = float((t[:, 4] - t[:, 0]).sum()) / (span * min(len(t), ts._slots(torch.device("cuda"), cap)))
    return (f"{len(t)} programs, span {span / 1e3:.1f} us; starts p50 {float(t[:, 0].float().median()) / 1e3:.1f} "
            f"max {float(t[:, 0].max()) / 1e3:.1f} us; medians: set-up {med[0]:.2f}, loop {med[1]:.2f}, result "
            f"{med[2]:.2f}, done {med[3]:.2f} us; last program's done {float(t[last, 4] - t[last, 3]) / 1e3:.2f} us "
            f"(its counter {fin[0] / 1e3:.2f}; merge, from there: loads {loads}, reduced {fin[1] / 1e3:.2f}; then "
            f"moments {fin[2] / 1e3:.2f}, row {fin[3] / 1e3:.2f}); slot occupancy {busy:.2f}")


def timed_and_traced(x, scale, center, hist) -> tuple[float, str]:
    """The statistics kernel's time on x (µs, ``timed``) and one launch's ``timeline``."""
    _, _, kernel = timed(_partials(x, scale, center, hist))
    ts._trace = []
    ts.partials(x, fmt="e4m3", scale=scale, center=center, hist=hist)
    torch.cuda.synchronize()
    line = timeline(ts._trace[0], ts.MAXNREG_FP32 if x.dtype == torch.float32 else ts.MAXNREG)
    ts._trace = None
    return kernel, line


def trace_mode(scale, center) -> None:
    for dtype, mib in ((torch.bfloat16, 64), (torch.float32, 256), (torch.bfloat16, 256), (torch.bfloat16, 16)):
        nbytes = mib * MiB
        x = torch.randn(nbytes // torch.empty((), dtype=dtype).element_size(), device="cuda").to(dtype)
        bw = copy_tbs(x)
        for waves, chunk in ((None, 1 << 16), (1, 1 << 20)):
            ts.WAVES, ts.CHUNK = waves, chunk
            for hist in (False, True):
                kernel, tl_ = timed_and_traced(x, scale, center, hist)
                print(f"{str(dtype)[6:]:8} {mib:3} MiB WAVES={waves} CHUNK={chunk} hist={hist!s:5}: kernel "
                      f"{kernel:7.1f} us = {nbytes / (kernel * 1e-6) / 1e12 / bw:.3f} of copy ({bw:.2f} TB/s) | {tl_}",
                      flush=True)
        del x


def trace_small(scale, center) -> None:
    """``--trace-small``: tensors of a 124M step's casts (a weight, an activation, fc1's weight, fc2's input), the
    amax pass that a cast's statistics launch replaces, and the statistics kernel's timeline at one wave of
    programs (the default) and at fixed chunks (fewer, longer programs)."""
    from fp8mon.trainer.kernels.quantize import amax_partials

    for dtype, shape in ((torch.float32, (768, 768)), (torch.bfloat16, (8192, 768)), (torch.float32, (3072, 768)),
                         (torch.bfloat16, (8192, 3072))):
        x = torch.randn(*shape, device="cuda").to(dtype)
        _, _, amax_us = timed(lambda: amax_partials(x), kernel="amax")
        print(f"{str(dtype)[6:]:8} {tuple(shape)}: amax pass {amax_us:.1f} us", flush=True)
        for waves, chunk in ((1, 1 << 20), (None, 1 << 16), (None, 1 << 18)):
            ts.WAVES, ts.CHUNK = waves, chunk
            kernel, tl_ = timed_and_traced(x, scale, center, False)
            print(f"  WAVES={waves} CHUNK={chunk}: kernel {kernel:6.1f} us | {tl_}", flush=True)
        ts.WAVES, ts.CHUNK = 1, 1 << 20


def cast_small() -> None:
    """``--cast-small``: device time per current-scaled cast of the activations of a 124M step (bf16), 48 casts into
    48 rows then ``flush_deferred``: plain (amax pass + cast), and with the row from the statistics launch in place
    of the amax pass, merged by that launch's last program (``CAST_MERGE = "last"``) or by one merge launch for the
    48 rows at the flush ("later"). Per kernel name, from torch.profiler; with and without the histogram."""
    from fp8mon.trainer.kernels.quantize_transpose import quantize_transpose

    rows, calls, reps = torch.zeros(48, ts.ds.WIDTH, dtype=torch.float64, device="cuda"), 48, 5
    for shape in ((8192, 768), (8192, 3072)):
        x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
        for hist in (False, True):
            for mode in ("plain", "last", "later"):
                ts.CAST_MERGE = mode if mode != "plain" else "later"

                def run():
                    for i in range(calls):
                        tgt = None if mode == "plain" else ts.Target(rows, i, False, (0.0, 1.0), 6.0, hist)
                        quantize_transpose(x, "e4m3", stats=tgt)
                    ts.flush_deferred()

                run()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        run()
                    torch.cuda.synchronize()
                per: dict = {}
                for e in prof.events():
                    if e.device_type.name == "CUDA":
                        name = next((k for k in ("_stats_kernel", "_merge_kernel", "_amax_partials_kernel",
                                                 "_quantize_transpose_kernel") if k in e.name), "other")
                        per[name] = per.get(name, 0.0) + e.time_range.elapsed_us() / (reps * calls)
                total = sum(per.values())
                print(f"bf16 {shape} hist={hist!s:5} {mode:5}: {total:6.2f} us per cast | " + ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(per.items())), flush=True)
    ts.CAST_MERGE = "later"


def host_mode(center) -> None:
    """Where a ``triton_stats.rows`` call spends its host time: the agent's form of the call (one tensor, its row
    into a step buffer, a device center): 300 queued calls timed, then 300 more under cProfile, top functions by
    own time (``bench.gemm.host_us`` and ``profile_calls``)."""
    from bench.gemm import host_us, profile_calls

    x = torch.randn(8 << 20, device="cuda").to(torch.bfloat16)
    out = torch.zeros(4, ts.ds.WIDTH, dtype=torch.float64, device="cuda")

    def call():
        ts.rows([x], fmt="e4m3", center=[center], hist=False, out=out, index=[1], merge=[False])

    for _ in range(20):  # compiles, and grows the staging ring to what queued calls need
        call()
    host = host_us(call, 300)
    print(f"{torch.cuda.get_device_name()}: host time per rows() call {host:.1f} us (300 calls queued)")
    print("\n".join(profile_calls(call, 300).splitlines()[:40]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ncu", action="store_true", help="only the 8 launches for ncu, no timing")
    p.add_argument("--trace", action="store_true", help="fixed and one-wave chunks, with timelines")
    p.add_argument("--no-sweep", action="store_true", help="without the launch-shape sweep")
    p.add_argument("--trace-small", action="store_true",
                   help="a 124M step's small cast tensors: amax pass, and timelines at two chunkings")
    p.add_argument("--host", action="store_true",
                   help="host time of rows() calls on 16 MiB of bf16, and their cProfile")
    p.add_argument("--unscaled", action="store_true",
                   help="the sizes with no format (no scale before the read, as a bf16 model's rows), not e4m3 at a "
                        "given scale")
    p.add_argument("--variants", default="default",
                   help="the sizes' kernel times under each variant (bench/variants.py), one after another")
    p.add_argument("--cast-small", action="store_true",
                   help="a 124M step's activation casts with their rows, merged by the last program or later")
    args = p.parse_args()
    if args.cast_small:
        print(torch.cuda.get_device_name())
        cast_small()
        return
    scale = torch.tensor(2.0, device="cuda")
    center = torch.tensor([0.0, 1.0], dtype=torch.float64, device="cuda")
    if args.host:
        host_mode(center)
        return
    if args.trace or args.trace_small:
        print(torch.cuda.get_device_name())
        (trace_small if args.trace_small else trace_mode)(scale, center)
        return
    if args.ncu:
        for mib in (64, 256):
            x = torch.randn(mib * MiB // 2, device="cuda").to(torch.bfloat16)
            for hist in (True, False):
                for _ in range(2):
                    ts.partials(x, fmt="e4m3", scale=scale, center=center, hist=hist)
        torch.cuda.synchronize()
        return
    print(torch.cuda.get_device_name())
    variants = parse_all(args.variants)
    for dtype in (torch.bfloat16, torch.float32):
        for mib in (16, 64, 256):
            nbytes = mib * MiB
            x = torch.randn(nbytes // torch.empty((), dtype=dtype).element_size(), device="cuda").to(dtype)
            bw = copy_tbs(x)
            for name, assignments in variants:
                label = "" if len(variants) == 1 else f" [{name}]"
                for hist in (True, False):
                    with applied(assignments):
                        host, wall, kernel = timed(_partials(x, None if args.unscaled else scale, center, hist))
                    print(f"{str(dtype)[6:]:9} {mib:4} MiB hist={hist!s:5}{label} copy {bw:5.2f} TB/s | kernel "
                          f"{kernel:8.1f} us = {nbytes / (kernel * 1e-6) / 1e12 / bw:.3f} of copy | host/call "
                          f"{host:7.1f} us, wall/call {wall:7.1f} us = {nbytes / (wall * 1e-6) / 1e12 / bw:.3f}",
                          flush=True)
            del x
    # the 20 tensors of one GPT-124M layer (input, weight, output, grad_output, grad_weight of 4 linears)
    d, tok = 768, 16 * 1024
    shapes = []
    for (i, o) in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)):
        shapes += [(tok * i, torch.bfloat16), (o * i, torch.float32), (tok * o, torch.bfloat16),
                   (tok * o, torch.bfloat16), (o * i, torch.float32)]
    xs = [torch.randn(n, device="cuda").to(dt) for n, dt in shapes]
    nbytes = sum(x.numel() * x.element_size() for x in xs)
    host, wall, kernel = timed(lambda xs=xs: ts.rows(xs, fmt="e4m3", scale=scale, center=center))
    print(f"20 tensors {nbytes / MiB:.0f} MiB: kernel {kernel:.1f} us = {nbytes / (kernel * 1e-6) / 1e12 / bw:.3f} "
          f"of copy; host/call {host:.1f} us, wall {wall:.1f} us")
    del xs
    if args.no_sweep:
        return
    # launch shapes (chunks sized by WAVES, the default), 64 and 256 MiB bf16
    for mib in (64, 256):
        x = torch.randn(mib * MiB // 2, device="cuda").to(torch.bfloat16)
        bw = copy_tbs(x)
        for rows, warps, nreg in ((512, 8, 80), (512, 8, 96), (512, 8, 128), (1024, 8, 96), (1024, 8, 128),
                                  (256, 4, 80), (512, 4, 128)):
            ts.ROWS, ts.NUM_WARPS, ts.MAXNREG = rows, warps, nreg  # the cap of launches holding bf16
            for hist in (True, False):
                _, _, kernel = timed(_partials(x, scale, center, hist))
                print(f"sweep {mib} MiB ROWS={rows} warps={warps} maxnreg={nreg} hist={hist}: {kernel:.1f} us = "
                      f"{mib * MiB / (kernel * 1e-6) / 1e12 / bw:.3f} of copy ({bw:.2f} TB/s)", flush=True)
        del x

if __name__ == "__main__":
    main()
