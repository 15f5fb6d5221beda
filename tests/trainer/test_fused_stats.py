"""Statistics fused into the trainer's quantize kernels, on the CPU in Triton's interpreter: the row that
``quantize``/``quantize_transpose`` write with ``stats=`` equals the standalone kernel's row
(``agent.triton_stats``) and the torch path's (``quantize.stats_ref``) with the scale actually used, the FP8
data is bit-identical with and without statistics, and an agent watching ``Fp8Linear`` layers reports the
same rows from the fused kernels as from its own hooks (no hook reads input, weight or grad_output).

As in tests/trainer/test_kernels.py the checks run in one child process that sets TRITON_INTERPRET=1
before importing Triton; each prints a JSON line that the tests assert. GPU: tests/trainer/test_gpu_kernels.py.
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
    from fp8mon.trainer.kernels import quantize, quantize_transpose
    from fp8mon.trainer.kernels.quantize import stats_ref

    qt_module = sys.modules[quantize_transpose.__module__]

    def kernels(delayed):
        """(name, function) of the fused kernels; quantize_transpose under current scaling once per way its row is
        made (``CURRENT_STATS``: the standalone kernel in place of the amax pass, or the cast's statistics variant)."""
        def with_mode(mode):
            def fn(*args, **kw):
                old, qt_module.CURRENT_STATS = qt_module.CURRENT_STATS, mode
                try:
                    return quantize_transpose(*args, **kw)
                finally:
                    qt_module.CURRENT_STATS = old
            return fn

        yield "quantize", quantize
        yield "quantize_transpose", with_mode("row")
        if not delayed:
            yield "quantize_transpose_cast", with_mode("cast")

    torch.set_num_threads(1)

    def same_bits(a, b):
        return a is None and b is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def fused_kernels():
        g = torch.Generator().manual_seed(0)
        for (m, n) in ((130, 70), (1, 3)):
            for dt, fmt in ((torch.bfloat16, "e4m3"), (torch.float32, "e5m2")):
                x = (torch.randn(m, n, generator=g) * 3).to(dt)
                if m > 2:
                    x[1, 2] = float("nan")
                    x[2, 1] = 0.0
                for delayed in (False, True):
                    scale = torch.tensor(7.0) if delayed else None
                    center = torch.tensor([0.1, 2.0], dtype=torch.float64)
                    for kernel, fn in kernels(delayed):
                        acc = lambda: torch.zeros(()) if delayed else None  # noqa: E731
                        tgt = ts.Target.new("cpu", center=center, amax_history_max=torch.tensor(1.5) if delayed else None)
                        tgt.rows.fill_(float("nan"))  # a row not merged into is overwritten, whatever it held
                        r = fn(x, fmt, scale=scale, accum=acc(), stats=tgt)
                        plain = fn(x, fmt, scale=scale, accum=acc())
                        name = f"fused_kernels:{kernel}:{m}x{n}:{fmt}:delayed={delayed}"
                        problems = []
                        if not (same_bits(r.data, plain.data) and same_bits(r.data_t, plain.data_t)
                                and torch.equal(r.meta[int(delayed):], plain.meta[int(delayed):])):
                            problems.append("FP8 data or scale differ with stats on")
                        ts.flush_deferred()  # a current-scaled cast's row is merged later
                        standalone = ts.partials(x, fmt=fmt, scale=r.scale, center=center,
                                                 amax_history_max=tgt.amax_history_max)
                        problems.append(row_problems(tgt.rows[0], standalone, rtol=1e-6))
                        ref = ts.Target.new("cpu", center=(0.1, 2.0), amax_history_max=tgt.amax_history_max)
                        problems.append(row_problems(tgt.rows[0], stats_ref(x, fmt, r.scale, ref)))
                        emit(name, "; ".join(p for p in problems if p))

    def fused_fast_path():
        """Finite inputs (the fast path, which ``fused_kernels``' NaN sends to the careful one), with and without
        the histogram: zeros, underflows, overflows (a stale delayed scale) and outliers, on full and edge tiles."""
        g = torch.Generator().manual_seed(1)
        for dt, fmt in ((torch.bfloat16, "e4m3"), (torch.float32, "e5m2")):
            x = torch.randn(130, 260, generator=g) * 3 + 0.5
            x[::7, ::5] = 0.0
            x[3, :40] = 1e-10  # below half the smallest subnormal at every scale used: underflows
            x[5, 7] = 40.0  # an outlier
            x = x.to(dt)
            for delayed in (False, True):
                scale = torch.tensor(20.0 if fmt == "e4m3" else 6000.0) if delayed else None  # stale: overflows
                for hist in (True, False):
                    for kernel, fn in kernels(delayed):
                        acc = torch.zeros(()) if delayed else None
                        tgt = ts.Target.new("cpu", center=(0.5, 3.0), hist=hist)
                        r = fn(x, fmt, scale=scale, accum=acc, stats=tgt)
                        ref = stats_ref(x, fmt, r.scale, ts.Target.new("cpu", center=(0.5, 3.0), hist=hist))
                        ts.flush_deferred()
                        got = tgt.rows[0]
                        problems = [row_problems(got, ref)]
                        counts = {k: float(ref[i]) for k, i in (("zeros", ds.ZEROS), ("under", ds.UNDERFLOW),
                                                                ("over", ds.OVERFLOW), ("outliers", ds.OUTLIERS))}
                        if not all(counts[k] > 0 for k in ("zeros", "outliers")) or not counts["under"] > 0 or \
                                (delayed and not counts["over"] > 0):
                            problems.append(f"the input does not exercise every count: {counts}")
                        if delayed and float(acc) != float(x.float().abs().max()):
                            problems.append(f"amax accumulator {float(acc)} != {float(x.float().abs().max())}")
                        emit(f"fused_fast_path:{kernel}:{fmt}:delayed={delayed}:hist={hist}",
                             "; ".join(p for p in problems if p))

    def fused_merge():
        """A second call into the same row merges (micro-batches), as device_stats.merge does."""
        x1, x2 = torch.randn(40, 60), torch.randn(40, 60) * 5 + 1
        x2[0, :5] = 1e-9  # underflows at x2's scale: the cast's count adds to the merged row
        for kernel, fn in kernels(False):
            if kernel == "quantize":
                continue
            tgt = ts.Target.new("cpu")
            r1 = fn(x1, "e4m3", stats=tgt)
            tgt.merge = True
            r2 = fn(x2, "e4m3", stats=tgt)
            want = ds.merge(ts.partials(x1, fmt="e4m3", scale=r1.scale), ts.partials(x2, fmt="e4m3", scale=r2.scale))
            ts.flush_deferred()  # (the second call merged the first's row before its own launch)
            problem = row_problems(tgt.rows[0], want)
            if not float(want[ds.UNDERFLOW]) >= 5:
                problem += f" underflow {float(want[ds.UNDERFLOW])}: the input does not exercise the merged count"
            emit(f"fused_merge:{kernel}", problem)

    def agent_hooks(model):
        from fp8mon.agent import Agent
        from rowcheck import NullTransport

        agent = Agent(transport=NullTransport(), every=1).watch(model)
        layers = list(agent._layers)
        agent.close()
        return layers

    def fp8_linear_agent(output_stats: str = "epilogue"):
        # output_stats: how Fp8Linear takes the output row (its GEMM's epilogue, or a read of the result); the
        # agent's rows must be the hooks' rows either way
        sys.path.insert(0, str(ROOT / "tests"))
        from rowcheck import agent_rows
        from fp8mon.trainer import fp8_linear
        from fp8mon.trainer.fp8_linear import Fp8Linear

        name = "fp8_linear_agent" + ("" if output_stats == "epilogue" else f"_{output_stats}")

        torch.manual_seed(4)
        model = torch.nn.Sequential(Fp8Linear(32, 64), torch.nn.GELU(), Fp8Linear(64, 32))
        for m in model:
            if isinstance(m, Fp8Linear):
                m.backend = "triton"  # the Triton kernels, in the interpreter
        state = {k: v.clone() for k, v in model.state_dict().items()}
        # two steps of two micro-batches: step 0 without outlier centers, step 1 with step 0's; the micro-batches
        # merge into one row per slot
        xs = [torch.randn(2, 16, 32) * (1 + i) for i in range(4)]
        make = lambda step, micro: xs[2 * step + micro]  # noqa: E731
        import fp8mon.trainer.kernels as kernels

        real, fused_calls = kernels.fp8_gemm, []
        from fp8mon.agent.stats.engine import Engine, engine

        real_defer, deferred, real_launch, launches = ts.defer, [], Engine.launch, []
        real_cast_rows, weight_batches = ts.cast_rows, []

        def spy(*args, stats=None, **kw):  # which GEMMs carried the statistics epilogue
            fused_calls.append(stats is not None)
            return real(*args, stats=stats, **kw)

        def defer_spy(x, target):
            deferred.append(x.shape)
            return real_defer(x, target)

        def launch_spy(self, tensors, *args, **kw):  # tensors per statistics launch
            launches.append(len(tensors))
            return real_launch(self, tensors, *args, **kw)

        def cast_rows_spy(items, device):  # the weights' rows, one launch per step (trainer.weight_rows)
            weight_batches.append(len(items))
            return real_cast_rows(items, device)

        policy, fp8_linear.OUTPUT_STATS, kernels.fp8_gemm = fp8_linear.OUTPUT_STATS, output_stats, spy
        ts.defer, Engine.launch, ts.cast_rows = defer_spy, launch_spy, cast_rows_spy
        try:
            got, keys = agent_rows(model, make, 2, "cpu", fused=True, stats_backend="triton")
        finally:
            fp8_linear.OUTPUT_STATS, kernels.fp8_gemm = policy, real
            ts.defer, Engine.launch, ts.cast_rows = real_defer, real_launch, real_cast_rows
        problem = "" if any(fused_calls) == (output_stats == "epilogue") else \
            f"statistics epilogues in {sum(fused_calls)} of {len(fused_calls)} GEMMs with OUTPUT_STATS={output_stats}"
        if output_stats == "deferred":
            # 2 steps x 2 micro-batches x 2 layers: each output joins a cast's launch (no launch of one tensor for it)
            if len(deferred) != 8 or sum(n > 1 for n in launches) < 8 or engine("cpu")._deferred:
                problem += f" deferred {len(deferred)} outputs, launches of {launches}, left {engine('cpu')._deferred}"
        if weight_batches != [2, 2]:  # 2 steps, each with both layers' weights in its first weight cast's launch
            problem += f" weight row batches {weight_batches}, not [2, 2]"
        emit(f"{name}:path", problem)
        model.load_state_dict(state)
        want, keys2 = agent_rows(model, make, 2, "cpu", fused=False, stats_backend="triton")
        order = [keys2.index(k) for k in keys]
        for step in range(2):
            a, b = got[step].clone(), want[step][order].clone()
            # current scaling: the kernel's scale is reciprocal(amax) * max in fp32, the hooks' emulation
            # fp64 max / amax: at most an ulp apart; the hooks' underflow comes from the histogram
            rel = ((a[:, ds.SCALE] - b[:, ds.SCALE]).abs() / b[:, ds.SCALE]).nan_to_num(0)
            a[:, ds.SCALE] = b[:, ds.SCALE]
            problem = row_problems(a, b, under_slack=float(b[:, ds.HIST:].max()))
            if float(rel.max()) > 2.5e-7:
                problem += f" scale differs by {float(rel.max())}"
            emit(f"{name}:step{step}", problem)
        hooked = [h.sites for h in agent_hooks(model)]
        # grad_weight is the one site Fp8Linear leaves to the hooks (weight.grad after accumulation, see fp8_linear)
        emit(f"{name}:sites",
             "" if len(keys) == 10 and hooked == [("grad_weight",)] * 2 else f"slots {keys}, hooks {hooked}")

    def gemm_stats_fallback():
        # A GEMM with fused statistics that fails (a variant that cannot compile or launch on some GPU) must not
        # stop training: Fp8Linear computes the output row apart, and the agent gets the same rows.
        sys.path.insert(0, str(ROOT / "tests"))
        import fp8mon.trainer.kernels as kernels
        from rowcheck import agent_rows
        from fp8mon.trainer import fp8_linear
        from fp8mon.trainer.fp8_linear import Fp8Linear

        real = kernels.fp8_gemm

        def failing(*args, stats=None, **kw):
            if stats is not None:
                raise RuntimeError("out of resource: shared memory")
            return real(*args, **kw)

        torch.manual_seed(5)
        model = torch.nn.Sequential(Fp8Linear(32, 48), torch.nn.GELU(), Fp8Linear(48, 32))
        for m in model:
            m.backend = "triton" if isinstance(m, Fp8Linear) else None
        state = {k: v.clone() for k, v in model.state_dict().items()}
        make = lambda step, micro: torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))  # noqa: E731
        kernels.fp8_gemm = failing
        policy, fp8_linear.OUTPUT_STATS = fp8_linear.OUTPUT_STATS, "epilogue"
        try:
            got, keys = agent_rows(model, make, 1, "cpu", fused=True, stats_backend="triton")
        finally:
            kernels.fp8_gemm, fp8_linear.OUTPUT_STATS = real, policy
        broken, fp8_linear._GEMM_STATS["ok"] = not fp8_linear._GEMM_STATS["ok"], True
        model.load_state_dict(state)
        want, keys2 = agent_rows(model, make, 1, "cpu", fused=False, stats_backend="triton")
        sites = {k[1] for k in keys}
        order = [keys2.index(k) for k in keys]
        a, b = got[0].clone(), want[0][order].clone()
        a[:, ds.SCALE] = b[:, ds.SCALE]  # the quantize kernels' scale vs the hooks' emulation: an ulp apart
        problem = row_problems(a, b, under_slack=float(b[:, ds.HIST:].max()))
        if not broken:
            problem += " the failure was not noticed"
        if not {"output", "grad_weight"} <= sites:
            problem += f" sites reported: {sorted(sites)}"
        emit("gemm_stats_fallback", problem)

    def fp8_linear_agent_cached():
        # with weight caching (micro-batches reuse the step's first FP8 weight), the rows equal those without it:
        # a weight whose row the step's batch took still casts once, adding its underflow count to that row
        sys.path.insert(0, str(ROOT / "tests"))
        from rowcheck import agent_rows
        from fp8mon.trainer.fp8_linear import Fp8Linear, cache_fp8_weights

        torch.manual_seed(5)
        model = torch.nn.Sequential(Fp8Linear(32, 64), torch.nn.GELU(), Fp8Linear(64, 32))
        for m in model:
            if isinstance(m, Fp8Linear):
                m.backend = "triton"
                with torch.no_grad():
                    m.weight[0, :8] = 1e-9  # underflows in E4M3 at the weight's scale: the cast counts them
        state = {k: v.clone() for k, v in model.state_dict().items()}
        xs = [torch.randn(2, 16, 32) * (1 + i) for i in range(4)]
        make = lambda step, micro: xs[2 * step + micro]  # noqa: E731
        plain, keys = agent_rows(model, make, 2, "cpu", fused=True, stats_backend="triton")
        model.load_state_dict(state)
        cache_fp8_weights(model, torch.optim.SGD(model.parameters(), lr=0.0))
        cached, keys2 = agent_rows(model, make, 2, "cpu", fused=True, stats_backend="triton")
        problem = "" if keys == keys2 else f"slots {keys} vs {keys2}"
        for step in range(2):
            if not torch.equal(plain[step].nan_to_num(-1.0), cached[step].nan_to_num(-1.0)):
                bad = (plain[step].nan_to_num(-1.0) != cached[step].nan_to_num(-1.0)).nonzero().tolist()[:4]
                problem += f" step {step}: rows differ at {bad}"
        emit("fp8_linear_agent_cached", problem)

    def fp8_linear_agent_grown():
        # rows merged later land on a model whose 20 slots outgrow the agent's first step buffer (16 rows) in the
        # middle of its first step: the rows waiting for their merge must land before the buffer moves
        sys.path.insert(0, str(ROOT / "tests"))
        from rowcheck import agent_rows
        from fp8mon.trainer.fp8_linear import Fp8Linear

        torch.manual_seed(6)
        model = torch.nn.Sequential(*[m for _ in range(2) for m in (Fp8Linear(32, 48), torch.nn.GELU(),
                                                                     Fp8Linear(48, 32))])
        for m in model:
            if isinstance(m, Fp8Linear):
                m.backend = "triton"
        xs = [torch.randn(2, 8, 32) * (1 + i) for i in range(4)]
        rows, keys = agent_rows(model, lambda step, micro: xs[2 * step + micro], 2, "cpu", fused=True,
                                stats_backend="triton")
        problem = "" if len(keys) == 20 else f"slots {keys}"
        for step in range(2):
            empty = (rows[step][:, 0] <= 0).nonzero().flatten().tolist()  # a row that never landed counts nothing
            if empty:
                problem += f" step {step}: rows {empty} empty"
        emit("fp8_linear_agent_grown", problem)

    def clip_from_rows():
        """Gradient clipping with the watched gradients' norms from the agent's grad_weight rows (trainer.clip)
        equals torch's clip_grad_norm_ (norm and clipped gradients), takes those rows only on reporting steps and for
        gradients unchanged since, and gives NaN for a NaN gradient."""
        from fp8mon.agent import Agent
        from rowcheck import NullTransport
        from fp8mon.trainer.clip import clip_grad_norm

        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        params = list(model.parameters())
        agent = Agent(transport=NullTransport(), every=2, stats_backend="triton").watch(model)
        for step in range(3):  # steps 0 and 2 report; step 2's input holds a NaN
            x = torch.randn(4, 16) * (1 + step)
            if step == 2:
                x[1, 3] = float("nan")
            model.zero_grad(set_to_none=True)
            for _ in range(2):  # two micro-batches: the rows of the last backward pass's gradients count
                model(x).square().mean().backward()
            if step == 0:  # changed in place after its row was taken (as an AMP unscale does): read again
                model[0].weight.grad.mul_(2.0)
            ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for r, p in zip(ref, params):
                r.grad = p.grad.clone()
            want = torch.nn.utils.clip_grad_norm_(ref, 0.05)
            covered = sum(agent.grad_sq_norms([p.grad for p in params])[1])
            got = clip_grad_norm(params, 0.05, agent)
            problems = []
            if covered != (1, 0, 2)[step]:  # the weights, on reporting steps (step 0: one changed since its row)
                problems.append(f"{covered} gradients' norms from rows")
            if step == 2:
                if not torch.isnan(got):
                    problems.append(f"norm {float(got)} with a NaN gradient")
            else:
                if not abs(float(got) - float(want)) <= 1e-6 * float(want):
                    problems.append(f"norm {float(got)} vs torch {float(want)}")
                for r, p in zip(ref, params):
                    if not torch.allclose(p.grad, r.grad, rtol=1e-6, atol=0):
                        problems.append("clipped gradients differ from torch's")
                        break
            agent.log(step)
            emit(f"clip_from_rows:step{step}", "; ".join(problems))
        agent.close()
        emit("clip_from_rows:errors", "" if agent.errors == 0 else str(agent.last_error))

    checks = dict(fused_kernels=fused_kernels, fused_fast_path=fused_fast_path, fused_merge=fused_merge, fp8_linear_agent=fp8_linear_agent,
                  fp8_linear_agent_read=lambda: fp8_linear_agent("read"),
                  fp8_linear_agent_deferred=lambda: fp8_linear_agent("deferred"),
                  fp8_linear_agent_cached=fp8_linear_agent_cached, gemm_stats_fallback=gemm_stats_fallback,
                  fp8_linear_agent_grown=fp8_linear_agent_grown, clip_from_rows=clip_from_rows)
    run_each(checks, names)


GROUPS = ["fused_kernels", "fused_fast_path", "fused_merge", "fp8_linear_agent", "fp8_linear_agent_read",
          "fp8_linear_agent_deferred", "fp8_linear_agent_cached",
          "fp8_linear_agent_grown", "gemm_stats_fallback", "clip_from_rows"]


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreter_child import run_checks  # tests/ is on the path under pytest, not in the child

    return run_checks(__file__, GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_fused_statistics(results, group):
    from interpreter_child import assert_group

    assert_group(results, group)


if __name__ == "__main__":
    _child(sys.argv[1:])
