"""Make the labelled corpus of models fp8mon did not write (bench/corpus/runs.py): train each scenario with the
agent spooling to a directory, turn the spool into a fixture (the format of tests/fixtures/runs, monitor.fixtures)
and label it by monitor.failures: the healthy runs of the same model, precision and split are the reference of the
stall rule, an FP8 run's BF16 twin (same model, scenario and seed) that of the quality gap. The tune and held-out
sets are written to separate folders and labelled each from its own healthy runs only.

    nice python3 bench/corpus/make.py --out tests/fixtures/corpus --threads 1               # the CPU corpus
    python3 bench/corpus/make.py --size small --device cuda --steps 4000 --out /tmp/corpus   # larger, on a GPU
    python3 bench/corpus/make.py --list                                                      # the scenarios

Then ``fp8mon eval tests/fixtures/corpus/heldout`` scores the held-out runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from bench.corpus.runs import Scenario, train  # noqa: E402
from fp8mon.monitor import failures  # noqa: E402
from fp8mon.monitor.fixtures import losses_of, write_fixture  # noqa: E402

KEEP_STATS = ("amax", "rms", "kurtosis", "underflow_frac", "overflow_frac", "nonfinite", "scale", "amax_history_max")
DIGITS = 4


def scenarios() -> dict[str, list[Scenario]]:
    """The tune and held-out sets: the same kinds of run, other seeds, event steps and factors in the held-out."""
    def s(split, name, **kw):
        return Scenario(name=f"ext-{split}-{name}", **kw)

    tune = [
        s("tune", "gpt2-bf16-stable", seed=1),
        s("tune", "gpt2-bf16-lrjump", kind="lrjump", at=350, factor=30.0, seed=1),
        s("tune", "gpt2-fp8-burst", precision="fp8", kind="burst", at=350, length=40, seed=1),
        s("tune", "gpt2-bf16-hot", kind="hot", factor=60.0, warmup=500, seed=1),
    ]
    heldout = [
        s("heldout", "gpt2-bf16-stable", seed=2),
        s("heldout", "gpt2-fp8-lrjump", precision="fp8", kind="lrjump", at=400, factor=40.0, seed=2),
        s("heldout", "gpt2-bf16-hot", kind="hot", factor=80.0, warmup=500, seed=2),
        s("heldout", "llama-bf16-burst", model="llama", kind="burst", at=380, length=50, seed=2),
        # added before they ran, with the predictors of commit 5f7585a fixed: a second healthy run (the Llama
        # reference of the stall rule) and two more stalls, of another model and of another warm-up shape
        s("heldout", "llama-bf16-stable", model="llama", seed=3),
        s("heldout", "llama-bf16-hot", model="llama", kind="hot", factor=70.0, warmup=500, seed=3),
        s("heldout", "gpt2-bf16-hot300", kind="hot", factor=50.0, warmup=300, seed=3),
        # added after the two above caught up with their healthy reference by their last step (labelled healthy,
        # yet paged): two more stalls, with the 500-step warm-up of the first, the predictors unchanged
        s("heldout", "gpt2-bf16-hot-s4", kind="hot", factor=70.0, warmup=500, seed=4),
        s("heldout", "llama-bf16-hot-s4", model="llama", kind="hot", factor=100.0, warmup=500, seed=4),
    ]
    return {"tune": tune, "heldout": heldout}


def _round(value):
    if value is None or isinstance(value, int) or not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{DIGITS}g}")


def spool_batches(spool: Path) -> tuple[dict, dict]:
    """Tensor rows {step: [(layer, site, rank, {stat: value})]} and scalars {step: [(name, value, rank)]}."""
    tensors, scalars = defaultdict(list), defaultdict(list)
    for path in sorted(spool.glob("*.fp8b")):
        body = msgpack.unpackb(gzip.decompress(path.read_bytes()), raw=False)
        block = body.get("tensors")
        if block:
            n = len(block["layer"])
            col = lambda v: v if isinstance(v, list) else [v] * n  # noqa: E731
            steps, ranks = col(block["step"]), col(block.get("rank", 0))
            for i in range(n):
                stats = {k: _round(v[i]) for k, v in block["stats"].items() if k in KEEP_STATS}
                tensors[steps[i]].append((block["layer"][i], block["site"][i], ranks[i], stats))
        block = body.get("scalars")
        if block:
            n = len(block["name"])
            col = lambda v: v if isinstance(v, list) else [v] * n  # noqa: E731
            for step, name, value, rank in zip(col(block["step"]), block["name"], block["value"],
                                               col(block.get("rank", 0))):
                scalars[step].append((name, _round(value), rank))
    return tensors, scalars


def as_batches(name: str, tensors: dict, scalars: dict, per_batch: int = 10) -> list[dict]:
    steps = sorted(set(tensors) | set(scalars))
    out = []
    for i in range(0, len(steps), per_batch):
        chunk = steps[i:i + per_batch]
        batch = {"version": 1, "batch_id": f"corpus-{chunk[0]}-{chunk[-1]}", "run": name}
        rows = [(s, *r) for s in chunk for r in tensors.get(s, ())]
        if rows:
            names = sorted({k for r in rows for k in r[4]})
            batch["tensors"] = {"step": [r[0] for r in rows], "layer": [r[1] for r in rows],
                                "site": [r[2] for r in rows], "rank": [r[3] for r in rows],
                                "stats": {k: [r[4].get(k) for r in rows] for k in names}}
        rows = [(s, *r) for s in chunk for r in scalars.get(s, ())]
        if rows:
            batch["scalars"] = {"step": [r[0] for r in rows], "name": [r[1] for r in rows],
                                "value": [r[2] for r in rows], "rank": [r[3] for r in rows]}
        out.append(batch)
    return out


def family(scenario: dict) -> tuple:
    return scenario["model"], scenario["precision"], scenario["steps"], scenario["size"]


def label_split(runs: dict[str, dict]) -> None:
    """Label every run of one split (name -> fixture dict) in place, from that split's healthy runs only."""
    refs = defaultdict(list)
    for data in runs.values():
        sc = data["config"]["scenario"]
        if sc["kind"] == "stable":
            refs[family(sc)].append(losses_of(data["batches"]))
    for data in runs.values():
        sc = data["config"]["scenario"]
        reference = failures.reference_curve(refs.get(family(sc), [])) if sc["kind"] != "stable" else None
        twin = None
        if sc["precision"] == "fp8":
            twin_name = data["name"].replace("-fp8-", "-bf16-")
            if twin_name in runs:
                twin = dict(failures.smoothed(losses_of(runs[twin_name]["batches"])))
        failure = failures.label(losses_of(data["batches"]), reference, twin)
        data["labels"] = {"diverged": failure.failed, "divergence_step": failure.step if failure.failed else None,
                          "rule": "monitor.failures", "failure": failure.as_dict()}
        data["expect"] = "stable" if sc["kind"] == "stable" else "failing"


def run_one(scenario: Scenario, split: str, device: str, every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = train(scenario, Path(tmp), device=device, every=every)
        tensors, scalars = spool_batches(Path(tmp))
    print(f"{scenario.name}: {scenario.steps} steps in {result['seconds']:.0f} s", flush=True)
    return {"name": scenario.name, "config": result["config"], "split": "tune" if split == "tune" else "test",
            "profile": f"external-{scenario.size}", "family": list(family(dataclasses.asdict(scenario))),
            "batches": as_batches(scenario.name, tensors, scalars)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/corpus"))
    ap.add_argument("--split", choices=("tune", "heldout", "all"), default="all")
    ap.add_argument("--only", nargs="*", help="scenario names (without the ext-<split>- prefix)")
    ap.add_argument("--size", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="steps of every run (events scale with it)")
    ap.add_argument("--every", type=int, default=1, help="the agent's reporting interval")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--relabel", action="store_true", help="label the fixtures already in --out again, train nothing")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.relabel:
        for split in ("tune", "heldout"):
            folder = args.out / split
            runs = {}
            for path in sorted(folder.glob("*.json.gz")):
                data = json.loads(gzip.decompress(path.read_bytes()))
                runs[data["name"]] = data
            label_split(runs)
            for name, data in runs.items():
                write_fixture(folder / f"{name}.json.gz", data)
                print(f"{split}/{name}: {data['labels']['failure']}")
        return 0
    sets = scenarios()
    for split in ("tune", "heldout"):
        if args.split not in (split, "all"):
            continue
        runs = {}
        for sc in sets[split]:
            short = sc.name.split("-", 2)[2]
            if args.only and short not in args.only:
                continue
            sc.size = args.size
            if args.steps:
                scale = args.steps / sc.steps
                sc.steps, sc.warmup = args.steps, int(sc.warmup * scale)
                sc.at = None if sc.at is None else int(sc.at * scale)
                sc.length = int(sc.length * scale)
            if args.list:
                print(split, sc)
                continue
            runs[sc.name] = run_one(sc, split, args.device, args.every)
        if not runs:
            continue
        folder = args.out / split
        for path in folder.glob("*.json.gz") if args.only else ():  # labels need the split's other runs
            data = json.loads(gzip.decompress(path.read_bytes()))
            runs.setdefault(data["name"], data)
        label_split(runs)
        for name, data in runs.items():
            size = write_fixture(folder / f"{name}.json.gz", data)
            print(f"{split}/{name}: {data['labels']['failure']}, {size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
