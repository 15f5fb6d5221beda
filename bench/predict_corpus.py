"""Score labelled corpora by failure kind (monitor.scoring, what `fp8mon eval` prints) at several reporting
intervals, and append the headline figures to bench/results/predict.csv (bench.record).

    python3 bench/predict_corpus.py tests/fixtures/corpus/heldout tests/fixtures/corpus/tune --every 1 10
    python3 bench/predict_corpus.py tests/fixtures/runs --every 1 10 --no-record

Each folder is scored on its own (a split is never mixed with another); its rows are named
`<folder>/every<N>/<figure>`, e.g. `heldout/every10/transient_resolved`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/predict_corpus.py`: bench.record from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import Recorder  # noqa: E402
from fp8mon.monitor.fixtures import fixture_paths, load_fixture  # noqa: E402
from fp8mon.monitor.scoring import format_report, score  # noqa: E402

FIGURES = (  # summary key, unit
    ("failing", "runs"), ("warned_100", "runs"), ("stable", "runs"), ("stable_alerts", "alerts"),
    ("baseline_stable_alerts", "alerts"), ("transient", "runs"), ("transient_resolved", "runs"),
    ("lead", "steps"), ("matched_lead", "steps"), ("baseline_lead", "steps"), ("ratio_matched", "ratio"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="corpus folders of fixtures, each scored apart")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 10], help="reporting intervals")
    parser.add_argument("--no-record", dest="record", action="store_false",
                        help="do not append the figures to bench/results/predict.csv")
    args = parser.parse_args(argv)
    rec = Recorder("predict")
    for folder in args.folders:
        fixtures = [load_fixture(p) for p in fixture_paths(folder)]
        if not fixtures:
            raise SystemExit(f"no fixtures under {folder}")
        for every in args.every:
            report = score(fixtures, every=every)
            print(format_report(report, title=f"# {folder}: {len(fixtures)} runs, reporting every {every} step(s)"))
            print()
            for key, unit in FIGURES:
                value = report.summary[key]
                if not (isinstance(value, float) and math.isinf(value)):  # a ratio over a zero baseline lead
                    rec.add(f"{folder.name}/every{every}/{key}", value, unit)
    if args.record:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
