"""ncu's text report as bench/RESULTS.md's table: one row per profiled kernel with its time, DRAM throughput, issue
rate, warp instructions, warps per scheduler (eligible), registers, and the time its instructions would take at one
instruction per scheduler per cycle (4 schedulers an SM, at the SM frequency ncu read). It needs the sections and the
metrics of ``bench/consumers.py``'s ``--ncu`` command (SpeedOfLight, SchedulerStats, LaunchStats and
``smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active``); a missing value prints as "?".
Where the driver printed a label right before each launch (``consumers.py --ncu`` does), each row is named by it.

    ncu ... python3 bench/consumers.py --ncu 124m > report.txt; python3 bench/ncu_table.py report.txt
"""

from __future__ import annotations

import argparse
import re
import sys

_KERNEL = re.compile(r"^  (\w+) \((\d+), 1, 1\)x\((\d+), 1, 1\)", re.M)
_METRICS = {"us": "Duration", "dram": "DRAM Throughput", "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
            "inst": "smsp__inst_executed.sum", "warps": "Active Warps Per Scheduler",
            "eligible": "Eligible Warps Per Scheduler", "regs": "Registers Per Thread", "ghz": "SM Frequency",
            "sms": "# SMs"}


def kernels(report: str) -> list[dict]:
    """Each profiled kernel's name, grid, block and the values of ``_METRICS`` (floats; None where absent)."""
    starts = list(_KERNEL.finditer(report))
    out = []
    for i, m in enumerate(starts):
        body = report[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(report)]
        row = {"name": m.group(1), "grid": int(m.group(2)), "block": int(m.group(3))}
        for key, metric in _METRICS.items():
            v = re.search(r"^\s*" + re.escape(metric) + r"\s+\S+\s+([\d,.]+)\s*$", body, re.M)
            row[key] = float(v.group(1).replace(",", "")) if v else None
        out.append(row)
    return out


def labels(report: str) -> list[str]:
    """The line the driver printed right before each launch ncu profiled (ncu's own lines start with ==)."""
    lines = report.splitlines()
    return [prev for prev, line in zip(lines, lines[1:])
            if line.startswith("==PROF== Profiling") and prev and not prev.startswith("==")]


def full_issue_us(row: dict) -> float | None:
    """The time of the kernel's warp instructions at one per scheduler per cycle."""
    if None in (row["inst"], row["ghz"], row["sms"]):
        return None
    return row["inst"] / (4 * row["sms"] * row["ghz"] * 1e3)


def table(report: str) -> str:
    rows = kernels(report)
    names = labels(report)
    if len(names) != len(rows):
        names = [f"{r['name']} ({r['grid']} x {r['block']})" for r in rows]

    def f(v, fmt):
        return "?" if v is None else format(v, fmt)

    lines = ["| kernel | µs | DRAM % of peak | issue slots busy | warp instructions | µs at full issue | "
             "warps per scheduler (eligible) | registers |", "|---|---|---|---|---|---|---|---|"]
    for name, r in zip(names, rows):
        inst = "?" if r["inst"] is None else f"{r['inst'] / 1e6:.1f} M"
        lines.append(f"| {name} | {f(r['us'], '.1f')} | {f(r['dram'], '.0f')} | {f(r['issue'], '.0f')}% | {inst} | "
                     f"{f(full_issue_us(r), '.1f')} | {f(r['warps'], '.1f')} ({f(r['eligible'], '.2f')}) | "
                     f"{f(r['regs'], '.0f')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", nargs="?", help="ncu's text output (default: standard input)")
    args = p.parse_args(argv)
    text = open(args.report, encoding="utf-8").read() if args.report else sys.stdin.read()
    print(table(text))


if __name__ == "__main__":
    main()
