"""The training loop on the CPU: learning, schedules, bit-identical resume, divergence, 2-rank gloo DDP
through torchrun, the agent streaming to a real `fp8mon serve`, the `fp8mon train` command, and FP8 vs
fp32 loss parity."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from fp8mon.cli import main as fp8mon
from fp8mon.monitor.localserver import free_port
from fp8mon.trainer.config import get_config
from fp8mon.trainer.train import EXIT_DIVERGED, build_parser, lr_at, main, run

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--config", "tiny", "--batch-size", "8", "--seq-len", "64", "--threads", "1", "--device", "cpu",
        "--no-progress", "--log-every", "1"]


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.sqlite_only]


def train(*argv):
    return run(build_parser().parse_args([*FAST, *map(str, argv)]))



FP32_30 = ["--precision", "fp32", "--steps", 30, "--seed", 1, "--eval-batches", 4]


@pytest.fixture(scope="module", params=["llama", "fog"])
def fp32_run(request):
    """(arch, 30 fp32 steps of the tiny config): learning's run, and the reference FP8 training is held to."""
    return request.param, train("--arch", request.param, *FP32_30)


def test_loss_decreases_on_the_tiny_config(fp32_run):
    _, result = fp32_run
    losses = [result.losses[s] for s in range(30)]
    assert result.status == "finished" and result.step == 30
    assert abs(losses[0] - math.log(256)) < 0.3  # starts near uniform over the 256 bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
    assert all(math.isfinite(g) and g > 0 for g in result.grad_norms.values())


def test_lr_schedules():
    kw = dict(lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert lr_at(0, schedule="cosine", **kw) == pytest.approx(0.1) and lr_at(9, schedule="cosine", **kw) == 1.0
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(110, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(50, schedule="wsd", decay_frac=0.2, **kw) == 1.0  # stable
    assert lr_at(88, schedule="wsd", decay_frac=0.2, **kw) == 1.0  # decay starts at 110 - 22 = 88
    assert lr_at(99, schedule="wsd", decay_frac=0.2, **kw) == pytest.approx(0.55)
    assert lr_at(110, schedule="wsd", decay_frac=0.2, **kw) == pytest.approx(0.1)


@pytest.mark.parametrize("arch", ["llama", "fog"])
def test_resume_from_a_checkpoint_is_bit_identical(tmp_path, arch):
    common = ["--arch", arch, "--precision", "fp32", "--steps", 8, "--n-layer", 2, "--schedule", "wsd"]
    straight = train(*common, "--out", tmp_path / "a")
    first = train(*common, "--out", tmp_path / "b", "--stop-at", 4)
    assert first.step == 4 and sorted(first.losses) == [0, 1, 2, 3]
    second = train(*common, "--out", tmp_path / "b", "--resume")
    assert second.start_step == 4 and second.step == 8
    resumed = {**first.losses, **second.losses}
    assert resumed == straight.losses  # exact float equality, every step
    assert {**first.grad_norms, **second.grad_norms} == straight.grad_norms
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 8
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_a_non_finite_loss_stops_the_run_as_diverged(capsys, tmp_path):
    code = main([*FAST, "--n-layer", "1", "--precision", "fp32", "--steps", "20", "--lr", "inf",
                 "--out", str(tmp_path)])
    assert code == EXIT_DIVERGED
    out = capsys.readouterr().out
    assert "DIVERGED: loss nan, grad norm nan at step 1 (last finite loss" in out and "diverged: 2 steps" in out
    assert not (tmp_path / "ckpt.pt").exists()  # no NaN checkpoint


def test_fp8mon_train_command_forwards_its_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        fp8mon(["train", "--help"])
    assert exc.value.code == 0 and "--fp8-scaling" in capsys.readouterr().out
    assert fp8mon(["train", *FAST, "--n-layer", "1", "--precision", "fp32", "--steps", "2"]) == 0
    assert "finished: 2 steps" in capsys.readouterr().out


DDP_SCRIPT = """
import json, os, sys
from fp8mon.trainer.train import build_parser, end_distributed, run
result = run(build_parser().parse_args(sys.argv[2:]))
params = {n: getattr(p, "full_tensor", lambda: p)().detach().double().sum().item()  # FSDP2: gathered
          for n, p in result.model.named_parameters()}
with open(os.path.join(sys.argv[1], f"rank{result.rank}.json"), "w") as f:
    json.dump({"rank": result.rank, "world": result.world_size, "run": result.run_name,
               "losses": {str(k): v for k, v in result.losses.items()}, "params": params,
               "sharded": [n for n, p in result.model.named_parameters() if hasattr(p, "full_tensor")]}, f)
del result
end_distributed(succeeded=True)
"""


def two_ranks(tmp_path, server, run_name: str, *args: str, url: str | None = None, system=FAST):
    """`fp8mon train` under torchrun with 2 ranks (gloo with ``system``'s CPU), streaming to the live server (or
    ``url``) as `run_name`: (the finished process, rank 0's and rank 1's results as the worker wrote them)."""
    script = tmp_path / "worker.py"
    script.write_text(DDP_SCRIPT)
    monitor = ["--monitor-url", url or server.url, "--run-name", run_name,
               "--monitor-spool", str(tmp_path / "spool")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(tmp_path),
           *system, *monitor, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    return proc, r0, r1


def assert_trains_as_one_rank_accumulating(r0: dict, common: list[str]):
    """Rank 0's losses and weights are those of 1 rank taking both halves of the data as 2 micro-batches; returns
    that single-rank result."""
    single = train(*common, "--grad-accum", 2)
    for step, loss in single.losses.items():
        assert r0["losses"][str(step)] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    for name, p in single.model.named_parameters():
        assert r0["params"][name] == pytest.approx(p.detach().double().sum().item(), rel=1e-3, abs=1e-3)
    return single


def test_two_rank_gloo_ddp_via_torchrun_averages_gradients(tmp_path, module_live_server):
    common = ["--arch", "fog", "--precision", "fp32", "--n-layer", "2", "--steps", "4", "--seed", "3"]
    proc, r0, r1 = two_ranks(tmp_path, module_live_server, "ddp-run", *common, "--monitor-every", "2")
    assert proc.stdout.count("finished: 4 steps") == 1  # only rank 0 prints
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2) and r0["run"] == r1["run"]
    assert r0["losses"] == r1["losses"]  # the logged loss is the mean over ranks, identical on both
    assert r0["params"] == r1["params"]  # same averaged gradient -> same weights on both ranks
    # 2 ranks x 1 micro-batch see the data of 1 rank x 2 micro-batches: averaging == accumulating
    single = assert_trains_as_one_rank_accumulating(r0, common)
    # ...and differs from what one rank would do alone on its own half of the data
    alone = train(*common)
    assert any(abs(alone.losses[s] - single.losses[s]) > 1e-3 for s in range(1, 4))
    # each rank's agent sent its own records, under rank 0's run name
    cat = httpx.get(f"{module_live_server.url}/api/v1/runs/ddp-run/catalogue").json()
    assert cat["ranks"] == [0, 1] and len(cat["layers"]) == 8
    assert httpx.get(f"{module_live_server.url}/api/v1/runs/ddp-run").json()["tags"]["world_size"] == "2"


def test_two_rank_gloo_fsdp2_trains_as_one_rank_accumulating(tmp_path, module_live_server):
    common = ["--arch", "llama", "--precision", "fp32", "--n-layer", "2", "--steps", "3", "--seed", "5"]
    proc, r0, r1 = two_ranks(tmp_path, module_live_server, "fsdp-run", *common, "--monitor-every", "1", "--fsdp")
    assert proc.stdout.count("finished: 3 steps") == 1 and "fp8mon agent:" not in proc.stderr, proc.stderr[-3000:]
    assert r0["losses"] == r1["losses"] and r0["params"] == r1["params"]
    assert "blocks.0.attn.qkv.weight" in r0["sharded"] and len(r0["sharded"]) == len(r0["params"])
    # sharded, the 2 ranks still train as one rank accumulating both halves of the data
    assert_trains_as_one_rank_accumulating(r0, common)
    cat = httpx.get(f"{module_live_server.url}/api/v1/runs/fsdp-run/catalogue").json()
    assert cat["ranks"] == [0, 1] and len(cat["layers"]) == 8


def test_two_rank_gloo_fsdp2_fp8_merges_ranks_into_one_record(tmp_path, module_live_server):
    common = ["--arch", "llama", "--precision", "fp8", "--n-layer", "2", "--steps", "2", "--seed", "7"]
    proc, r0, r1 = two_ranks(tmp_path, module_live_server, "fsdp-fp8", *common, "--monitor-every", "1", "--fsdp",
                             "--monitor-reduce-ranks")
    assert proc.stdout.count("finished: 2 steps") == 1 and "fp8mon agent:" not in proc.stderr, proc.stderr[-3000:]
    assert r0["losses"] == r1["losses"] and r0["params"] == r1["params"]
    assert_trains_as_one_rank_accumulating(r0, common)
    cat = httpx.get(f"{module_live_server.url}/api/v1/runs/fsdp-fp8/catalogue").json()
    assert -1 in cat["ranks"] and len(cat["layers"]) == 8

    def numel(rank: int) -> list[float]:
        return httpx.get(f"{module_live_server.url}/api/v1/runs/fsdp-fp8/series", params={
            "layer": "blocks.0.mlp.fc1", "site": "input", "stat": "numel", "rank": rank}).json()["points"]["value"]

    assert numel(0) == numel(1) == []  # no rank sent its own rows
    # the merged input row counts both ranks' micro-batches: 8 x 64 tokens each, of fc1's width (d_model)
    assert numel(-1) == [2 * 8 * 64 * get_config("tiny").d_model] * 2


def test_fsdp_refuses_what_it_does_not_support(tmp_path):
    with pytest.raises(SystemExit, match="--fsdp: without --out"):
        train("--fsdp", "--precision", "fp32", "--steps", 1, "--out", tmp_path)
    with pytest.raises(SystemExit, match="--fsdp: under torchrun"):
        train("--fsdp", "--precision", "fp32", "--steps", 1)


def test_agent_streams_a_training_run_to_a_live_monitor(module_live_server, tmp_path):
    steps = 6
    result = train("--arch", "fog", "--precision", "fp32", "--n-layer", 2, "--steps", steps,
                   "--monitor-url", module_live_server.url, "--run-name", "trainer-e2e", "--monitor-every", 2,
                   "--monitor-spool", tmp_path / "spool", "--tag", "purpose=test")
    assert result.status == "finished"
    api = f"{module_live_server.url}/api/v1/runs"
    run_info = httpx.get(f"{api}/trainer-e2e").json()
    assert run_info["status"] == "finished"
    assert run_info["tags"] == {"arch": "fog", "precision": "fp32", "config": "tiny", "world_size": "1",
                                "purpose": "test"}
    assert run_info["config"]["model"]["n_layer"] == 2 and run_info["config"]["train"]["steps"] == steps
    cat = httpx.get(f"{api}/trainer-e2e/catalogue").json()
    linears = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    assert [layer["layer"] for layer in cat["layers"]] == linears
    assert all(set(layer["sites"]) == {"input", "weight", "output", "grad_output", "grad_weight"}
               for layer in cat["layers"])
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "attn_max_logit", "logit_logsumexp"} <= set(cat["scalars"])
    assert cat["ranks"] == [0]
    loss = httpx.get(f"{api}/trainer-e2e/series", params={"scalar": "loss"}).json()["points"]
    assert loss["step"] == list(range(steps))
    assert loss["value"] == pytest.approx([result.losses[s] for s in range(steps)], rel=1e-6)
    amax = httpx.get(f"{api}/trainer-e2e/series", params={"stat": "amax", "layer": "blocks.1.mlp.fc2",
                                                           "site": "grad_output"}).json()["points"]
    assert amax["step"] == [0, 2, 4] and all(v > 0 for v in amax["value"])  # on the reporting steps only
    max_logit = httpx.get(f"{api}/trainer-e2e/series", params={"scalar": "attn_max_logit"}).json()["points"]
    assert max_logit["step"] == [0, 2, 4] and all(0 < v <= 0.125 * 32 for v in max_logit["value"])

    code = main([*FAST, "--n-layer", "1", "--precision", "fp32", "--steps", "10", "--lr", "inf",
                 "--monitor-url", module_live_server.url, "--run-name", "trainer-diverged",
                 "--monitor-spool", str(tmp_path / "spool2")])
    assert code == EXIT_DIVERGED
    assert httpx.get(f"{api}/trainer-diverged").json()["status"] == "diverged"


def test_fp8_loss_tracks_fp32_on_the_cpu(fp32_run):
    pytest.importorskip("fp8mon.trainer.fp8_linear")
    arch, ref = fp32_run
    fp8 = train("--arch", arch, *FP32_30[2:], "--precision", "fp8")  # FP8 block GEMMs (E4M3/E5M2, current scaling), bf16 elsewhere
    diffs = [fp8.losses[s] - ref.losses[s] for s in range(30)]
    # Tolerances (nats), ~2x the largest measured, while the loss itself falls by > 2 nats. The CPU's bf16 kernels
    # move these: on an Intel Sapphire Rapids fp8 - fp32 was per step <= 0.09, last-10 mean <= 0.016, val <= 0.01;
    # on an AMD EPYC (llama) 0.079, 0.039 and 0.031, where bf16 alone gave 0.067, -0.030 and -0.020.
    assert max(map(abs, diffs)) < 0.15, diffs
    assert abs(sum(diffs[20:]) / 10) < 0.08, diffs
    assert abs(fp8.val_losses[29] - ref.val_losses[29]) < 0.06
    assert ref.losses[0] - ref.losses[29] > 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "fog"])
def test_fp8_on_cuda_tracks_bf16(arch):
    """The CUDA path (Triton kernels on sm89+): FP8 training follows bf16 on the tiny config."""
    pytest.importorskip("fp8mon.trainer.fp8_linear")
    common = ["--arch", arch, "--steps", 40, "--seed", 1, "--eval-batches", 4, "--device", "cuda",
              "--batch-size", 16, "--seq-len", 128]
    ref = train(*common, "--precision", "bf16")
    fp8 = train(*common, "--precision", "fp8")
    assert fp8.status == "finished", fp8.losses
    diffs = [fp8.losses[s] - ref.losses[s] for s in range(40)]
    assert max(map(abs, diffs)) < 0.15 and abs(sum(diffs[30:]) / 10) < 0.04, diffs
    assert abs(fp8.val_losses[39] - ref.val_losses[39]) < 0.03


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_two_gpus_over_nccl_train_as_one_and_merge_ranks(tmp_path, wrap, precision):
    """On 2 GPUs (NCCL) with the agent merging ranks: the ranks agree, and rank 0 alone spools (no monitor runs
    where the GPUs are; the batches wait for ``fp8mon sync``)."""
    system = ["--config", "tiny", "--batch-size", "16", "--seq-len", "128", "--no-progress", "--log-every", "1"]
    args = ["--arch", "llama", "--precision", precision, "--steps", "12", "--seed", "3", "--monitor-every", "2",
            "--monitor-reduce-ranks", *(["--fsdp"] if wrap == "fsdp" else [])]
    proc, r0, r1 = two_ranks(tmp_path, None, "gpus", *args, url=f"http://127.0.0.1:{free_port()}", system=system)
    assert proc.stdout.count("finished: 12 steps") == 1 and "fp8mon agent:" not in proc.stderr, proc.stderr[-3000:]
    assert r0["losses"] == r1["losses"] and r0["params"] == r1["params"]
    assert r0["losses"]["11"] < r0["losses"]["0"] - 1.0
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["rank0"]
    assert list((tmp_path / "spool" / "rank0").glob("*.fp8b"))
