"""The consumer kernels that take a linear's output row, on a GPU, at the 124M and 1.5B steps' shapes (bf16):
SwiGLU's elementwise part, torch's ``F.silu(gate) * up`` (forward, and autograd's backward) against the fused kernels
of trainer/kernels/swiglu.py; the residual add, torch's ``x + b`` (fp32 stream, bf16 branch) against
trainer/kernels/residual.py; each fused forward with its statistics row against torch plus the standalone statistics
kernel reading the tensor apart (what the agent costs without the fusion), and the backwards with their gradient's
row (a plain linear's grad_output) against that row read apart; RMSNorm (trainer/kernels/rmsnorm.py, with the row of
its output, the next linear's input) against torch's ops; RoPE on the qkv output, torch's ``Rotary`` on q and k
(forward, and autograd's backward) against trainer/kernels/rope.py. Device time of queued launches
(``trainer.kernels.timing.device_medians``).

    python3 bench/consumers.py
    python3 bench/consumers.py --only-norm         # RMSNorm only
    python3 bench/consumers.py --shapes 124m       # one step's shapes
    python3 bench/consumers.py --swiglu-y-row    # SwiGLU's forward with y's row: each way, setting and input

With ``--ncu [SHAPE]`` each kernel runs once with and once without its row, nothing timed, between
``cudaProfilerStart`` and ``cudaProfilerStop`` (compiled before), for hardware counters::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section LaunchStats --metrics smsp__inst_executed.sum \
        python3 bench/consumers.py --ncu 124m > REPORT
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8mon.agent.stats import launch as ts  # noqa: E402
from fp8mon.agent.stats import layout  # noqa: E402
from fp8mon.trainer.kernels.residual import branch_grad, residual_add_forward  # noqa: E402
from fp8mon.trainer.kernels.rmsnorm import rms_norm_backward, rms_norm_forward, rms_norm_ref  # noqa: E402
from fp8mon.trainer.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_ref  # noqa: E402
from fp8mon.trainer.kernels.timing import device_medians  # noqa: E402

STEP_ROWS = 48  # the rows a 124M FP8 step's consumer kernels take: SwiGLU, RoPE and two residual adds in 12 layers
SHAPES = {"124m": (16 * 1024, 2048, 768), "1.5b": (4 * 2048, 8192, 2048)}  # (tokens, SwiGLU hidden width, d_model)
ROPE_SHAPES = {"124m": (16, 1024, 6), "1.5b": (4, 2048, 16)}  # (batch, sequence, heads)


class StepRows:
    """Targets for the kernels' rows: a row of its own for each call, as a step's rows are. (A row merged later,
    ``stats.launch.merge_later``, waits for one merge launch of many rows, which the timings include once every
    STEP_ROWS calls; one row for every call would add a merge launch to each.)"""

    def __init__(self, dev: torch.device):
        self.rows = torch.zeros(STEP_ROWS, layout.WIDTH, dtype=torch.float64, device=dev)
        self.calls = 0

    def __call__(self, hist: bool = False) -> ts.Target:
        self.calls += 1
        return ts.Target(self.rows, self.calls % STEP_ROWS, False, (0.0, 1.0), 6.0, hist, None, "e4m3")


def swiglu_y_row(name: str, dev: torch.device) -> None:
    """SwiGLU's forward with y's row alone (no h row: an FP8 fc2 takes its input's): plain, with the row, and y read
    apart by the statistics kernel; the words path with the outlier center
    as a device tensor (as the agent passes it), without a format, with the histogram; and the plain and words
    forwards on inputs with outliers or with small values and zeros (the row's counts depend on the values)."""
    tokens, hidden, _ = SHAPES[name]
    base = torch.randn(tokens, 2 * hidden, device=dev)
    y = base.to(torch.bfloat16)
    center = torch.tensor([0.01, 1.3], dtype=torch.float64, device=dev)
    step, apart = StepRows(dev), torch.zeros(2, layout.WIDTH, dtype=torch.float64, device=dev)

    def tgt(hist=False, center=(0.0, 1.0), fmt="e4m3"):
        step.calls += 1
        return ts.Target(step.rows, step.calls % STEP_ROWS, False, center, 6.0, hist, None, fmt)

    def timed(fns: dict, what: str) -> None:
        for fn in fns.values():
            fn()
        ts.merge_later()
        torch.cuda.synchronize()
        t = device_medians(fns, rounds=5, calls=10)
        print(f"{name} {what}: " + " | ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()), flush=True)

    timed({"plain": lambda: swiglu_forward(y),
           "words + row": lambda: swiglu_forward(y, stats=tgt()),
           "plain + y read apart": lambda: (swiglu_forward(y), ts.rows(
               [y], fmt="e4m3", center=[(0.0, 1.0)], hist=False, out=apart, index=[1])),
           "words + row, center tensor": lambda: swiglu_forward(y, stats=tgt(center=center)),
           "words + row, no format": lambda: swiglu_forward(y, stats=tgt(fmt=None)),
           "words + row, hist": lambda: swiglu_forward(y, stats=tgt(hist=True))}, f"y {tuple(y.shape)}")
    inputs = {"outliers to ~1e3": base.clone(), "outliers to ~1e5": base.clone(),
              "1e-3 with a tenth zeros": base * 1e-3 * (torch.rand_like(base) > 0.1)}
    for x, amax in zip(list(inputs.values())[:2], (1e3, 1e5)):
        x[::97, ::13] *= amax / 5  # randn's amax is about 5
    for what, x in inputs.items():
        x = x.to(torch.bfloat16)
        timed({"plain": lambda: swiglu_forward(x), "words + row": lambda: swiglu_forward(x, stats=tgt())}, what)


def torch_backward(y: torch.Tensor, dh: torch.Tensor):
    """torch's forward and autograd backward of silu(gate) * up (a backward needs its forward's graph: the backward's
    own time is this minus the forward's)."""
    yy = y.detach().requires_grad_()
    swiglu_ref(yy).backward(dh)
    return yy.grad


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only-norm", action="store_true", help="the RMSNorm timings only")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: the steps' shapes to time, of "
                                                               f"{', '.join(SHAPES)}")
    p.add_argument("--swiglu-y-row", action="store_true",
                   help="SwiGLU's forward with y's row (an FP8 fc1's output) only: each way of taking it, each setting "
                        "of its target, and inputs with outliers or small values")
    p.add_argument("--ncu", nargs="?", const="124m", choices=list(SHAPES),
                   help="each kernel once with and once without its row, for ncu (see above), nothing timed")
    args = p.parse_args(argv)
    shapes = [name.strip() for name in args.shapes.split(",")]
    if not set(shapes) <= set(SHAPES):
        p.error(f"--shapes: {args.shapes!r}: each of {', '.join(SHAPES)}")
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    if args.ncu:
        for_ncu(args.ncu, dev)
        return
    if args.swiglu_y_row:
        for name in shapes:
            swiglu_y_row(name, dev)
        return
    if args.only_norm:
        for name in shapes:
            tokens, _, d_model = SHAPES[name]
            norm(name, tokens, d_model, dev)
        return
    for name in shapes:
        tokens, hidden, d_model = SHAPES[name]
        norm(name, tokens, d_model, dev)
        residual(name, tokens, d_model, dev)
        batch, seq, heads = ROPE_SHAPES[name]
        rope(name, batch, seq, d_model, heads, dev)
        y = torch.randn(tokens, 2 * hidden, device=dev).to(torch.bfloat16)
        dh = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
        for hist in (False, True):
            rows = torch.zeros(2, layout.WIDTH, dtype=torch.float64, device=dev)  # the rows read apart
            step = StepRows(dev)

            def tgt():
                return step(hist)

            def both_rows():  # the words path: y's row in the kernel, h's by a statistics launch (deferred)
                swiglu_forward(y, stats=tgt(), h_stats=tgt())
                ts.flush_deferred()

            fns = {
                "torch forward": lambda: swiglu_ref(y),
                "fused forward": lambda: swiglu_forward(y),
                "fused forward + row": lambda: swiglu_forward(y, stats=tgt()),
                "fused forward + rows of y and h": both_rows,
                "torch forward + row read apart": lambda: (swiglu_ref(y), ts.rows(
                    [y], fmt="e4m3", center=[(0.0, 1.0)], hist=hist, out=rows, index=[1])),
                "torch forward + backward": lambda: torch_backward(y, dh),
                "fused backward": lambda: swiglu_backward(y, dh),
                "fused backward + dy's row": lambda: swiglu_backward(y, dh, stats=tgt()),
                "dy's row read apart": lambda: ts.rows([y], fmt="e5m2", center=[(0.0, 1.0)], hist=hist, out=rows,
                                                       index=[1]),
            }
            for fn in fns.values():
                fn()  # compiles outside the timing
            t = device_medians(fns, rounds=5, calls=10)
            gb = y.numel() * 2 * 1.5 / 1e9  # forward: y read, h written
            print(f"{name} y {tuple(y.shape)} hist={hist}: " + ", ".join(
                f"{k} {v * 1e3:.1f} us" for k, v in t.items())
                + f" | fused forward at {gb / (t['fused forward'] * 1e-3) / 1e3:.2f} TB/s", flush=True)
            print(f"  fused backward - torch forward+backward: "
                  f"{(t['fused backward'] - (t['torch forward + backward'] - t['torch forward'])) * 1e3:+.1f} us; "
                  f"row: fused +{(t['fused forward + row'] - t['fused forward']) * 1e3:.1f} us, read apart "
                  f"+{(t['torch forward + row read apart'] - t['torch forward']) * 1e3:.1f} us; dy's row: fused "
                  f"+{(t['fused backward + dy' + chr(39) + 's row'] - t['fused backward']) * 1e3:.1f} us, read apart "
                  f"+{t['dy' + chr(39) + 's row read apart'] * 1e3:.1f} us", flush=True)


def for_ncu(name: str, dev: torch.device) -> None:
    """Each consumer kernel at ``name``'s shape (bf16), without and with its row (no histogram), one launch each
    inside the profiler's range, in the order printed."""
    from fp8mon.trainer.kernels.rope import rope_qkv_backward, rope_qkv_forward

    y, dh, x, b, w, (rot, qkv, grads), heads = _step_inputs(name, dev)
    tgt = StepRows(dev)
    fns = {
        "swiglu forward": lambda: swiglu_forward(y),
        "swiglu forward + y's row (words)": lambda: swiglu_forward(y, stats=tgt()),
        "swiglu backward": lambda: swiglu_backward(y, dh),
        "swiglu backward + dy's row": lambda: swiglu_backward(y, dh, stats=tgt()),
        "rope forward": lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, heads),
        "rope forward + row": lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, heads, stats=tgt()),
        "rope backward": lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16),
        "rope backward + row": lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16, stats=tgt()),
        "residual add": lambda: residual_add_forward(x, b),
        "residual add + row": lambda: residual_add_forward(x, b, stats=tgt()),
        "rmsnorm": lambda: rms_norm_forward(x, w, 1e-6),
        "rmsnorm + row": lambda: rms_norm_forward(x, w, 1e-6, stats=tgt()),
    }
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in fns.items():
        print(label, flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _step_inputs(name: str, dev: torch.device):
    """The inputs of a step's consumer kernels at ``name``'s shape: SwiGLU's y and h's gradient (bf16), the fp32
    residual stream x and a bf16 branch b, a norm weight w, RoPE's inputs (``_rope_inputs``) and its heads."""
    tokens, hidden, d_model = SHAPES[name]
    batch, seq, heads = ROPE_SHAPES[name]
    y = torch.randn(tokens, 2 * hidden, device=dev).to(torch.bfloat16)
    dh = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    x = torch.randn(tokens, d_model, device=dev)
    b = torch.randn(tokens, d_model, device=dev).to(torch.bfloat16)
    w = torch.randn(d_model, device=dev) + 1.0
    return y, dh, x, b, w, _rope_inputs(batch, seq, d_model, heads, dev), heads


def _rope_inputs(batch: int, seq: int, d_model: int, n_head: int, dev: torch.device):
    """The rotary tables, a bf16 qkv output (batch, seq, 3 * d_model) and the gradients of q, k and v."""
    from fp8mon.trainer.layers import Rotary

    hd = d_model // n_head
    qkv = torch.randn(batch, seq, 3 * d_model, device=dev).to(torch.bfloat16)
    grads = [torch.randn(batch, n_head, seq, hd, device=dev).to(torch.bfloat16) for _ in range(3)]
    return Rotary(hd, seq).to(dev), qkv, grads


def rope(name: str, batch: int, seq: int, d_model: int, n_head: int, dev: torch.device) -> None:
    """RoPE on the qkv output: torch's (Rotary on the permuted q and k views, autograd's backward) against
    trainer/kernels/rope.py, and the forward with the qkv row and the backward with its gradient's row against the
    row read apart (a tensor of the same shape)."""
    from fp8mon.trainer.kernels.rope import rope_qkv_backward, rope_qkv_forward, rope_qkv_ref

    rot, qkv, grads = _rope_inputs(batch, seq, d_model, n_head, dev)
    rows = torch.zeros(2, layout.WIDTH, dtype=torch.float64, device=dev)  # the rows read apart
    tgt = StepRows(dev)

    def torch_both():
        x = qkv.detach().requires_grad_()
        torch.autograd.backward(rope_qkv_ref(x, rot.cos, rot.sin, n_head), grads)
        return x.grad

    fns = {
        "torch forward": lambda: rope_qkv_ref(qkv, rot.cos, rot.sin, n_head),
        "fused forward": lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, n_head),
        "fused forward + row": lambda: rope_qkv_forward(qkv, rot.cos, rot.sin, n_head, stats=tgt()),
        "torch forward + row read apart": lambda: (rope_qkv_ref(qkv, rot.cos, rot.sin, n_head), ts.rows(
            [qkv], fmt="e4m3", center=[(0.0, 1.0)], hist=False, out=rows, index=[1])),
        "torch forward + backward": torch_both,
        "fused backward": lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16),
        "fused backward + row": lambda: rope_qkv_backward(*grads, rot.cos, rot.sin, torch.bfloat16, stats=tgt()),
        "row read apart": lambda: ts.rows([qkv], fmt="e5m2", center=[(0.0, 1.0)], hist=False, out=rows, index=[1]),
    }
    for fn in fns.values():
        fn()
    t = device_medians(fns, rounds=5, calls=10)
    print(f"{name} rope qkv {tuple(qkv.shape)}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()),
          flush=True)


def norm(name: str, tokens: int, d_model: int, dev: torch.device) -> None:
    """A llama pre-norm on the fp32 residual stream: torch's ops against trainer/kernels/rmsnorm.py, forward with and
    without the row of its output (the next linear's input) and torch's with the row read apart; backward (torch's:
    autograd's through its forward, less that forward)."""
    x = torch.randn(tokens, d_model, device=dev)
    w = torch.randn(d_model, device=dev) + 1.0
    g = torch.randn(tokens, d_model, device=dev)
    _, rstd = rms_norm_forward(x, w, 1e-6)
    rows = torch.zeros(2, layout.WIDTH, dtype=torch.float64, device=dev)
    for hist in (False, True):
        step = StepRows(dev)

        def torch_both():
            xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
            rms_norm_ref(xx, ww, 1e-6).backward(g)

        fns = {
            "torch norm": lambda: rms_norm_ref(x, w, 1e-6),
            "torch norm + row read apart": lambda: ts.rows([rms_norm_ref(x, w, 1e-6)], fmt="e4m3", center=[(0.0, 1.0)],
                                                           hist=hist, out=rows, index=[1]),
            "fused norm": lambda: rms_norm_forward(x, w, 1e-6),
            "fused norm + row": lambda: rms_norm_forward(x, w, 1e-6, stats=step(hist)),
            "torch forward + backward": torch_both,
            "fused backward": lambda: rms_norm_backward(g, x, w, rstd),
        }
        for fn in fns.values():
            fn()
        t = device_medians(fns, rounds=5, calls=10)
        print(f"{name} rmsnorm fp32 {tuple(x.shape)} hist={hist}: " + ", ".join(
            f"{k} {v * 1e3:.1f} us" for k, v in t.items()) + f" | torch backward "
            f"{(t['torch forward + backward'] - t['torch norm']) * 1e3:.1f} us", flush=True)


def residual(name: str, tokens: int, d_model: int, dev: torch.device) -> None:
    x = torch.randn(tokens, d_model, device=dev)
    b = torch.randn(tokens, d_model, device=dev).to(torch.bfloat16)
    rows = torch.zeros(2, layout.WIDTH, dtype=torch.float64, device=dev)  # the rows read apart
    tgt = StepRows(dev)
    fns = {
        "torch add": lambda: x + b,
        "fused add": lambda: residual_add_forward(x, b),
        "fused add + row": lambda: residual_add_forward(x, b, stats=tgt()),
        "torch add + row read apart": lambda: (x + b, ts.rows([b], fmt="e4m3", center=[(0.0, 1.0)], hist=False,
                                                                out=rows, index=[1])),
        # the backward: b's gradient, the fp32 stream's cast to bf16, with its row (a plain linear's grad_output)
        "torch grad cast": lambda: x.to(torch.bfloat16),
        "fused grad cast + row": lambda: branch_grad(x, torch.bfloat16, tgt()),
        "torch grad cast + row read apart": lambda: ts.rows([x.to(torch.bfloat16)], fmt="e5m2", center=[(0.0, 1.0)],
                                                             hist=False, out=rows, index=[1]),
    }
    for fn in fns.values():
        fn()
    t = device_medians(fns, rounds=5, calls=10)
    print(f"{name} residual fp32 + bf16 {tuple(x.shape)}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()),
          flush=True)


if __name__ == "__main__":
    main()
