"""bench/multi_gpu.py in its CPU form: torchrun with 2 gloo processes, DDP and FSDP2, the agent per rank and with
reduce_ranks (every 1 and 3, so that reporting and skipped steps alternate): every reporting step delivers all rows
without an agent error, and the merged rows equal the oracle of the ranks' concatenated tensors."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_gloo_ranks_ddp_and_fsdp2_deliver_every_row_equal_to_the_oracle():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/multi_gpu.py", "--tiny",
           "--device", "cpu", "--precision", "bf16", "--modes", "off,on,reduce", "--every", "1", "3", "--steps", "2",
           "--rounds", "1", "--warmup", "1", "--no-record"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    for wrap in ("ddp", "fsdp"):
        key = f"gpt2-tiny/{wrap}/bf16/n2"
        rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith(key + " ")}
        assert set(rows) == {"off", "on@1", "reduce@1", "on@3", "reduce@3", "oracle"}, out
        assert rows["oracle"][2:] == ["merged", "rows", "equal"], out
        for copy in ("on@1", "reduce@1", "on@3", "reduce@3"):
            # 2 layers x 4 linears + lm_head: 9 linears x 5 sites, on every reporting step; no agent error
            assert rows[copy][5:] == ["45/45", "0"], rows[copy]
            assert float(rows[copy][2]) > 0
    assert out.count("oracle input") == 2 and "DIFFERS" not in out and "rows appended" not in done.stderr


def test_fp8mon_model_under_fsdp2_in_fp8_merges_ranks_exactly():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/multi_gpu.py", "--tiny",
           "--model", "fp8mon", "--wrap", "fsdp", "--device", "cpu", "--precision", "float8", "--modes", "off,reduce",
           "--every", "1", "--steps", "1", "--rounds", "1", "--warmup", "2", "--no-record"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    out = done.stdout
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("fp8mon-tiny/fsdp/float8/n2 ")}
    assert rows["reduce@1"][5:] == ["80/80", "0"], out  # 4 blocks x 4 Fp8Linear x 5 sites
    assert "0 differ from the fp64 pairwise merge" in out and out.count(": equal") == 2, out
