"""Statistics taken by the kernels around a linear, on the CPU in Triton's interpreter: those that consume its output,
SwiGLU's fused elementwise kernels (trainer/kernels/swiglu.py), the fused residual add (trainer/kernels/residual.py)
and RoPE on the qkv output (trainer/kernels/rope.py), with SwiGLU's words path; and RMSNorm
(trainer/kernels/rmsnorm.py), which produces the input of llama's qkv and fc1. Each equals torch's
computation (forward and backward; SwiGLU's bf16 to the last place, rarely one unit off), its rows equal the fp64
oracle's (device_stats.partials), and a model or block watched by an agent gets from them the rows the linears or the
hooks took before, with no deferred read of those outputs.

The checks run in one child process that sets TRITON_INTERPRET=1 before importing Triton (tests/interpreter_child.py).
GPU: tests/trainer/test_gpu_kernels.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _child(names: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests"))
    from interpreter_child import emit, run_each
    import torch

    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.agent.stats import launch as ts
    from rowcheck import row_problems
    from fp8mon.trainer.kernels.swiglu import swiglu, swiglu_ref

    torch.set_num_threads(1)

    def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
        """The most units in the last place between two bf16 tensors of finite values."""
        ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
        ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude to a monotone integer order
        ib = torch.where(ib < 0, -32768 - ib, ib)
        return int((ia - ib).abs().max())

    def values():
        g = torch.Generator().manual_seed(0)
        for shape, dt in (((3, 70, 2 * 150), torch.bfloat16), ((40, 2 * 200), torch.float32), ((1, 2), torch.bfloat16)):
            yield (torch.randn(*shape, generator=g) * 3).to(dt), torch.randn(*shape[:-1], shape[-1] // 2, generator=g)

    def forward_backward():
        for y0, dh0 in values():
            name = f"forward_backward:{tuple(y0.shape)}:{y0.dtype}"
            dh = dh0.to(y0.dtype)
            y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
            h1, h2 = swiglu(y1), swiglu_ref(y2)
            h1.backward(dh)
            h2.backward(dh)
            problems = []
            for what, a, b in (("h", h1.detach(), h2.detach()), ("dy", y1.grad, y2.grad)):
                if a.shape != b.shape or a.dtype != b.dtype:
                    problems.append(f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
                elif a.dtype == torch.bfloat16:
                    far, off = ulps_apart(a, b), float((a != b).float().mean())
                    if far > 1 or off > 0.01:
                        problems.append(f"{what}: {far} ulps apart at most, {off:.3%} of elements differ")
                elif not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    problems.append(f"{what}: max difference {float((a - b).abs().max())}")
            emit(name, "; ".join(problems))

    def stats_values():
        """``values``, and y whose halves differ in mean (gate about 0, up about 5), and y holding a NaN (the careful
        path)."""
        yield from values()
        g = torch.Generator().manual_seed(4)
        y = torch.randn(50, 2 * 90, generator=g)
        y[:, 90:] += 5.0
        yield y.to(torch.bfloat16), None
        y = torch.randn(50, 2 * 90, generator=g)
        y[7, 3] = float("nan")
        yield y, None

    def forward_stats():
        """The rows the forward takes of y and of h equal the fp64 oracle's (``device_stats.partials``; a GEMM
        output's emulation: current scaling of the format, or no format); y's merged into on a second call."""
        for y0, _ in stats_values():
            for fmt, hist in (("e4m3", True), (None, False)):
                center = (0.0, 3.0)
                tgt = ts.Target.new("cpu", center=center, hist=hist, fmt=fmt)
                tgt_h = ts.Target.new("cpu", center=(0.0, 1.0), hist=hist, fmt=fmt)
                tgt.rows.fill_(float("nan"))  # overwritten (merge False), whatever it held
                h = swiglu(y0, stats=tgt, h_stats=tgt_h)
                ts.flush_deferred()  # on the words path (bf16 y) h's row waits for the next statistics launch
                want = ds.partials(y0, fmt=fmt, outlier_center=center, hist=hist)  # the fp64 oracle
                want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
                # current scaling's underflow comes from the histogram: exact up to the threshold's binade
                slack = (lambda row: float(row[ds.HIST:].nan_to_num(0).max()) if fmt else None)
                problems = [row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack(want)),
                            row_problems(tgt_h.rows[0], want_h, rtol=1e-6, under_slack=slack(want_h))]
                if not torch.equal(h.nan_to_num(7.0), swiglu(y0).nan_to_num(7.0)):
                    problems.append("h differs with statistics on")
                tgt.merge = True
                swiglu(y0 * 2, stats=tgt)
                ts.flush_deferred()  # the row is merged later (triton_stats.FUSED_MERGE)
                both = ds.merge(want, ds.partials(y0 * 2, fmt=fmt, outlier_center=center, hist=hist))
                problems.append(row_problems(tgt.rows[0], both, rtol=1e-6, under_slack=slack(both)))
                emit(f"forward_stats:{tuple(y0.shape)}:{y0.dtype}:{fmt}", "; ".join(p for p in problems if p))

    def backward_stats():
        """The row the backward takes of dy (fc1's grad_output) equals the fp64 oracle's, dy is the same as without it,
        and the target is asked for only when the backward runs; with a NaN in y (the careful path) too."""
        g = torch.Generator().manual_seed(5)
        for y0, dh0 in stats_values():
            dh0 = torch.randn(*y0.shape[:-1], y0.shape[-1] // 2, generator=g) if dh0 is None else dh0
            for fmt, hist in (("e5m2", True), (None, False)):
                tgt = ts.Target.new("cpu", center=(0.0, 1.0), hist=hist, fmt=fmt)
                asked = []
                y1, y2 = y0.clone().requires_grad_(), y0.clone().requires_grad_()
                h1 = swiglu(y1, dy_stats=lambda: asked.append(1) or tgt)
                problems = ["" if not asked else "the target was asked for in the forward"]
                h1.backward(dh0.to(y0.dtype))
                swiglu(y2).backward(dh0.to(y0.dtype))
                ts.flush_deferred()
                want = ds.partials(y1.grad, fmt=fmt, outlier_center=(0.0, 1.0), hist=hist)
                slack = float(want[ds.HIST:].nan_to_num(0).max()) if fmt else None
                problems.append(row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack))
                if not torch.equal(y1.grad.nan_to_num(7.0), y2.grad.nan_to_num(7.0)):
                    problems.append("dy differs with statistics on")
                emit(f"backward_stats:{tuple(y0.shape)}:{y0.dtype}:{fmt}", "; ".join(p for p in problems if p))

    from fp8mon.trainer.kernels.words import words_path

    def with_words(module, kernel: str, fn, switch: str = "WORDS"):
        """``fn()`` with ``module.<switch>`` on, and how many times ``module.<kernel>`` (its words kernel) launched."""
        launched, real = [], getattr(module, kernel)

        class Spy:
            def __getitem__(self, grid):
                launched.append(grid)
                return real[grid]

        setattr(module, kernel, Spy())
        try:
            with words_path(module, switch=switch):
                return fn(), len(launched)
        finally:
            setattr(module, kernel, real)

    def words():
        """y's row through y's 32-bit words (``swiglu.WORDS``; the histogram needs the GPU's shared-memory table, so
        here without it): the words kernel runs, h is the fp32 kernel's to the bit, and the row equals the fp64
        oracle's, on full tiles (the bf16x2 path), partial ones (fp32) and with a NaN (the careful path); h's row,
        deferred to the next statistics launch on this path, equals the oracle's after it, and so does h's row taken
        in the kernel from h's words (``WORDS_H``), which defers nothing."""
        import importlib

        sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")
        g = torch.Generator().manual_seed(12)
        deferred, real_defer = [], ts.defer
        for shape, nan in (((64, 2 * 256), False), ((3, 70, 2 * 150), False), ((50, 2 * 90), True)):
            y = (torch.randn(*shape, generator=g) * 3 + 1.0).to(torch.bfloat16)
            if nan:
                y[7, 3] = float("nan")
            for fmt, words_h in (("e4m3", False), (None, False), ("e4m3", True), (None, True)):
                tgt = ts.Target.new("cpu", center=(0.0, 3.0), hist=False, fmt=fmt)
                tgt_h = ts.Target.new("cpu", center=(0.0, 1.0), hist=False, fmt=fmt)
                deferred.clear()
                ts.defer = lambda x, target: deferred.append(target) or real_defer(x, target)
                try:
                    with words_path(sw, on=words_h, switch="WORDS_H"):
                        h, launched = with_words(sw, "_swiglu_fwd_words_kernel",
                                                 lambda: sw.swiglu(y, stats=tgt, h_stats=tgt_h))
                finally:
                    ts.defer = real_defer
                ts.flush_deferred()  # h's row: deferred on this path unless WORDS_H
                want = ds.partials(y, fmt=fmt, outlier_center=(0.0, 3.0), hist=False)
                want_h = ds.partials(h, fmt=fmt, outlier_center=(0.0, 1.0), hist=False)
                slack = (lambda row: float(row[ds.HIST:].nan_to_num(0).max()) if fmt else None)
                problems = [row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack(want)),
                            row_problems(tgt_h.rows[0], want_h, rtol=1e-6, under_slack=slack(want_h))]
                if not launched:
                    problems.append("the words kernel did not run")
                if any(t is tgt_h for t in deferred) == words_h:
                    problems.append(f"h's row {'was' if deferred else 'was not'} deferred")
                if not torch.equal(h.nan_to_num(7.0), swiglu(y).nan_to_num(7.0)):
                    problems.append("h differs from the fp32 kernel's")
                name = f"words:{tuple(y.shape)}:{fmt}{':words_h' if words_h else ''}"
                emit(name, "; ".join(p for p in problems if p))

    def words_row_problems(tgt, x, center, fmt, launched: int) -> list[str]:
        """The problems of ``tgt``'s row of ``x`` (no histogram) against the fp64 oracle's, and whether a words kernel
        launched."""
        ts.flush_deferred()  # the row is merged later (triton_stats.FUSED_MERGE)
        want = ds.partials(x, fmt=fmt, outlier_center=center, hist=False)
        slack = float(want[ds.HIST:].nan_to_num(0).max()) if fmt else None
        return [row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack),
                "" if launched else "the words kernel did not run"]

    def bwd_words():
        """dy's row through dy's words (``swiglu.BWD_WORDS``; without the histogram, as ``words``): the words kernel
        runs, dy is the fp32 kernel's to the bit, and the row equals the fp64 oracle's, on full tiles (the bf16x2
        path), partial ones (fp32) and with a NaN in y (the careful path)."""
        import importlib

        sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")
        g = torch.Generator().manual_seed(14)
        for shape, nan in (((64, 2 * 256), False), ((3, 70, 2 * 150), False), ((50, 2 * 90), True)):
            y = (torch.randn(*shape, generator=g) * 3 + 1.0).to(torch.bfloat16)
            dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(torch.bfloat16)
            if nan:
                y[7, 3] = float("nan")
            for fmt in ("e5m2", None):
                tgt = ts.Target.new("cpu", center=(0.0, 2.0), hist=False, fmt=fmt)
                dy, launched = with_words(sw, "_swiglu_bwd_words_kernel",
                                          lambda: sw.swiglu_backward(y, dh, stats=tgt), switch="BWD_WORDS")
                problems = words_row_problems(tgt, dy, (0.0, 2.0), fmt, launched)
                if not torch.equal(dy.nan_to_num(7.0), sw.swiglu_backward(y, dh).nan_to_num(7.0)):
                    problems.append("dy differs from the fp32 kernel's")
                emit(f"bwd_words:{tuple(y.shape)}:{fmt}", "; ".join(p for p in problems if p))

    def agent_block():
        """A SwiGLU block of FP8 linears watched by an agent, two steps of two micro-batches: with the fused kernel,
        fc1's output row comes from it (fc1's output is not deferred to a statistics read), and fc1's rows equal
        those without it (its input, weight and output are the same tensors either way; fc2's see h, which may
        differ in the last place)."""
        from rowcheck import agent_rows
        from fp8mon.trainer import fp8_linear, layers
        from fp8mon.trainer.fp8_linear import Fp8Linear

        got = {}
        for fused in (False, True):
            torch.manual_seed(7)
            old = layers.FUSED_SWIGLU, fp8_linear.OUTPUT_STATS
            layers.FUSED_SWIGLU, fp8_linear.OUTPUT_STATS = fused, "deferred"
            block = layers.SwiGLU(32, 48, lambda i, o: Fp8Linear(i, o))
            for m in block.modules():
                if isinstance(m, Fp8Linear):
                    m.backend = "triton"
            xs = [torch.randn(2, 8, 32) * (1 + i) for i in range(4)]
            deferred, real_defer = [], ts.defer
            ts.defer = lambda x, t: (deferred.append(x.shape[-1]), real_defer(x, t))
            try:
                rows, keys = agent_rows(block, lambda step, micro: xs[2 * step + micro], 2, "cpu", fused=True,
                                        stats_backend="triton")
            finally:
                (layers.FUSED_SWIGLU, fp8_linear.OUTPUT_STATS), ts.defer = old, real_defer
            got[fused] = rows, keys, deferred
        (plain, keys, d_plain), (fused_rows, keys2, d_fused) = got[False], got[True]
        problems = []
        if sorted(keys) != sorted(keys2):
            problems.append(f"slots {keys} vs {keys2}")
        # 2 steps x 2 micro-batches: fc1's (96 wide) and fc2's (32 wide) outputs deferred, then fc2's only
        if sorted(d_plain) != [32] * 4 + [96] * 4 or d_fused != [32] * 4:
            problems.append(f"deferred outputs {d_plain} without the kernel, {d_fused} with it")
        for step in range(2):
            for key in (("fc1", "input"), ("fc1", "weight"), ("fc1", "output")):
                if key in keys and key in keys2:
                    p = row_problems(fused_rows[step][keys2.index(key)], plain[step][keys.index(key)])
                    if p:
                        problems.append(f"step {step} {key}: {p}")
                else:
                    problems.append(f"no row {key}")
        emit("agent_block", "; ".join(problems))

    def rows_by_mode(flag: str, make_block, seed: int, inputs=None) -> dict:
        """``agent_rows`` of a block of plain linears with the flag (``trainer.layers.<flag>``, or ``module.FLAG``)
        off ("hooks"), on ("fused"), and on as on a device where Triton does not run ("block_torch"): two steps of two
        micro-batches of ``inputs(i)`` (default (2, 8, 32) floats)."""
        import importlib

        from rowcheck import agent_rows
        from fp8mon.trainer import layers, model

        module, _, flag = flag.rpartition(".")
        module = importlib.import_module(module) if module else layers
        inputs = inputs or (lambda i: torch.randn(2, 8, 32) * (1 + i))
        got = {}
        for mode in ("hooks", "fused", "block_torch"):
            torch.manual_seed(seed)
            old = getattr(module, flag), layers.triton_runs, model.triton_runs
            setattr(module, flag, mode != "hooks")
            if mode == "block_torch":
                layers.triton_runs = model.triton_runs = lambda device: False
            try:
                block = make_block()
                xs = [inputs(i) for i in range(4)]
                got[mode] = agent_rows(block, lambda step, micro: xs[2 * step + micro], 2, "cpu", fused=True,
                                       stats_backend="triton")
            finally:
                setattr(module, flag, old[0])
                layers.triton_runs, model.triton_runs = old[1], old[2]
        return got

    def same_rows_by_mode(got: dict, wanted: list, near: tuple = ()) -> list[str]:
        """Where the "fused" and "block_torch" rows of ``rows_by_mode`` differ from the hooks' at the slots
        ``wanted``, both steps (rtol 1e-6); at those also in ``near`` (a tensor that may differ in the last place),
        where the mean is more than 1% of the std off or the count differs."""
        problems = []
        want, keys = got["hooks"]
        for mode in ("fused", "block_torch"):
            rows, keys2 = got[mode]
            if sorted(keys2) != sorted(keys):
                problems.append(f"{mode}: slots {keys2} vs {keys}")
                continue
            for key in wanted:
                for step in range(2):
                    a, b = rows[step][keys2.index(key)].clone(), want[step][keys.index(key)]
                    if mode == "block_torch":  # the torch path counts outliers about the tensor's own mean and std
                        a[ds.OUTLIERS] = b[ds.OUTLIERS]
                    if key in near:
                        std = float(b[ds.M2] / b[ds.N]) ** 0.5
                        p = "" if abs(float(a[ds.MEAN] - b[ds.MEAN])) <= 1e-2 * std and \
                            float(a[ds.NUMEL]) == float(b[ds.NUMEL]) else f"mean {float(a[ds.MEAN])} vs {float(b[ds.MEAN])}"
                    else:  # current scaling's underflow: the Triton rows' from the histogram, exact up to the
                        # threshold's binade; the torch path's exact
                        p = row_problems(a, b, rtol=1e-6, under_slack=float(b[ds.HIST:].nan_to_num(0).max()))
                    if p:
                        problems.append(f"{mode} step {step} {key}: {p}")
        return problems

    def agent_block_plain():
        """The same with plain linears (no FP8): the hooks read neither fc1's output and grad_output nor fc2's input,
        the fused kernels' rows of them are the hooks' rows without them (fc2's input h and fc1's grad_output dy to the
        last place), and on a device without the kernels the block reports them itself."""
        from fp8mon.trainer import layers

        got = rows_by_mode("FUSED_SWIGLU", lambda: layers.SwiGLU(32, 48, lambda i, o: torch.nn.Linear(i, o, bias=False)),
                           7)
        near = (("fc2", "input"), ("fc1", "grad_output"))  # h and dy may differ in the last place
        problems = same_rows_by_mode(got, [("fc1", "output"), *near], near)
        emit("agent_block_plain", "; ".join(problems))

    def residual():
        """The fused add equals torch's x + b, values (one rounding) and gradients (b's cast by the kernel that takes
        its row), for an fp32 residual stream plus a bf16 branch and for two bf16 tensors; its rows of b and of b's
        gradient equal the fp64 oracle's, merged by a later launch and (the NaN case) by the kernels' last program."""
        from fp8mon.trainer.kernels.residual import residual_add, residual_add_ref

        g = torch.Generator().manual_seed(9)
        for xd, bd, nan in ((torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.bfloat16, False),
                            (torch.float32, torch.bfloat16, True)):
            x0 = torch.randn(3, 50, 70, generator=g).to(xd)
            b0 = (torch.randn(3, 50, 70, generator=g) * 4).to(bd)
            if nan:  # the careful path
                b0[1, 2, 3] = float("nan")
            dout = torch.randn(3, 50, 70, generator=g)
            x1, b1 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
            x2, b2 = x0.clone().requires_grad_(), b0.clone().requires_grad_()
            tgt = ts.Target.new("cpu", center=(0.0, 4.0), fmt="e4m3")
            tgt_g = ts.Target.new("cpu", center=(0.0, 1.0), fmt="e5m2")
            o1 = residual_add(x1, b1, stats=tgt, grad_stats=lambda: tgt_g)
            o1.backward(dout.to(o1.dtype))
            o2 = residual_add_ref(x2, b2)
            o2.backward(dout.to(o2.dtype))
            ts.flush_deferred()  # the rows are complete after the next flush
            problems = []
            if o1.dtype != o2.dtype or not torch.equal(o1.detach().nan_to_num(7.0), o2.detach().nan_to_num(7.0)):
                problems.append(f"sum differs ({o1.dtype} vs {o2.dtype})")
            if not (torch.equal(x1.grad, x2.grad) and torch.equal(b1.grad, b2.grad)):
                problems.append("gradients differ")
            want = ds.partials(b0, fmt="e4m3", outlier_center=(0.0, 4.0))
            problems.append(row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=float(want[ds.HIST:].max())))
            want_g = ds.partials(b2.grad, fmt="e5m2", outlier_center=(0.0, 1.0))
            problems.append(row_problems(tgt_g.rows[0], want_g, rtol=1e-6, under_slack=float(want_g[ds.HIST:].max())))
            emit(f"residual:{xd}+{bd}:nan={nan}", "; ".join(p for p in problems if p))

    def rope():
        """RoPE on the qkv output equals torch's (q, k, v and qkv's gradient, exactly here: the interpreter does not
        contract into FMAs), with a partial tile of positions and heads of 16 and 32; its rows of qkv and of qkv's
        gradient equal the fp64 oracle's, also with a NaN (the careful path), the first merged into by two more calls
        before the rows are merged (the first merge goes first)."""
        from fp8mon.trainer.kernels.rope import rope_qkv, rope_qkv_ref
        from fp8mon.trainer.layers import Rotary

        g = torch.Generator().manual_seed(11)
        for (b, t, nh, hd), dt, nan in (((2, 50, 2, 32), torch.bfloat16, False), ((1, 33, 3, 16), torch.float32, False),
                                        ((1, 40, 2, 32), torch.bfloat16, True)):
            rot = Rotary(hd, 64)
            qkv0 = (torch.randn(b, t, 3 * nh * hd, generator=g) * 2 + 0.5).to(dt)
            if nan:
                qkv0[0, 3, 5] = float("nan")
            grads = [torch.randn(b, nh, t, hd, generator=g).to(dt) for _ in range(3)]
            a, r = qkv0.clone().requires_grad_(), qkv0.clone().requires_grad_()
            tgt = ts.Target.new("cpu", center=(0.5, 2.0), hist=True, fmt="e4m3")
            tgt_g = ts.Target.new("cpu", center=(0.0, 1.0), hist=True, fmt="e5m2")
            got = rope_qkv(a, rot.cos, rot.sin, nh, stats=tgt, grad_stats=lambda: tgt_g)
            ref = rope_qkv_ref(r, rot.cos, rot.sin, nh)
            torch.autograd.backward(got, grads)
            torch.autograd.backward(ref, grads)
            ts.flush_deferred()
            problems = [f"{what} differs" for what, x, y in (("q", got[0], ref[0]), ("k", got[1], ref[1]),
                                                              ("v", got[2], ref[2]), ("dqkv", a.grad, r.grad))
                        if x.shape != y.shape or not torch.equal(x.detach().nan_to_num(7.0), y.detach().nan_to_num(7.0))]
            if not all(x.is_contiguous() for x in got):
                problems.append("q, k, v not contiguous")
            want = ds.partials(qkv0, fmt="e4m3", outlier_center=(0.5, 2.0), hist=True)
            slack = (lambda row: float(row[ds.HIST:].nan_to_num(0).max()))
            problems.append(row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack(want)))
            want_g = ds.partials(a.grad, fmt="e5m2", outlier_center=(0.0, 1.0), hist=True)
            problems.append(row_problems(tgt_g.rows[0], want_g, rtol=1e-6, under_slack=slack(want_g)))
            tgt.merge = True  # twice into the waiting row: the first merge goes first
            rope_qkv(qkv0 * 2, rot.cos, rot.sin, nh, stats=tgt)
            rope_qkv(qkv0 * 3, rot.cos, rot.sin, nh, stats=tgt)
            ts.flush_deferred()
            both = want
            for f in (2, 3):
                both = ds.merge(both, ds.partials(qkv0 * f, fmt="e4m3", outlier_center=(0.5, 2.0), hist=True))
            problems.append(row_problems(tgt.rows[0], both, rtol=1e-6, under_slack=slack(both)))
            emit(f"rope:{(b, t, nh, hd)}:{dt}:nan={nan}", "; ".join(p for p in problems if p))

    def attention_plain():
        """An attention block of plain linears watched by an agent: with the fused RoPE the hooks read neither qkv's
        output nor its grad_output, and the kernels' rows of them equal the hooks' rows without them; on a device
        without the kernels the block reports them itself."""
        emit("attention_plain", "; ".join(attention_rows("FUSED_ROPE", 5, [("attn.qkv", s)
                                                                           for s in ("output", "grad_output")])))

    def attention_rows(flag: str, seed: int, wanted: list) -> list[str]:
        """``same_rows_by_mode`` of an attention block of plain linears under ``flag`` (``rows_by_mode``)."""
        from fp8mon.trainer import layers

        rot = layers.Rotary(16, 16)

        class WithAttention(torch.nn.Module):  # agent_rows calls model(x)
            def __init__(self):
                super().__init__()
                self.attn = layers.Attention(32, 2, lambda i, o: torch.nn.Linear(i, o, bias=False), qk_norm=False)

            def forward(self, x):
                return self.attn(x, rot)

        return same_rows_by_mode(rows_by_mode(flag, WithAttention, seed), wanted)

    def heads():
        """The heads merged for the projection equal torch's copy (and its gradient, torch's), from the layout the
        attention returns and from a contiguous one, with a partial tile of positions; the row of the result equals
        the fp64 oracle's, also with a NaN (the careful path), merged into twice before the rows are merged."""
        from fp8mon.trainer.kernels import heads as hk
        from fp8mon.trainer.kernels.heads import merge_heads, merge_heads_ref

        old_tile, hk.STATS_TILE = hk.STATS_TILE, 256  # tiles of a few positions with the row: several a program
        try:
            heads_cases(merge_heads, merge_heads_ref)
        finally:
            hk.STATS_TILE = old_tile

    def heads_cases(merge_heads, merge_heads_ref):
        g = torch.Generator().manual_seed(12)
        slack = (lambda row: float(row[ds.HIST:].nan_to_num(0).max()))
        for (b, nh, t, hd), dt, bthd, nan, hist in (((2, 3, 50, 16), torch.bfloat16, True, False, True),
                                                    ((2, 3, 50, 16), torch.bfloat16, True, False, False),
                                                    ((1, 2, 33, 32), torch.float32, False, False, True),
                                                    ((2, 2, 40, 8), torch.bfloat16, True, True, True),
                                                    ((2, 2, 40, 8), torch.bfloat16, False, True, False)):
            y0 = (torch.randn(b, t, nh, hd, generator=g) * 2 + 0.5).to(dt)
            y0 = y0.transpose(1, 2) if bthd else y0.transpose(1, 2).contiguous()
            if nan:
                y0[1, 0, 3, 5] = float("nan")
            a, r = y0.clone().requires_grad_(), y0.clone().requires_grad_()  # (clone keeps the strides)
            tgt = ts.Target.new("cpu", center=(0.5, 2.0), hist=hist, fmt="e4m3")
            got, ref = merge_heads(a, stats=tgt), merge_heads_ref(r)
            grad = torch.randn(b, t, nh * hd, generator=g).to(dt)
            got.backward(grad)
            ref.backward(grad)
            ts.flush_deferred()
            pairs = (("out", got.detach(), ref.detach()), ("grad", a.grad, r.grad))
            problems = [f"{what} differs" for what, x, y in pairs
                        if x.shape != y.shape or not torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))]
            if not got.is_contiguous():
                problems.append("the result is not contiguous")
            want = ds.partials(ref.detach(), fmt="e4m3", outlier_center=(0.5, 2.0), hist=hist)
            problems.append(row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack(want)))
            tgt.merge = True  # twice into the waiting row: the first merge goes first
            merge_heads(y0 * 2, stats=tgt)
            merge_heads(y0 * 3, stats=tgt)
            ts.flush_deferred()
            both = want
            for f in (2, 3):
                both = ds.merge(both, ds.partials(merge_heads_ref(y0 * f), fmt="e4m3", outlier_center=(0.5, 2.0),
                                                  hist=hist))
            problems.append(row_problems(tgt.rows[0], both, rtol=1e-6, under_slack=slack(both)))
            emit(f"heads:{(b, nh, t, hd)}:{dt}:bthd={bthd}:nan={nan}:hist={hist}", "; ".join(p for p in problems if p))

    def heads_plain():
        """An attention block of plain linears watched by an agent: with the heads' kernel taking the projection input's
        row (``HEADS_ROW``) the hooks read none, and the kernel's rows equal the hooks' rows without it; on a device
        without the kernel the block reports it itself."""
        emit("heads_plain", "; ".join(attention_rows("HEADS_ROW", 6, [("attn.proj", "input")])))

    def residual_plain():
        """A one-block llama of plain linears (no FP8) watched by an agent: with the fused residual adds the hooks
        read neither proj's nor fc2's output and grad_output, and the kernels' rows of them equal the hooks' rows
        without them; on a device without the kernels the block reports them itself."""
        from fp8mon.trainer import layers, model
        from fp8mon.trainer.config import get_config

        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64)
        old = layers.FUSED_SWIGLU, layers.FUSED_ROPE, layers.FUSED_NORM
        layers.FUSED_SWIGLU = layers.FUSED_ROPE = layers.FUSED_NORM = False  # torch's ops in every mode: the adds alone
        try:
            got = rows_by_mode("fp8mon.trainer.model.FUSED_RESIDUAL", lambda: model.Transformer(cfg, "llama", "fp32"), 6,
                               inputs=lambda i: torch.randint(0, 64, (2, 8)))
        finally:
            layers.FUSED_SWIGLU, layers.FUSED_ROPE, layers.FUSED_NORM = old
        keys = [(f"blocks.0.{n}", s) for n in ("attn.proj", "mlp.fc2") for s in ("output", "grad_output")]
        emit("residual_plain", "; ".join(same_rows_by_mode(got, keys)))

    def rmsnorm():
        """The RMSNorm kernels equal torch's ops (``rms_norm_torch``: y, x's and the weight's gradients, to a few units
        in the last place: the sum of squares goes in another order), for fp32 and bf16 rows, widths that are and are
        not a power of two, a partial last tile and a frozen weight; the row of y equals the fp64 oracle's of y as
        returned, merged later, with a NaN by the careful path, and merged into by a second call."""
        from fp8mon.trainer.kernels.rmsnorm import rms_norm, rms_norm_ref

        g = torch.Generator().manual_seed(13)
        # widths 48, 40 and 96 are cut into 3, 5 and 3 chunks (``rmsnorm.CHUNKS``), over full tiles and a partial last
        # one
        for shape, dt, nan, learn, hist in (((3, 50, 48), torch.float32, False, True, True),
                                            ((7, 64), torch.bfloat16, False, True, True),
                                            ((7, 64), torch.bfloat16, False, True, False),
                                            ((300, 40), torch.float32, True, False, True),
                                            ((5, 3, 96), torch.bfloat16, True, True, True),
                                            ((2, 40, 96), torch.bfloat16, False, True, False),
                                            ((2, 40, 96), torch.bfloat16, True, False, False),
                                            ((2, 40, 96), torch.bfloat16, False, False, True)):
            x0 = (torch.randn(*shape, generator=g) * 3 + 0.5).to(dt)
            if nan:
                x0.view(-1)[17] = float("nan")
            w0 = torch.randn(shape[-1], generator=g) + 1.0
            gy = torch.randn(*shape, generator=g).to(dt)
            (x1, w1), (x2, w2) = [(x0.clone().requires_grad_(), w0.clone().requires_grad_(learn)) for _ in range(2)]
            tgt = ts.Target.new("cpu", center=(0.5, 3.0), fmt="e4m3", hist=hist)
            y1, y2 = rms_norm(x1, w1, 1e-6, stats=tgt), rms_norm_ref(x2, w2, 1e-6)
            y1.backward(gy)
            y2.backward(gy)
            ts.flush_deferred()  # the row is merged later (triton_stats.FUSED_MERGE)
            problems = []
            tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            for what, a, b in (("y", y1.detach(), y2.detach()), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad)):
                if a is None or b is None:
                    if (a is None) != (b is None) or learn:
                        problems.append(f"{what}: {a is None} vs {b is None}")
                elif a.dtype != b.dtype or not torch.allclose(a.float(), b.float(), equal_nan=True, **tol):
                    problems.append(f"{what} ({a.dtype} vs {b.dtype}): max difference {float((a - b).abs().max())}")
            want = ds.partials(y1.detach(), fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist)
            slack = (lambda row: float(row[ds.HIST:].nan_to_num(0).max()))
            problems.append(row_problems(tgt.rows[0], want, rtol=1e-6, under_slack=slack(want)))
            tgt.merge = True
            y3 = rms_norm(x0 * 2, w0, 1e-6, stats=tgt)
            ts.flush_deferred()
            both = ds.merge(want, ds.partials(y3, fmt="e4m3", outlier_center=(0.5, 3.0), hist=hist))
            problems.append(row_problems(tgt.rows[0], both, rtol=1e-6, under_slack=slack(both)))
            emit(f"rmsnorm:{shape}:{dt}:nan={nan}:hist={hist}", "; ".join(p for p in problems if p))

    def norm_plain():
        """A one-block llama of plain linears watched by an agent: with the fused pre-norms the hooks read neither
        qkv's nor fc1's input, and the norm kernels' rows of them equal the hooks' rows without them; on a device
        without the kernels the block reports them itself."""
        from fp8mon.trainer import layers, model
        from fp8mon.trainer.config import get_config

        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64)
        got = rows_by_mode("FUSED_NORM", lambda: model.Transformer(cfg, "llama", "fp32"), 8,
                           inputs=lambda i: torch.randint(0, 64, (2, 8)))
        # the norms' y may differ in the last place from torch's, and the inputs of later linears with them
        near = tuple((f"blocks.0.{n}", "input") for n in ("attn.qkv", "mlp.fc1"))
        emit("norm_plain", "; ".join(same_rows_by_mode(got, list(near), near)))

    def weight_plain():
        """A one-block bf16 llama under autocast watched by an agent: with ``FUSED_WEIGHT`` each linear's cast of its
        weight takes the weight's row (the hooks read no weight), equal to the hooks' rows of the fp32 weights without
        it; on a device without the kernels the linears report them apart. (FOG's linears come from the same
        factory.)"""
        from fp8mon.trainer import layers, model
        from fp8mon.trainer.config import get_config

        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64)

        class Autocast(torch.nn.Module):
            def __init__(self, arch):
                super().__init__()
                self.net = model.Transformer(cfg, arch, "bf16")

            def forward(self, idx):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return self.net(idx)

        from fp8mon.trainer.kernels import weight_casts as casts_module

        old = layers.FUSED_SWIGLU, layers.FUSED_ROPE, layers.FUSED_NORM, model.FUSED_RESIDUAL
        # torch's ops around the linears in every mode: the interpreter runs the weights' casts alone
        layers.FUSED_SWIGLU = layers.FUSED_ROPE = layers.FUSED_NORM = model.FUSED_RESIDUAL = False
        batches, one_launch = [], casts_module.casts_with_rows
        casts_module.casts_with_rows = lambda xs, *a: (batches.append((xs[0].dtype, len(xs))), one_launch(xs, *a))[1]
        try:
            got = rows_by_mode("FUSED_WEIGHT", lambda: Autocast("llama"), 9, inputs=lambda i: torch.randint(0, 64, (2, 8)))
            names = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
            keys = [(f"net.blocks.0.{n}", s) for n in names for s in ("weight", "grad_weight")]
            emit("weight_plain", "; ".join(same_rows_by_mode(got, keys)))
            # the first step registers the linears one by one; the second casts the four weights in one launch, and
            # their gradients back in one (the first micro-batch's: a later one's are added to them)
            forward = [n for dt, n in batches if dt == torch.float32]
            backward = [n for dt, n in batches if dt == torch.bfloat16]
            emit("weight_plain:one_launch", "" if forward == backward == [1, 1, 1, 1, 4] else
                 f"launches of {forward} weights and {backward} gradients")
            emit("weight_plain:one_micro_batch", "; ".join(grad_rows_from_casts(Autocast, names, batches)))
            emit("weight_plain:cast", "; ".join(weight_cast_values()))
            emit("weight_plain:casts", "; ".join(weight_casts_values(one_launch)))
        finally:
            layers.FUSED_SWIGLU, layers.FUSED_ROPE, layers.FUSED_NORM, model.FUSED_RESIDUAL = old
            casts_module.casts_with_rows = one_launch

    def weight_casts_values(casts_with_rows) -> list[str]:
        """``casts_with_rows`` of tensors of several sizes in one launch (one with a NaN: the careful path), fp32 to
        bf16 (weights) and bf16 to fp32 (their gradients), equal torch's casts, and each row the fp64 oracle's of the
        values, about its own center (given, on the device, none)."""
        problems, g = [], torch.Generator().manual_seed(3)
        ws = [torch.randn(48, 32, generator=g) * 0.02 + 0.003, torch.randn(3000, generator=g),
              torch.randn(5, generator=g) * 7, torch.randn(2500, generator=g)]
        ws[3][1234] = float("nan")
        centers = [(0.0, 0.02), torch.tensor([0.0, 1.0], dtype=torch.float64), None, (0.1, 1.0)]
        for xs, dtype in ((ws, torch.bfloat16), ([w.to(torch.bfloat16) for w in ws], torch.float32)):
            rows = torch.zeros(len(xs), ds.WIDTH, dtype=torch.float64)
            casts = casts_with_rows(xs, dtype, [ts.Target(rows, i, False, c, 6.0, True, None, "e4m3")
                                                for i, c in enumerate(centers)])
            ts.flush_deferred()
            for i, (x, c, xc) in enumerate(zip(xs, centers, casts)):
                if not (xc.dtype == dtype and torch.equal(xc.float().nan_to_num(9), x.to(dtype).float().nan_to_num(9))):
                    problems.append(f"{x.dtype} {i}: values differ from torch's cast")
                c = tuple(c.tolist()) if isinstance(c, torch.Tensor) else c
                want = ds.partials(x, fmt="e4m3", outlier_center=c)
                problems.append(row_problems(rows[i], want, rtol=1e-6,
                                             under_slack=float(want[ds.HIST:].nan_to_num(0).max())))
        return [p for p in problems if p]

    def weight_cast_values() -> list[str]:
        """``weight_cast`` equals ``w.to(bf16)`` (its gradient ``g.float()``), with w's own row (the fp64 oracle's of
        the fp32 values, not the cast's), also across a partial last block."""
        from fp8mon.trainer.kernels.residual import weight_cast

        problems, g = [], torch.Generator().manual_seed(21)
        for shape in ((48, 32), (3000,)):
            w0 = torch.randn(*shape, generator=g) * 0.02 + 0.003
            w = w0.clone().requires_grad_()
            tgt = ts.Target.new("cpu", center=(0.0, 0.02), fmt="e4m3")
            wb = weight_cast(w, torch.bfloat16, tgt)
            gy = torch.randn(*shape, generator=g).to(torch.bfloat16)
            wb.backward(gy)
            ts.flush_deferred()
            if not (wb.dtype == torch.bfloat16 and torch.equal(wb.detach(), w0.to(torch.bfloat16))
                    and torch.equal(w.grad, gy.float())):
                problems.append(f"{shape}: values differ from torch's casts")
            want = ds.partials(w0, fmt="e4m3", outlier_center=(0.0, 0.02))
            problems.append(row_problems(tgt.rows[0], want, rtol=1e-6,
                                         under_slack=float(want[ds.HIST:].nan_to_num(0).max())))
        return [p for p in problems if p]

    def grad_rows_from_casts(make, names, batches: list) -> list[str]:
        """One micro-batch a step: the casts back take the weights' gradient rows (no grad_weight hook reads one), equal
        to the hooks' rows without them, and clipping gets every block gradient's norm from them; with the gradients
        cast back together (one launch at the end of the backward pass), and each as it comes with the batch left to
        the weights of at most 2000 elements (proj's and fc2's: qkv and fc1 cast their own). ``batches``: (dtype,
        tensors) of each ``casts_with_rows`` launch, as they come."""
        from fp8mon.agent import Agent
        from rowcheck import NullTransport
        from fp8mon.trainer import layers, weight_rows

        problems, got = [], {}
        idx = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        launches = {"1": ([1, 1, 1, 1, 4], [1, 1, 1, 1, 4]), "0": ([1, 1, 2], [])}  # (weights, gradients) per launch
        for fused, together in ((False, "auto"), (True, "1"), (True, "0")):
            old, layers.FUSED_WEIGHT = layers.FUSED_WEIGHT, fused
            old_together, weight_rows.GRADS_TOGETHER = weight_rows.GRADS_TOGETHER, together
            old_most = weight_rows.BATCH_MAX_ELEMENTS
            weight_rows.BATCH_MAX_ELEMENTS = 2000 if together == "0" else old_most
            batches.clear()
            try:
                torch.manual_seed(9)
                net = make("llama")
                agent = Agent(transport=NullTransport(), every=1, hist_every=1, stats_backend="triton").watch(net)
                read, shipped = [], []
                agent._sink.observe_after_backward = lambda layer, site, p, real=agent._sink.observe_after_backward: (
                    read.append(layer), real(layer, site, p))
                agent._ship = lambda step, rows, values: shipped.append(rows.clone())
                for step in range(2):
                    net.zero_grad(set_to_none=True)
                    net(idx[step]).float().square().mean().backward()
                    grads = [m.weight.grad for n, m in net.named_modules() if n.endswith(names)]
                    norm, covered = agent.grad_sq_norms(grads)
                    want = sum(float(g.double().square().sum()) for g in grads)
                    if fused and (not all(covered) or abs(float(norm) - want) > 1e-6 * want):
                        problems.append(f"clipping's norms: covered {covered}, {norm} vs {want}")
                    agent.log(step)
                keys = list(agent._slots.keys)
                agent.close()
            finally:
                layers.FUSED_WEIGHT, weight_rows.GRADS_TOGETHER = old, old_together
                weight_rows.BATCH_MAX_ELEMENTS = old_most
            got[fused, together] = shipped, keys, sorted(set(r for r in read if r.startswith("net.blocks")))
            seen = ([n for dt, n in batches if dt == torch.float32], [n for dt, n in batches if dt == torch.bfloat16])
            if fused and seen != launches[together]:
                problems.append(f"GRADS_TOGETHER={together}: launches of {seen[0]} weights and {seen[1]} gradients")
        want_rows, keys, read_plain = got[False, "auto"]
        for together in ("1", "0"):
            rows, keys2, read_fused = got[True, together]
            if read_fused or len(read_plain) != len(names):
                problems.append(f"grad_weight hooks read {read_fused} with the casts ({together}), {read_plain} without")
            for step in range(2):
                for key in [(f"net.blocks.0.{n}", "grad_weight") for n in names]:
                    p = row_problems(rows[step][keys2.index(key)], want_rows[step][keys.index(key)], rtol=1e-6)
                    if p:
                        problems.append(f"GRADS_TOGETHER={together} step {step} {key}: {p}")
        return problems

    def agent_model():
        """A one-block FP8 llama watched by an agent: with the fused consumers on, the rows of qkv's, fc1's, proj's
        and fc2's outputs come from them (no output is deferred to a statistics read), and equal the rows the
        linears take without them (those outputs are the same tensors either way: the first step's only, as later
        inputs pass through h, which may differ in the last place)."""
        from rowcheck import agent_rows
        from fp8mon.trainer import fp8_linear, layers, model
        from fp8mon.trainer.config import get_config
        from fp8mon.trainer.fp8_linear import Fp8Linear

        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=48, seq_len=8, vocab_size=64)
        got = {}
        for fused in (False, True):
            old = (layers.FUSED_SWIGLU, layers.FUSED_ROPE, model.FUSED_RESIDUAL, fp8_linear.OUTPUT_STATS, ts.defer,
                   layers.HEADS_ROW)
            deferred = []
            layers.FUSED_SWIGLU = layers.FUSED_ROPE = model.FUSED_RESIDUAL = layers.HEADS_ROW = fused
            fp8_linear.OUTPUT_STATS = "deferred"
            ts.defer = lambda x, t, real=ts.defer: (deferred.append(x.shape[-1]), real(x, t))
            try:
                torch.manual_seed(3)
                net = model.Transformer(cfg, "llama", "fp8")
                for m in net.modules():
                    if isinstance(m, Fp8Linear):
                        m.backend = "triton"
                idx = [torch.randint(0, 64, (2, 8)) for _ in range(4)]
                got[fused] = agent_rows(net, lambda step, micro: idx[2 * step + micro], 1, "cpu", fused=True,
                                        stats_backend="triton", modules=r"^blocks\.") + (deferred,)
            finally:
                (layers.FUSED_SWIGLU, layers.FUSED_ROPE, model.FUSED_RESIDUAL, fp8_linear.OUTPUT_STATS, ts.defer,
                 layers.HEADS_ROW) = old
        (plain, keys, d_plain), (rows, keys2, d_fused) = got[False], got[True]
        problems = []
        if sorted(keys) != sorted(keys2):
            problems.append(f"slots {keys2} vs {keys}")
        # one step of two micro-batches: qkv (96 wide), proj (32), fc1 (96), fc2 (32) deferred, then none
        if sorted(d_plain) != [32] * 4 + [96] * 4 or d_fused:
            problems.append(f"deferred outputs {d_plain} without the fused consumers, {d_fused} with them")
        for name in ("blocks.0.attn.qkv", "blocks.0.mlp.fc1"):  # the outputs fed by the same inputs either way
            key = (name, "output")
            if key in keys and key in keys2:
                p = row_problems(rows[0][keys2.index(key)], plain[0][keys.index(key)])
                if p:
                    problems.append(f"{key}: {p}")
            else:
                problems.append(f"no row {key}")
        for key in [(name, "output") for name in ("blocks.0.attn.proj", "blocks.0.mlp.fc2", "blocks.0.attn.qkv")] + \
                [("blocks.0.attn.proj", "input")]:  # (the heads' kernel leaves an FP8 projection's input to its cast)
            if key not in keys2 or float(rows[0][keys2.index(key)][ds.PARTS]) != 2:
                problems.append(f"{key}: not taken once from each of the two micro-batches")
        emit("agent_model", "; ".join(problems))

    def row_shapes():
        """The residual, RoPE and RMSNorm groups again, with their row kernels in the other shape their knobs offer
        (programs of 8 warps for the residual kernels, ``STATS_BLOCK``/``STATS_WARPS``, and RMSNorm, ``STATS_TILE``/
        ``STATS_WARPS``; of 4 for RoPE, ``STATS_BT``), so that a change of their defaults finds that shape checked."""
        from bench.variants import applied, parse

        nonlocal emit
        plain_emit = emit
        emit = lambda name, problem: plain_emit(f"row_shapes:{name}", problem)  # noqa: E731
        settings = ", ".join(f"fp8mon.trainer.kernels.{m}.{a}={v}" for m, a, v in (
            ("residual", "STATS_BLOCK", 2048), ("residual", "STATS_WARPS", 8), ("residual", "STATS_PROGRAMS_PER_SM", 2),
            ("rope", "STATS_BT", 16), ("rope", "STATS_PROGRAMS_PER_SM", 4), ("rmsnorm", "STATS_TILE", 4096),
            ("rmsnorm", "STATS_WARPS", 8), ("rmsnorm", "STATS_PROGRAMS_PER_SM", 2)))
        try:
            with applied(parse(settings)):
                residual()
                rope()
                rmsnorm()
        finally:
            emit = plain_emit

    checks = dict(forward_backward=forward_backward, forward_stats=forward_stats, words=words, agent_block=agent_block,
                  agent_block_plain=agent_block_plain, residual=residual, rope=rope, bwd_words=bwd_words,
                  backward_stats=backward_stats,
                  attention_plain=attention_plain, residual_plain=residual_plain, rmsnorm=rmsnorm,
                  norm_plain=norm_plain, weight_plain=weight_plain, agent_model=agent_model, heads=heads,
                  heads_plain=heads_plain, row_shapes=row_shapes)
    run_each(checks, names)


GROUPS = ["forward_backward", "forward_stats", "backward_stats", "words", "agent_block", "agent_block_plain",
          "bwd_words", "residual", "rope", "attention_plain", "residual_plain", "rmsnorm", "norm_plain", "weight_plain",
          "agent_model", "heads", "heads_plain", "row_shapes"]


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreter_child import run_checks

    return run_checks(__file__, GROUPS)


# The module's checks run in one interpreter child per CPU the worker may take: one under CI's two workers on two
# CPUs. It fit pytest's 300 s default on earlier sessions' machines and took 7.5 minutes on a slower one (2026-11-27),
# so this test's limit is the child's own (interpreter_child.run_checks).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", GROUPS)
def test_consumer_statistics(results, group):
    from interpreter_child import assert_group

    assert_group(results, group)


def test_rms_norm_refuses_what_its_kernels_cannot_take_and_the_module_falls_back_to_torch():
    """rms_norm names what it needs (a non-contiguous x, a weight of another width, no rows); trainer.layers.RMSNorm
    gives torch's result for such an x instead of calling it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fp8mon.trainer.kernels.rmsnorm import rms_norm
    from fp8mon.trainer.layers import RMSNorm, rms_norm_torch

    for x, w in ((torch.randn(6, 4).t(), torch.ones(6)), (torch.randn(4, 6), torch.ones(5)),
                 (torch.zeros(0, 6), torch.ones(6))):
        with pytest.raises(ValueError, match="needs contiguous float rows"):
            rms_norm(x, w, 1e-6)
    norm = RMSNorm(6)
    x = torch.randn(6, 4).t()
    assert not norm.fused(x) and torch.equal(norm(x), rms_norm_torch(x, norm.weight, norm.eps))


def test_casts_with_rows_names_the_tensors_it_cannot_take_and_launches_nothing():
    """A tensor that is not contiguous, 16-byte aligned, non-empty and of one floating dtype with the others, or targets
    that do not share one row buffer: a clear error before any launch (the batch of ``trainer.weight_rows`` leaves
    such weights to their own casts)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fp8mon.agent.stats import launch as ts
    from fp8mon.trainer.kernels.weight_casts import castable, casts_with_rows, weight_casts

    target = ts.Target.new("cpu", fmt="e4m3")
    flat = torch.randn(1001)
    for x in (torch.randn(6, 4).t(), flat[1:], torch.zeros(0, 4), torch.randn(6, 4, dtype=torch.float64)):
        assert not castable(x)
        with pytest.raises(ValueError, match="needs contiguous, non-empty, 16-byte aligned tensors of one floating"):
            casts_with_rows([torch.randn(6, 4), x], torch.bfloat16, [target, target])
    with pytest.raises(ValueError, match="of one floating dtype"):
        casts_with_rows([torch.randn(6, 4), torch.randn(6, 4).bfloat16()], torch.bfloat16, [target, target])
    with pytest.raises(ValueError, match="must share rows"):
        casts_with_rows([torch.randn(6, 4)] * 2, torch.bfloat16, [target, ts.Target.new("cpu", fmt="e4m3")])
    with pytest.raises(ValueError, match="casts to fp32, bf16 or fp16"):
        casts_with_rows([torch.randn(6, 4)], torch.float64, [target])
    with pytest.raises(ValueError, match="casts fp32 weights"):
        weight_casts([torch.randn(6, 4).bfloat16()], torch.float16, [target], [None])
    assert not target.rows.any()


if __name__ == "__main__":
    _child(sys.argv[1:])
