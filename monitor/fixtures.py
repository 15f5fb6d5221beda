"""The labelled-run corpus (tests/fixtures/runs/**/<name>.json.gz), written by scripts/make_fixtures.py.

A fixture is one real training run (of our trainer, or of bench/corpus/ for tests/fixtures/corpus) as exported
from the monitor:
``{"name", "config" (the trainer arguments), "labels": {"diverged", "divergence_step", "rule", "outcome"},
"split": "tune" | "test", "profile": "cpu" | "gpu", "expect": "stable" | "diverging", "batches": [wire-format
ingest batch dicts]}``; `labels` may also hold "failure" ({"kind", "step", "recovered"}, monitor.failures),
which `Fixture.failure` reads. The batches replay through POST /api/v1/ingest or `RunPredictor.observe`.

Outcome (`Fixture.outcome`): "diverged" when the divergence rule fired; else "censored" when the run was
trained with settings chosen to make it diverge (`expect` "diverging") and had not diverged by its last
step: its fate is unknown, so it is neither a stable run (alerts on it are not false alerts) nor a diverging
one (it has no divergence step); else "stable" (a run at a sane learning rate that did not diverge). A run
that diverged before `EARLY_BEFORE` is an "early" failure: no monitor that first needs to learn the run's
normal can warn it 100 steps ahead (the predictors' warm-up is 60 steps), so it is reported apart as well.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from fp8mon.monitor import failures
from fp8mon.monitor.failures import Failure
from fp8mon.monitor.predictors.params import PredictorParams

TARGET_LEAD = 100  # steps of warning before the divergence step (SPEC section 7)
# a run diverging earlier cannot be warned TARGET_LEAD steps ahead by predictors that first learn its normal
EARLY_BEFORE = TARGET_LEAD + PredictorParams.warmup_steps
FIXTURE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "runs"
# Files kept under FIXTURE_DIR for another test but no longer part of the labelled corpus (fixture_paths skips
# them): cpu-fog-fp8-ramp (a learning-rate ramp of the first corpus, batch 4 x 64) feeds
# tests/web/test_dashboard.py, which names it.
RETIRED = frozenset({"cpu-fog-fp8-ramp.json.gz"})


@dataclass
class Fixture:
    name: str
    config: dict
    diverged: bool
    divergence_step: int | None
    rule: str
    batches: list[dict]
    split: str = "test"  # "tune": used to choose the thresholds; "test": held out
    profile: str = "cpu"
    path: Path | None = None
    extra: dict = field(default_factory=dict)
    labels_failure: dict | None = None  # labels["failure"], where the corpus stores one

    @property
    def outcome(self) -> str:
        """"diverged" | "early" | "stable" | "censored" (see the module docstring)."""
        if self.diverged:
            return "early" if self.divergence_step < EARLY_BEFORE else "diverged"
        return "censored" if self.extra.get("expect") == "diverging" else "stable"

    @cached_property
    def failure(self) -> Failure:
        """What failed and when (monitor.failures): the stored label of a corpus that has one (the stall and
        quality-gap rules need the healthy runs it was labelled with), else the rules on the losses alone."""
        stored = self.labels_failure
        if stored:
            return Failure.from_dict(stored)
        return failures.label(self.losses(), nonfinite_at=self.first_nonfinite_grad_norm())

    @property
    def stable(self) -> bool:
        return self.outcome == "stable"

    @property
    def early(self) -> bool:
        return self.outcome == "early"

    @property
    def censored(self) -> bool:
        return self.outcome == "censored"

    def losses(self) -> list[tuple[int, float]]:
        """(step, loss) of every logged step, rank 0 (or the reduced rank -1), in step order."""
        return losses_of(self.batches)

    def first_nonfinite_grad_norm(self) -> int | None:
        for step, name, value, _ in scalars_of(self.batches):
            if name == "grad_norm" and value is not None and not math.isfinite(value):
                return step
        return None

    def last_step(self) -> int:
        return max(step for step, _ in self.losses())


def scalars_of(batches: list[dict]):
    """(step, name, value, rank) of every scalar of wire-format ingest batches, in order (a block may give one step
    or one rank for all its scalars)."""
    for batch in batches:
        block = batch.get("scalars")
        if not block:
            continue
        n = len(block["name"])
        steps = block["step"] if isinstance(block["step"], list) else [block["step"]] * n
        ranks = block.get("rank", 0)
        ranks = ranks if isinstance(ranks, list) else [ranks] * n
        yield from zip(steps, block["name"], block["value"], ranks)


def losses_of(batches: list[dict]) -> list[tuple[int, float]]:
    """(step, loss) of every logged step of `batches`, rank 0 (or the reduced rank -1), in step order."""
    out = {step: float(value) for step, name, value, rank in scalars_of(batches)
           if name == "loss" and rank in (0, -1) and value is not None}
    return sorted(out.items())


def fixture_paths(root: Path | str | None = None, profile: str | None = None) -> list[Path]:
    """Every fixture file under `root` (default: the repository's corpus), sorted; `profile` "cpu" keeps
    the files directly in the root, "gpu" those under gpu/. Files named in RETIRED are not part of it."""
    root = Path(root) if root is not None else FIXTURE_DIR
    paths = sorted(p for p in root.rglob("*.json.gz") if p.name not in RETIRED)
    if profile == "cpu":
        paths = [p for p in paths if p.parent == root]
    elif profile == "gpu":
        paths = [p for p in paths if p.parent.name == "gpu"]
    return paths


def load_fixture(path: Path | str) -> Fixture:
    path = Path(path)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    labels = data["labels"]
    known = {"name", "config", "labels", "batches", "split", "profile"}
    return Fixture(name=data["name"], config=data.get("config", {}), diverged=bool(labels["diverged"]),
                   divergence_step=labels.get("divergence_step"), rule=labels.get("rule", ""),
                   batches=data["batches"], split=data.get("split", "test"), profile=data.get("profile", "cpu"),
                   path=path, extra={k: v for k, v in data.items() if k not in known},
                   labels_failure=labels.get("failure"))


def write_fixture(path: Path | str, data: dict) -> int:
    """Write a fixture dict gzipped (deterministic bytes: no timestamp); returns the file size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(data, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(raw, compresslevel=9, mtime=0))
    return path.stat().st_size
