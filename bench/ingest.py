"""Ingest throughput: concurrent clients posting realistic batches to a real `fp8mon serve`.

Each client is a process that encodes its request bodies before the clock starts, then posts them one
at a time (like the agent) over a keep-alive connection until the duration is up. One batch is
K steps x (layers x 5 sites) records x 12 statistics, plus 3 scalars per step. Client i writes run
i % runs as rank i // runs, so clients that share a run never write the same key. Afterwards the
server is stopped and the database counted: values stored must equal values acknowledged.

    python bench/ingest.py                                  # SQLite
    python bench/ingest.py --sqlite-synchronous normal      # SQLite without an fsync per commit
    python bench/ingest.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/ingest.py --no-sqlite --database-url ... --clients 4 --workers 2 --steps 10 --gzip

For PostgreSQL the database in the URL gets a fresh schema, dropped afterwards. The figures of every
measurement are appended to bench/results/ingest.csv (bench.record) unless --no-record is given.
"""

import argparse
import gzip
import http.client
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np

if __package__ in (None, ""):  # run as `python bench/ingest.py`: bench.record from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import Recorder  # noqa: E402
from fp8mon.agent.wire import CLIENT_HEADER  # noqa: E402
from fp8mon.monitor.localserver import ServerProcess  # noqa: E402

STATS = ("amax", "rms", "mean", "std", "kurtosis", "kurtosis_central", "crest", "underflow_frac",
         "overflow_frac", "outlier_frac", "zero_frac", "scale")
SITES = ("input", "weight", "output", "grad_output", "grad_weight")
SCALARS = ("loss", "grad_norm", "lr")
MODULES = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")


# -- request bodies ---------------------------------------------------------------------------------

def layer_names(n: int) -> list[str]:
    return [f"model.blocks.{i // len(MODULES)}.{MODULES[i % len(MODULES)]}" for i in range(n)]


def make_body(run: str, rank: int, index: int, steps: int, layers: list[str], rng) -> tuple[bytes, int, int]:
    """One encoded batch and its (records, values)."""
    per_step = len(layers) * len(SITES)
    n = steps * per_step
    first = index * steps
    amax = rng.lognormal(0.0, 1.0, n)
    rms = amax * rng.uniform(0.05, 0.3, n)
    stats = {
        "amax": amax, "rms": rms, "mean": rng.normal(0.0, 0.01, n), "std": rms,
        "kurtosis": rng.lognormal(1.2, 0.3, n), "kurtosis_central": rng.lognormal(1.2, 0.3, n),
        "crest": amax / rms, "underflow_frac": rng.uniform(0, 1e-3, n), "overflow_frac": np.zeros(n),
        "outlier_frac": rng.uniform(0, 1e-4, n), "zero_frac": rng.uniform(0, 1e-2, n),
        "scale": 448.0 / amax,
    }
    body = {
        "version": 1,
        "batch_id": f"{run}-r{rank}-b{index}",
        "run": run,
        "tensors": {
            "step": np.repeat(np.arange(first, first + steps), per_step).tolist(),
            "layer": [layer for layer in layers for _ in SITES] * steps,
            "site": list(SITES) * (len(layers) * steps),
            "rank": rank,
            "stats": {name: column.tolist() for name, column in stats.items()},
        },
        "scalars": {
            "step": np.repeat(np.arange(first, first + steps), len(SCALARS)).tolist(),
            "name": list(SCALARS) * steps,
            "value": rng.lognormal(0.0, 1.0, steps * len(SCALARS)).tolist(),
            "rank": rank,
        },
    }
    return msgpack.packb(body), n, n * len(STATS) + steps * len(SCALARS)


# -- clients ----------------------------------------------------------------------------------------

def client(index: int, args, port: int, n_bodies: int, ready, start, results) -> None:
    run, rank = f"bench-run-{index % args.runs}", index // args.runs
    rng = np.random.default_rng(index)
    layers = layer_names(args.layers)
    bodies = []
    for i in range(n_bodies):
        body, records, values = make_body(run, rank, i, args.steps, layers, rng)
        bodies.append((gzip.compress(body, compresslevel=1) if args.gzip else body, records, values))
    headers = {"content-type": "application/msgpack", CLIENT_HEADER: "bench"}
    if args.gzip:
        headers["content-encoding"] = "gzip"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    ready.put(index)
    t0, deadline = start.get()
    while time.time() < t0:
        time.sleep(0.0005)
    out = {"requests": 0, "records": 0, "values": 0, "latencies": [], "errors": {}, "duplicates": 0,
           "ran_out": False, "end": None}
    cpu0 = time.process_time()
    for body, records, values in bodies:
        if time.time() >= deadline:
            break
        t = time.perf_counter()
        try:
            conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            out["errors"][type(exc).__name__] = out["errors"].get(type(exc).__name__, 0) + 1
            conn.close()
            continue
        out["latencies"].append(time.perf_counter() - t)
        out["requests"] += 1
        if response.status != 200:
            out["errors"][str(response.status)] = out["errors"].get(str(response.status), 0) + 1
            continue
        reply = json.loads(payload)
        out["duplicates"] += reply["duplicate"]
        out["records"] += reply["tensor_records"]
        out["values"] += reply["values"]
        if reply["values"] != values or reply["tensor_records"] != records:
            out["errors"]["miscounted"] = out["errors"].get("miscounted", 0) + 1
    else:
        out["ran_out"] = True
    out["end"] = time.time()
    out["cpu"] = time.process_time() - cpu0
    results.put(out)


# -- server and database ----------------------------------------------------------------------------

def fp8mon_command() -> list[str]:
    exe = shutil.which("fp8mon")
    return [exe] if exe else [sys.executable, "-m", "fp8mon"]


class Database:
    """A fresh, migrated database: a SQLite file in a temporary folder, or a new PostgreSQL schema."""

    def __init__(self, backend: str, pg_url: str | None, sqlite_synchronous: str = "full"):
        from sqlalchemy import create_engine, text

        from fp8mon.monitor.storage.engine import normalise_url
        self.backend = backend
        if backend == "sqlite":
            self.tmp = tempfile.mkdtemp(prefix="fp8mon-bench-")
            self.url = f"sqlite:///{self.tmp}/bench.db?synchronous={sqlite_synchronous}"
        else:
            self.schema = f"bench_{uuid.uuid4().hex[:10]}"
            self.admin = create_engine(normalise_url(pg_url), isolation_level="AUTOCOMMIT")
            with self.admin.connect() as conn:
                conn.execute(text(f"create schema {self.schema}"))
            sep = "&" if "?" in pg_url else "?"
            self.url = f"{normalise_url(pg_url)}{sep}options=-csearch_path%3D{self.schema}"
        subprocess.run([*fp8mon_command(), "db", "upgrade", "--database-url", self.url], check=True,
                       stdout=subprocess.DEVNULL)

    def count(self) -> tuple[int, int, int]:
        """(batches, tensor records, statistic values) stored."""
        from sqlalchemy import text

        from fp8mon.agent.wire import TENSOR_STATS
        from fp8mon.monitor.storage.engine import create_db_engine
        engine = create_db_engine(self.url)
        try:
            with engine.connect() as conn:
                batches = conn.execute(text("select count(*) from ingest_batches")).scalar_one()
                counts = ", ".join(f"count({name})" for name in TENSOR_STATS)
                row = conn.execute(text(f"select count(*), {counts} from tensor_stats")).one()
                scalars = conn.execute(text("select count(value) from scalars")).scalar_one()
        finally:
            engine.dispose()
        return batches, row[0], sum(row[1:]) + scalars

    def drop(self) -> None:
        from sqlalchemy import text
        if self.backend == "sqlite":
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            with self.admin.connect() as conn:
                conn.execute(text(f"drop schema {self.schema} cascade"))
            self.admin.dispose()


def start_server(url: str, workers: int) -> ServerProcess:
    server = ServerProcess(url, args=("--workers", str(workers))).start(timeout=60)
    # --workers N: wait until every worker process has started its application.
    time.sleep(0.5 + 0.5 * workers if workers > 1 else 0.2)
    return server


def cpu_seconds(pids: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of each process still alive."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two samples, over the processes alive at the second one."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def process_tree(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def postgres_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "postgres":
                        pids.add(int(entry))
            except OSError:
                pass
    return pids


def machine_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


# -- one measurement --------------------------------------------------------------------------------

def measure(backend: str, args) -> dict:
    db = Database(backend, args.database_url, args.sqlite_synchronous)
    server = start_server(db.url, args.workers)
    port = server.port
    try:
        values_per_batch = args.steps * len(args.layer_names) * len(SITES) * len(STATS)
        n_bodies = math.ceil(args.duration * args.max_rate / values_per_batch / args.clients) + 2
        ctx = mp.get_context("fork")
        ready, start, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=client, args=(i, args, port, n_bodies, ready, start, results))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=600)
        pids = process_tree(server.proc.pid)
        t0 = time.time() + 0.2
        for _ in procs:
            start.put((t0, t0 + args.duration))
        time.sleep(0.2)
        pg = postgres_pids() if backend == "postgresql" else set()
        cpu0, pg0, busy0 = cpu_seconds(pids), cpu_seconds(pg), machine_busy()
        outs = [results.get(timeout=args.duration + 600) for _ in procs]
        pg = postgres_pids() if backend == "postgresql" else set()
        cpu1, pg1, busy1 = cpu_seconds(pids), cpu_seconds(pg), machine_busy()
        for p in procs:
            p.join()
    finally:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    try:
        stored_batches, stored_records, stored_values = db.count()
    finally:
        db.drop()
    elapsed = max(o["end"] for o in outs) - t0
    latencies = sorted(x for o in outs for x in o["latencies"])
    acked = sum(o["values"] for o in outs)
    ok = sum(o["requests"] for o in outs) - sum(sum(o["errors"].values()) for o in outs)
    errors: dict = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "backend": backend, "elapsed": elapsed,
        "requests_s": sum(o["requests"] for o in outs) / elapsed,
        "records_s": sum(o["records"] for o in outs) / elapsed,
        "values_s": acked / elapsed,
        "p50": latencies[len(latencies) // 2] * 1e3 if latencies else float("nan"),
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3 if latencies else float("nan"),
        "acked": acked, "stored": stored_values, "acked_batches": ok, "stored_batches": stored_batches,
        "errors": errors, "duplicates": sum(o["duplicates"] for o in outs),
        "ran_out": sum(o["ran_out"] for o in outs),
        "server_cpu": cpu_used(cpu0, cpu1) / elapsed, "pg_cpu": cpu_used(pg0, pg1) / elapsed,
        "client_cpu": sum(o["cpu"] for o in outs) / elapsed,
        "db_cpu": max(1e-9, (cpu_used(cpu0, cpu1) + cpu_used(pg0, pg1)) / elapsed),
        "machine": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]) * os.cpu_count(),
    }


def record(rec: Recorder, backend: str, r: dict, good: bool) -> None:
    """One measurement's printed figures as rows `<figure>/<backend>` (the names of bench/results/ingest.csv)."""
    for name, value, unit in (("values_per_s", r["values_s"], "values/s"),
                              ("records_per_s", r["records_s"], "records/s"),
                              ("requests_per_s", r["requests_s"], "req/s"), ("latency_p50", r["p50"], "ms"),
                              ("latency_p99", r["p99"], "ms"), ("server_cpu", 100 * r["server_cpu"], "% of a core"),
                              ("pg_cpu", 100 * r["pg_cpu"], "% of a core"),
                              ("client_cpu", 100 * r["client_cpu"], "% of a core"),
                              ("machine_cpu", 100 * r["machine"], "% of a core"),
                              ("values_per_cpu_s", r["values_s"] / r["db_cpu"], "values/cpu-s"),
                              ("stored_equals_acked", float(good), "bool")):
        rec.add(f"{name}/{backend}", value, unit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="also (or with --no-sqlite: only) benchmark this PostgreSQL database")
    parser.add_argument("--no-sqlite", action="store_true", help="skip SQLite")
    parser.add_argument("--sqlite-synchronous", choices=["full", "normal"], default="full",
                        help="SQLite's synchronous pragma (the server's default: full)")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default 1)")
    parser.add_argument("--steps", type=int, default=10, help="steps per batch, K (default 10)")
    parser.add_argument("--layers", type=int, default=64, help="layers, 5 sites each (default 64)")
    parser.add_argument("--runs", type=int, default=2, help="runs the clients write to (default 2)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of posting (default 10)")
    parser.add_argument("--gzip", action="store_true", help="gzip the bodies (level 1, as the agent does)")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per database (default 1)")
    parser.add_argument("--max-rate", type=float, default=6e6,
                        help="values/s the pre-encoded bodies must last for (default 6e6)")
    parser.add_argument("--no-record", action="store_true", help="do not append the figures to "
                                                                 "bench/results/ingest.csv")
    args = parser.parse_args(argv)
    args.layer_names = layer_names(args.layers)
    backends = ([] if args.no_sqlite else ["sqlite"]) + (["postgresql"] if args.database_url else [])
    if not backends:
        parser.error("nothing to run: --no-sqlite without --database-url")

    per_batch = args.steps * args.layers * len(SITES)
    print(f"{args.clients} clients, {args.workers} worker(s), {args.runs} runs, batch = {args.steps} steps x "
          f"{args.layers * len(SITES)} records x {len(STATS)} stats = {per_batch * len(STATS):,} values, "
          f"msgpack{'+gzip' if args.gzip else ''}, {args.duration:g} s each, {os.cpu_count()} CPUs")
    header = (f"{'database':10s} {'values/s':>11s} {'records/s':>10s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} "
              f"{'stored=acked':>13s} {'server':>7s} {'pg':>5s} {'clients':>7s} {'machine':>7s} {'values/cpu-s':>12s}")
    print(header)
    print("-" * len(header))
    failed = False
    rec = Recorder("ingest")
    for backend in backends:
        rates = []
        for _ in range(args.repeat):
            r = measure(backend, args)
            good = (r["stored"] == r["acked"] and r["stored_batches"] == r["acked_batches"]
                    and not r["errors"] and not r["duplicates"])
            failed |= not good
            rates.append(r["values_s"])
            check = "yes" if good else "NO"
            print(f"{backend:10s} {r['values_s']:11,.0f} {r['records_s']:10,.0f} {r['requests_s']:7.1f} "
                  f"{r['p50']:7.1f} {r['p99']:7.1f} {check:>13s} {r['server_cpu']:6.0%} {r['pg_cpu']:5.0%} "
                  f"{r['client_cpu']:7.0%} {r['machine']:7.0%} {r['values_s'] / r['db_cpu']:12,.0f}",
                  flush=True)
            if not good:
                print(f"  acknowledged {r['acked']:,} values in {r['acked_batches']} batches, stored "
                      f"{r['stored']:,} in {r['stored_batches']}; errors {r['errors']}, duplicates {r['duplicates']}")
            if r["ran_out"]:
                print(f"  {r['ran_out']} client(s) ran out of pre-encoded bodies: raise --max-rate")
            record(rec, backend, r, good)
        if args.repeat > 1:
            print(f"{backend:10s} median {statistics.median(rates):,.0f} values/s, min {min(rates):,.0f}, "
                  f"max {max(rates):,.0f}")
    print("CPU columns: share of one core (200% = both cores of a 2-core machine); pg: all postgres processes;\n"
          "machine: everything on the machine; values/cpu-s: values per CPU-second of server + pg.")
    if not args.no_record and rec.rows:
        rec.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
