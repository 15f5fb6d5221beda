"""Results as data: every figure a benchmark prints can be appended as one CSV row to ``bench/results/<bench>.csv``.

Columns: date (UTC, ISO 8601), gpu (the device's name, or ``cpu``), commit (``git rev-parse --short HEAD``, with
``+dirty`` when the tree has uncommitted changes), command (the command line as run), metric, value, unit.

    from bench.record import Recorder
    rec = Recorder("agent_overhead")          # bench/results/agent_overhead.csv
    rec.add("overhead_median_pct/124m/fp8", 0.71, "%")
    rec.write()                               # appends; --no-record in a bench's arguments skips it
"""

from __future__ import annotations

import csv
import datetime as _dt
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COLUMNS = ("date", "gpu", "commit", "command", "metric", "value", "unit")


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _gpu() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


class Recorder:
    """Collects one benchmark run's figures and appends them to its CSV file."""

    def __init__(self, bench: str, *, command: str | None = None, gpu: str | None = None):
        self.path = RESULTS_DIR / f"{bench}.csv"
        self.command = command or "python3 " + shlex.join(["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]])
        self.gpu = gpu
        self.rows: list[dict] = []

    def add(self, metric: str, value: float, unit: str = "") -> None:
        self.rows.append({"metric": metric, "value": f"{value:.6g}", "unit": unit})

    def write(self) -> Path:
        date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        common = {"date": date, "gpu": self.gpu or _gpu(), "commit": _commit(), "command": self.command}
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            for row in self.rows:
                writer.writerow({**common, **row})
        print(f"{len(self.rows)} rows appended to {self.path}", file=sys.stderr)
        return self.path
