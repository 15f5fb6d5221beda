"""`fp8mon eval`: replay labelled runs through the predictors and print how early they warned (monitor.scoring).

    fp8mon eval tests/fixtures/corpus/heldout                  # a corpus folder (fixtures, labels inside)
    fp8mon eval tests/fixtures/corpus/heldout --every 1 10     # as if the agent had reported every 10 steps too
    fp8mon eval --labels labels.json --database-url URL        # stored runs: {"run": {"kind", "step"}, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="fixture files (*.json.gz) or folders of them (default: none; see --labels)")
    parser.add_argument("--every", type=int, nargs="+", default=[1],
                        help="reporting intervals to score at: the runs' own (1) and subsampled ones")
    parser.add_argument("--split", choices=("tune", "test"), help="only the runs of this split")
    parser.add_argument("--labels", type=Path, help="JSON {run: {kind, step[, recovered]}} of stored runs to "
                                                    "score, read from --database-url")
    parser.add_argument("--database-url", help="SQLAlchemy URL of the stored runs (env FP8MON_DATABASE_URL)")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")


def _stored(labels_path: Path, database_url: str | None) -> list:
    from fp8mon.monitor.export import export_run
    from fp8mon.monitor.fixtures import Fixture
    from fp8mon.monitor.settings import Settings
    from fp8mon.monitor.storage import SqlAlchemyStore

    labels = json.loads(labels_path.read_text())
    url = database_url or Settings().database_url
    store = SqlAlchemyStore(url)
    try:
        out = []
        for run, label in labels.items():
            batches = export_run(store, run, hist=False)
            failed = label.get("kind") in ("blowup", "drift", "stall", "quality_gap")
            out.append(Fixture(name=run, config={}, diverged=failed, divergence_step=label.get("step") if failed
                               else None, rule="labels", batches=batches, labels_failure=label))
        return out
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    from fp8mon.monitor.fixtures import fixture_paths, load_fixture
    from fp8mon.monitor.scoring import format_report, score

    paths = []
    for p in args.paths:
        paths += [p] if p.is_file() else fixture_paths(p)
    fixtures = [load_fixture(p) for p in paths]
    if args.labels:
        from fp8mon.monitor.storage import NotFound

        try:
            fixtures += _stored(args.labels, args.database_url)
        except NotFound as exc:
            print(f"fp8mon eval: {exc.message}", file=sys.stderr)
            return 1
    if args.split:
        fixtures = [f for f in fixtures if f.split == args.split]
    if not fixtures:
        print("fp8mon eval: no labelled runs given", file=sys.stderr)
        return 2
    summaries = {}
    for every in args.every:
        report = score(fixtures, every=every)
        summaries[every] = report.summary
        if not args.json:
            print(format_report(report, title=f"# {len(fixtures)} runs, reporting every {every} step(s)"))
            print()
    if args.json:
        print(json.dumps(summaries, indent=2, default=str))
    return 0
