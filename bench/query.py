"""Query benchmark: a layer x step heatmap over 100 layers x 100k steps (SPEC section 7: <= 200 ms).

For each database (a fresh SQLite file, and PostgreSQL when --database-url is given: a fresh schema that
is dropped afterwards) it
  1. fills one run with --layers layers x --steps steps of one site (rows generated inside the
     database with INSERT ... SELECT, --stats statistics per row; one spike and one NaN planted),
  2. runs the rollup compactor synchronously (SqlAlchemyStore.compact),
  3. times, in process (the store's queries): the heatmap over the whole range (default max_points 1000,
     agg max) and a long series query (one layer, whole range),
  4. times the same heatmap and series through the real HTTP endpoint: `fp8mon serve` in a subprocess,
     requests with httpx (keep-alive),
and prints p50/p95 in milliseconds. It checks that the spike and the NaN are visible in the heatmap.
The figures are appended to bench/results/query.csv (bench.record) unless --no-record is given.

    python bench/query.py
    python bench/query.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, insert, text

if __package__ in (None, ""):  # run as `python bench/query.py`: bench.record from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import Recorder  # noqa: E402
from fp8mon.agent.wire import TENSOR_STATS  # noqa: E402
from fp8mon.monitor.localserver import ServerProcess  # noqa: E402
from fp8mon.monitor.migrate import upgrade  # noqa: E402
from fp8mon.monitor.models import Run  # noqa: E402
from fp8mon.monitor.storage import SqlAlchemyStore as Store  # noqa: E402
from fp8mon.monitor.storage.engine import create_db_engine, normalise_url  # noqa: E402

RUN = "bench-heatmap"
SITE = "input"
DEFAULT_STATS = ("amax", "rms", "kurtosis", "underflow_frac")


def percentiles(samples: list[float]) -> str:
    a = np.array(samples) * 1000
    return f"p50 {np.percentile(a, 50):6.1f} ms  p95 {np.percentile(a, 95):6.1f} ms  (n={len(a)})"


WARMUP = 2


def timed(fn, repeat: int) -> tuple[list[float], object]:
    result = None
    for _ in range(WARMUP):
        result = fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t0)
    return samples, result


def fill(store: Store, layers: int, steps: int, stats: tuple[str, ...], chunk_steps: int) -> dict:
    """Run + catalogue rows, then layers x steps statistic rows generated inside the database (random values
    0..1 + j for the j-th statistic) in step-major chunks; then one spike (1e6) and one NaN planted."""
    now = datetime.now(UTC)
    rng = np.random.default_rng(0)
    spike = (int(rng.integers(layers)), int(rng.integers(steps)))
    nan_at = (int(rng.integers(layers)), int(rng.integers(steps)))
    with store.engine.begin() as conn:
        run_id = conn.execute(insert(Run).values(name=RUN, status="running", config={}, tags={}, created_at=now,
                                                 started_at=now, last_seen_at=now, rollup_until=0, first_step=0,
                                                 last_step=steps - 1).returning(Run.id)).scalar_one()
        for i in range(layers):
            conn.execute(text("INSERT INTO tensor_series (run_id, layer, site, ordinal) VALUES (:r, :l, :s, :o)"),
                         {"r": run_id, "l": layer_name(i), "s": SITE, "o": i})
        sids = list(conn.execute(text("SELECT id FROM tensor_series WHERE run_id = :r ORDER BY ordinal"),
                                 {"r": run_id}).scalars())
    t0 = time.perf_counter()
    cols = ", ".join(stats)
    if store.dialect == "sqlite":
        values = ", ".join(f"abs(random() % 1000000) / 1e6 + {j}" for j in range(len(stats)))
        sql = (f"WITH RECURSIVE g(step) AS (SELECT :lo UNION ALL SELECT step + 1 FROM g WHERE step + 1 < :hi) "
               f"INSERT INTO tensor_stats (series_id, rank, step, {cols}) SELECT s.id, 0, g.step, {values} "
               f"FROM g CROSS JOIN tensor_series s WHERE s.run_id = :run ORDER BY g.step, s.id")
    else:
        values = ", ".join(f"random() + {j}" for j in range(len(stats)))
        sql = (f"INSERT INTO tensor_stats (series_id, rank, step, {cols}) SELECT s.id, 0, g.step, {values} "
               f"FROM generate_series(CAST(:lo AS BIGINT), CAST(:hi AS BIGINT) - 1) g(step) "
               f"CROSS JOIN tensor_series s WHERE s.run_id = :run ORDER BY g.step, s.id")
    for lo in range(0, steps, chunk_steps):
        with store.engine.begin() as conn:
            conn.execute(text(sql), {"lo": lo, "hi": min(steps, lo + chunk_steps), "run": run_id})
    nan = "'NaN'" if store.dialect == "sqlite" else "CAST('NaN' AS DOUBLE PRECISION)"
    with store.engine.begin() as conn:
        for (row, step), value in ((spike, "1e6"), (nan_at, nan)):
            conn.execute(text(f"UPDATE tensor_stats SET {stats[0]} = {value} WHERE series_id = :sid AND rank = 0 "
                              f"AND step = :step"), {"sid": sids[row], "step": step})
    return {"run_id": run_id, "sids": sids, "spike": spike, "nan": nan_at, "fill_s": time.perf_counter() - t0}


def layer_name(i: int) -> str:
    return f"blocks.{i // 4}.{('attn.qkv', 'attn.out', 'mlp.fc1', 'mlp.fc2')[i % 4]}"


TARGET_MS = 200.0


def line(name: str, samples: list[float], note: str, target: bool = False, rec: Recorder | None = None,
         metric: str = "") -> None:
    """Print a timing's p50/p95; with `rec`, record them as rows `<metric>_p50/<database>` and `_p95`, `metric`
    being "<name>/<database>" (the names of bench/results/query.csv)."""
    if rec is not None:
        a = np.array(samples) * 1000
        name, _, database = metric.partition("/")
        rec.add(f"{name}_p50/{database}", float(np.percentile(a, 50)), "ms")
        rec.add(f"{name}_p95/{database}", float(np.percentile(a, 95)), "ms")
    verdict = ""
    if target:
        p95 = float(np.percentile(np.array(samples) * 1000, 95))
        verdict = f"   [target {TARGET_MS:.0f} ms: {'met' if p95 <= TARGET_MS else 'MISSED'} at p95]"
    print(f"{name:<24}{percentiles(samples)}   {note}{verdict}", flush=True)


def bench(label: str, url: str, args, workdir: Path, rec: Recorder) -> None:
    """Fill, compact and time one database; its figures go to `rec`."""
    print(f"\n=== {label}: {args.layers} layers x {args.steps} steps, statistics {','.join(args.stats)} ===",
          flush=True)
    engine = create_db_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store(url)
    try:
        info = fill(store, args.layers, args.steps, args.stats, args.chunk_steps)
        rows = args.layers * args.steps
        print(f"{'fill':<24}{info['fill_s']:7.1f} s   {rows / info['fill_s'] / 1e3:5.0f} k rows/s "
              f"({rows / 1e6:.0f} M rows)", flush=True)
        rec.add(f"fill_rows_per_s/{label}", rows / info["fill_s"], "rows/s")
        report = store.compact()
        rec.add(f"compact_rows_per_s/{label}", rows / report.seconds, "rows/s")
        print(f"{'compact (all levels)':<24}{report.seconds:7.1f} s   {rows / report.seconds / 1e3:5.0f} k rows/s "
              f"({report.chunks} transactions, {report.buckets} buckets)", flush=True)
        if store.dialect == "postgresql":
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM ANALYZE"))
        stat = args.stats[0]
        layer = layer_name(info["spike"][0])
        print(f"(load average {os.getloadavg()[0]:.1f}; timings after {WARMUP} warm-up calls)", flush=True)

        samples, h = timed(lambda: store.heatmap(RUN, stat=stat, site=SITE, max_points=args.max_points).to_dict(),
                           args.repeat)
        _check(h, info)
        shape = f"{len(h['layers'])} x {len(h['edges']) - 1} cells of {h['bucket_width']} steps"
        line("heatmap agg=max", samples, f"in process, {shape}", target=True, rec=rec, metric=f"heatmap/{label}")
        samples, _ = timed(lambda: store.heatmap(RUN, stat=stat, site=SITE, max_points=args.max_points,
                                                   agg="last").to_dict(), args.repeat)
        line("heatmap agg=last", samples, "in process", target=True, rec=rec, metric=f"heatmap_last/{label}")
        samples, s = timed(lambda: store.series(RUN, stat=stat, layer=layer, site=SITE,
                                                  max_points=args.max_points).to_dict(), args.repeat)
        line("series (one layer)", samples, f"in process, {len(s['points']['step'])} buckets of "
                                            f"{s['bucket_width']} steps with min/max/mean/last",
             rec=rec, metric=f"series/{label}")
        server = ServerProcess(url, env={"FP8MON_ROLLUP_INTERVAL_S": "0"}, log=workdir / f"server-{label}.log")
        server.start(timeout=60)
        try:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                params = {"stat": stat, "site": SITE, "max_points": args.max_points}
                samples, r = timed(lambda: client.get(f"/api/v1/runs/{RUN}/heatmap", params=params), args.repeat)
                assert r.status_code == 200, r.text
                _check(r.json(), info)
                line("HTTP GET .../heatmap", samples, f"{len(r.content) / 1e3:.0f} kB of JSON", target=True, rec=rec,
                     metric=f"heatmap_http/{label}")
                params = {"stat": stat, "layer": layer, "site": SITE, "max_points": args.max_points}
                samples, r = timed(lambda: client.get(f"/api/v1/runs/{RUN}/series", params=params), args.repeat)
                assert r.status_code == 200, r.text
                line("HTTP GET .../series", samples, f"{len(r.content) / 1e3:.0f} kB of JSON", rec=rec,
                     metric=f"series_http/{label}")
        finally:
            server.stop()
        print("(the planted spike and NaN are visible in the heatmap)", flush=True)
    finally:
        store.close()


def _check(h: dict, info: dict) -> None:
    edges = h["edges"]
    for (row, step), want in ((info["spike"], 1e6), (info["nan"], "NaN")):
        col = int(np.searchsorted(edges, step, side="right")) - 1
        got = h["values"][row][col]
        if want == "NaN":
            assert got == "NaN", f"NaN at layer {row} step {step} lost: {got}"
        else:
            assert got == want or got == "NaN", f"spike at layer {row} step {step} lost: {got}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", help="also bench PostgreSQL (a throwaway schema is created in it)")
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite run")
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--stats", type=lambda s: tuple(TENSOR_STATS if s == "all" else s.split(",")),
                        default=DEFAULT_STATS, help="comma-separated statistics to fill, or 'all' "
                                                    f"(default {','.join(DEFAULT_STATS)})")
    parser.add_argument("--max-points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--chunk-steps", type=int, default=10_000, help="steps per insert statement")
    parser.add_argument("--workdir", help="where the SQLite file goes (default: a temporary directory)")
    parser.add_argument("--no-record", action="store_true", help="do not append the figures to "
                                                                 "bench/results/query.csv")
    args = parser.parse_args(argv)
    unknown = [s for s in args.stats if s not in TENSOR_STATS]
    if unknown:
        parser.error(f"unknown statistics {unknown}")
    with tempfile.TemporaryDirectory(prefix="fp8mon-bench-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        print(f"fp8mon query bench; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
        rec = Recorder("query")
        if not args.no_sqlite:
            bench("sqlite", f"sqlite:///{workdir / 'bench.db'}", args, workdir, rec)
        if args.database_url:
            admin = create_engine(normalise_url(args.database_url), isolation_level="AUTOCOMMIT")
            schema = f"bench_{uuid.uuid4().hex[:10]}"
            with admin.connect() as conn:
                conn.execute(text(f"CREATE SCHEMA {schema}"))
            sep = "&" if "?" in args.database_url else "?"
            url = f"{normalise_url(args.database_url)}{sep}options=-csearch_path%3D{schema}"
            try:
                bench("postgresql", url, args, workdir, rec)
            finally:
                with admin.connect() as conn:
                    conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
                admin.dispose()
    if not args.no_record and rec.rows:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
