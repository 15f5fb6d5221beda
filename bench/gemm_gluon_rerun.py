"""The reverted Gluon precise-accumulation GEMM (commit 9420403, ``trainer/kernels/fp8_gemm_gluon.py`` there)
against our Triton precise GEMM and ``torch._scaled_mm``: accuracy against an fp64 product, then speed.

    python3 bench/gemm_gluon_rerun.py acc      # relative errors on four cases, every Gluon config
    python3 bench/gemm_gluon_rerun.py speed    # TFLOP/s on 8192^3 dgrad and the 124M/1.5B backward shapes

The kernel file is taken from git history (``git show 9420403:...``) into a temporary folder; it is not part of
the tree. Run on an sm90 GPU.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_KERNEL_DIR = tempfile.mkdtemp()
(Path(_KERNEL_DIR) / "fp8_gemm_gluon.py").write_text(subprocess.run(
    ["git", "-C", str(ROOT), "show", "9420403:trainer/kernels/fp8_gemm_gluon.py"], check=True, capture_output=True,
    text=True).stdout)
sys.path.insert(0, _KERNEL_DIR)
sys.path.insert(0, str(ROOT))
import torch, triton
import fp8_gemm_gluon as G
from fp8mon.trainer.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from bench.gemm_ws import E4, E5, ops, rel  # the same operands (seeded, x4) and relative error

mode = sys.argv[1]
dev = "cuda"

one = torch.tensor(1.0, device=dev)
if mode == "acc":
    for (M, N, K, seed, pos) in [(256, 256, 512, 1, False), (384, 512, 8192, 2, False), (256, 256, 16384, 3, True),
                                 (1024, 1024, 4096, 4, False)]:
        a, b = ops(M, N, K, E5, E4, seed)
        if pos:
            a = (a.float().abs()).to(E5); b = (b.float().abs()).to(E4)
        exact = a.double() @ b.double().t()
        res = {}
        for cfg in G.CONFIGS:
            c = torch.empty(M, N, dtype=torch.float32, device=dev)
            G.launch(a, b, c, None, one, one, None, 1, torch.cuda.get_device_properties(0).multi_processor_count, cfg)
            torch.cuda.synchronize()
            res[f"gluon{cfg[:3]}"] = rel(c, exact)
        for impl in ("tma", "ptr"):
            res[impl] = rel(fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=False, impl=impl, split_k=1), exact)
        res["sm_precise"] = rel(fp8_gemm_ref(a, b, one, one, out_dtype=torch.float32, fast_accum=False), exact)
        res["sm_fast"] = rel(fp8_gemm_ref(a, b, one, one, out_dtype=torch.float32, fast_accum=True), exact)
        res["triton_fast"] = rel(fp8_gemm(a, b, one, one, out_dtype=torch.float32, fast_accum=True, impl="tma", split_k=1), exact)
        print(f"acc {M}x{N}x{K} pos={pos}: " + ", ".join(f"{k} {v:.2e}" for k, v in res.items()), flush=True)
else:
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [("8192^3 dgrad", 8192, 8192, 8192, torch.bfloat16)]
    for T, lins, tag in [(16384, {"qkv": (2048, 6144), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}, "1.5b"),
                         (16384, {"qkv": (768, 2304), "fc1": (768, 4096)}, "124m")]:
        for name, (fin, fout) in lins.items():
            shapes.append((f"{tag}.{name} dgrad", T, fin, fout, torch.bfloat16))
            shapes.append((f"{tag}.{name} wgrad", fout, fin, T, torch.float32))
    for label, M, N, K, od in shapes:
        a, b = ops(M, N, K, E5, E4, 7)
        sa, sb = torch.tensor(0.5, device=dev), torch.tensor(2.0, device=dev)
        fl = 2 * M * N * K
        t = {}
        t["sm"] = triton.testing.do_bench(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=od, use_fast_accum=False), return_mode="median")
        t["ours"] = triton.testing.do_bench(lambda: fp8_gemm(a, b, sa, sb, out_dtype=od, fast_accum=False), return_mode="median")
        c = torch.empty(M, N, dtype=od, device=dev)
        for cfg in G.CONFIGS:
            try:
                t[f"gl{cfg[0]}x{cfg[1]}s{cfg[3]}"] = triton.testing.do_bench(lambda: G.launch(a, b, c, None, sa, sb, None, 1, nsm, cfg), return_mode="median")
            except Exception as e:
                print("  fail", cfg, type(e).__name__, str(e)[:200])
        best_gl = min(v for k, v in t.items() if k.startswith("gl"))
        print(f"speed {label:18s} M{M} N{N} K{K}: " + ", ".join(f"{k} {fl/v/1e9:.0f}" for k, v in t.items())
              + f" TFLOP/s | ours/sm {t['sm']/t['ours']:.3f} gluon/sm {t['sm']/best_gl:.3f}", flush=True)
