"""Statistics fused into the FP8 GEMM epilogues (``fp8_gemm(stats=)``), on the CPU in Triton's interpreter:
the row equals ``stats.torch_path.partials`` of the returned C (and ``fp8_gemm_ref``'s row), for the ptr and TMA
kernels, bf16 and fp32 outputs, bias, edge tiles, split-K (taken after the reduce), NaN/Inf scales, a format's
current scaling, a merge into an existing row; C is bit-identical with and
without statistics (the ``interpreted`` fixture). An agent watching FP8 linears: test_fused_stats.py.
"""

from __future__ import annotations

import pytest
import torch
from trainer_rows import row_problems

pytestmark = pytest.mark.usefixtures("interpreted")
CFG = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 2}
NAN, INF = float("nan"), float("inf")
CASES = {  # name: (M, N, K, out dtype, bias, split_k, scale_a, fmt, merge)
    "edges bf16 bias": (70, 45, 96, torch.bfloat16, True, 1, 0.5, None, False),
    "edges fp32": (33, 40, 64, torch.float32, False, 1, 0.25, None, False),
    "split-k bf16 bias": (70, 45, 128, torch.bfloat16, True, 3, 0.5, None, False),
    "split-k fp32 e5m2": (40, 36, 128, torch.float32, False, 2, 2.0, "e5m2", False),
    "fp32 e5m2 merge": (64, 64, 64, torch.float32, True, 1, 1.0, "e5m2", True),
    "nan scale": (20, 30, 32, torch.bfloat16, True, 1, NAN, None, False),
    "inf scale split-k": (20, 30, 64, torch.float32, False, 2, INF, "e4m3", False),
    # full tiles only: 4th powers of deviations ~1e-11 underflow fp32 and of ~1e16 overflow it, unscaled
    "tiny values, full tiles": (64, 64, 64, torch.float32, False, 1, 1e-12, None, False),
    "huge values, full tiles": (64, 96, 64, torch.float32, True, 1, 1e15, None, False),
}


@pytest.mark.parametrize("impl", ["ptr", "tma"])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm_epilogue_row_is_the_oracles_and_the_references(case, impl):
    from fp8mon.agent.stats import launch as ts
    from fp8mon.agent.stats import torch_path as ds
    from fp8mon.trainer.kernels import fp8_gemm, fp8_gemm_ref

    M, N, K, od, has_bias, split, sa, fmt, merge = CASES[case]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=g).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, generator=g) * 4).to(torch.float8_e5m2)
    sa, sb = torch.tensor(sa), torch.tensor(3.0)
    bias = torch.randn(N, generator=g) if has_bias else None
    old = ds.partials(torch.randn(50, generator=g))
    tgt = ts.Target.new("cpu", center=(0.1, 2.0), fmt=fmt, merge=merge)
    tgt.rows[0] = old
    c = fp8_gemm(a, b, sa, sb, od, bias, impl=impl, config=CFG, split_k=split, stats=tgt)
    plain = fp8_gemm(a, b, sa, sb, od, bias, impl=impl, config=CFG, split_k=split)
    assert torch.equal(c.view(torch.uint8), plain.view(torch.uint8)), "C differs with statistics on"
    want = ds.partials(c, fmt=fmt, outlier_center=(0.1, 2.0))
    if merge:
        want = ds.merge(old, want)
    slack = float(want[ds.HIST:].max()) if fmt else None  # current scaling: underflow within a binade
    ref = ts.Target.new("cpu", center=(0.1, 2.0), fmt=fmt, merge=merge)
    ref.rows[0] = old
    fp8_gemm_ref(a, b, sa, sb, od, bias, stats=ref)
    problems = [row_problems(tgt.rows[0], want, under_slack=slack),
                row_problems(tgt.rows[0], ref.rows[0], rtol=1e-5, under_slack=slack)]
    assert not any(problems), "; ".join(problems)


# ---------------------------------------------------------------------------------------------------
# autotuning of the statistics variants (host logic; the autotuner itself runs only on a GPU)

def test_statistics_variant_is_tuned_among_the_plain_best_and_one_spare_of_small_tiles(monkeypatch):
    import importlib

    fg = importlib.import_module("fp8mon.trainer.kernels.fp8_gemm")  # the module (the package exports the function)
    # a fresh table: GPU tests earlier in the same process may have left their real choices in it
    monkeypatch.setattr(fg, "_PLAIN_BEST", {})

    configs = fg._tma_configs()
    small = [c for c in configs if c.kwargs["BM"] * c.kwargs["BN"] <= 128 * 128]
    assert 0 < len(small) < len(configs)
    prune = fg._stats_prune("tma")
    flags = dict(KEY="e5m2xe4m3->bf16", HAS_BIAS=False, FAST_ACC=False, SPLIT_K=1)
    shape = {"M": 256, "N": 512, "K": 1024}
    assert prune(configs, shape, STATS=False, **flags) == configs
    assert prune(configs, shape, STATS=True, **flags) == small  # the plain best is not known yet

    class Tuner:  # what the launch sees of triton.autotune: a launch, then best_config
        best_config = configs[0]  # 128x256x128, 3 stages

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    fg._tuned_launch(Tuner(), "tma", None, (), dict(flags, STATS=True), *shape.values())
    assert not fg._PLAIN_BEST  # a statistics variant's choice is not a plain one
    Tuner.best_config = None  # a Triton that does not say: known as tuned (no second plain run), every config
    fg._tuned_launch(Tuner(), "tma", None, (), dict(flags, STATS=False), *shape.values())
    assert list(fg._PLAIN_BEST.values()) == [None]
    assert prune(configs, shape, STATS=True, **flags) == small
    for best, want in ((small[-1], [fg._STATS_SPARE, small[-1]]),  # the spare and a small plain best
                       (configs[0], [fg._STATS_SPARE])):  # 128 x 256: too large for the statistics epilogue
        fg._PLAIN_BEST.clear()
        Tuner.best_config = best
        fg._tuned_launch(Tuner(), "tma", None, (), dict(flags, STATS=False), *shape.values())
        kept = [fg._config_dict(c) for c in prune(configs, shape, STATS=True, **flags)]
        assert kept == [fg._config_dict(c) if not isinstance(c, dict) else c for c in want]
    assert prune(configs, dict(shape, K=2048), STATS=True, **flags) == small  # another shape
