"""Dashboard targets (SPEC section 7, issue 49), measured in a real headless Chromium against `fp8mon serve`:

  first render of a run view ≤ 1 s   navigation to /?run=<run> until its loss chart and its heatmap are drawn, in a
                                     fresh browser context (plotly.js downloaded and parsed: "cold") and on reloads
                                     (plotly.js from the browser's cache: "warm"); the run has --layers x --steps
  heatmap switch ≤ 150 ms            another statistic picked in the heatmap's selector until the new map is drawn
                                     (request, server query, JSON, plotly), on the same run; each statistic's first
                                     switch, then again (answers revalidated: 304); of which the request (resource
                                     timing) and the drawing (heatmap.js's performance measure)
  idle tab ≤ 50 KB per 30 s          bytes received and sent (headers included, from the DevTools protocol) by a tab
                                     left on the run view with the default 5 s refresh, over --idle-seconds
  worst run in one click             of --runs runs, the worst (critical alerts, among the oldest) is first in the
                                     list after one choice in the landing page's sort selector

The database is a fresh SQLite file (or --database-url). The big run is written inside the database as in
bench/query.py, then compacted; the fleet through the store. The figures are appended to
bench/results/dashboard.csv (bench/record.py) unless --no-record is given.

    python bench/dashboard.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/dashboard.py`: bench.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.query import RUN, fill  # noqa: E402
from bench.record import Recorder  # noqa: E402
from fp8mon.monitor.alerting.lifecycle import Alert  # noqa: E402
from fp8mon.monitor.localserver import ServerProcess  # noqa: E402
from fp8mon.monitor.migrate import upgrade  # noqa: E402
from fp8mon.monitor.storage import SqlAlchemyStore  # noqa: E402
from fp8mon.monitor.storage.engine import create_db_engine  # noqa: E402
from fp8mon.monitor.storage.entities import AlertWrite  # noqa: E402
from fp8mon.monitor.wire import IngestBatch  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
STATS = ("kurtosis", "amax", "rms", "underflow_frac")
WORST = "old-diverged"
TARGETS = {"first_render_warm_ms": 1000, "heatmap_switch_p50_ms": 150, "idle_bytes_30s": 50_000}


# -- data ------------------------------------------------------------------------------------------


def fill_big_run(store: SqlAlchemyStore, layers: int, steps: int) -> None:
    fill(store, layers, steps, STATS, chunk_steps=2000)
    every = list(range(steps))
    for name, value in (("loss", lambda s: 3.0 - s / steps), ("grad_norm", lambda s: 1.0)):
        store.ingest(IngestBatch.model_validate({
            "version": 1, "batch_id": f"bench-{name}", "run": RUN,
            "scalars": {"step": every, "name": [name] * steps, "value": [value(s) for s in every]}}))
    store.compact()


def fill_fleet(store: SqlAlchemyStore, runs: int) -> None:
    """`runs` one-step runs, oldest first; the third is the worst (five critical alerts firing); the newest
    300 have four info alerts each (the most recently updated alerts)."""
    names = [f"run-{i:04d}" for i in range(runs)]
    names[2] = WORST

    def add(name: str) -> int:
        return store.ingest(IngestBatch.model_validate({
            "version": 1, "batch_id": f"fleet-{name}", "run": name,
            "scalars": {"step": [0], "name": ["loss"], "value": [1.0]}})).run_id

    ids = {name: add(name) for name in names}  # one by one: creation order is the listing's order
    plans = {WORST: ["critical"] * 5}
    plans.update({name: ["info"] * 4 for name in names[3:][-300:]})

    def alerts(name: str) -> None:
        writes = [AlertWrite(Alert(run=name, rule="kurtosis_jump", layer=f"blocks.{i}.mlp", site="input",
                                   severity=severity, state="firing", message=severity, first_step=0, last_step=0,
                                   fired_step=0)) for i, severity in enumerate(plans[name])]
        store.record_assessments(ids[name], [], writes, {})

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(alerts, plans))


# -- measurements in the browser -------------------------------------------------------------------

DRAWN = """() => {
    const plots = [...document.querySelectorAll('.js-plotly-plot')];
    const has = (test) => plots.some((gd) => (gd.data || []).some(test));
    return has((t) => (t.name || '').startsWith('loss')) && has((t) => t.type === 'heatmap');
}"""

SWITCH = """async (stat) => {
    const gd = document.getElementById('heatmap-chart');
    const select = document.getElementById('heatmap-stat');
    const t0 = performance.now();
    const drawn = new Promise((resolve) => {
        const check = () => {
            const t = (gd.data || []).find((t) => t.type === 'heatmap');
            if (t && t.name === stat) {
                const fetched = performance.getEntriesByType('resource').filter((e) => e.name.includes('/heatmap')
                    && e.startTime >= t0);
                const drawn = performance.getEntriesByName('fp8mon:heatmap-draw', 'measure')
                    .filter((e) => e.startTime >= t0);
                resolve([performance.now() - t0, fetched.length ? fetched[fetched.length - 1].duration : NaN,
                         drawn.length ? drawn[drawn.length - 1].duration : NaN]);
            }
            else requestAnimationFrame(check);
        };
        requestAnimationFrame(check);
    });
    select.value = stat;
    select.dispatchEvent(new Event('change'));
    return await drawn;
}"""


def first_render(browser, url: str, reloads: int) -> tuple[float, list[float]]:
    """Milliseconds from navigation start to a drawn run view: in a fresh context, then on `reloads` reloads."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    target = f"{url}/?run={RUN}"
    page.goto(target)
    page.wait_for_function(DRAWN, polling="raf")
    cold = page.evaluate("performance.now()")
    warm = []
    for _ in range(reloads):
        page.goto(target)
        page.wait_for_function(DRAWN, polling="raf")
        warm.append(page.evaluate("performance.now()"))
    context.close()
    return cold, warm


def heatmap_switches(browser, url: str, rounds: int) -> tuple[list, list]:
    """(milliseconds to the drawn heatmap, of which its request, of which its drawing) per switch of the statistic:
    the first ones, then `rounds` more rounds."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{url}/?run={RUN}&stat={STATS[0]}")
    page.wait_for_function(DRAWN, polling="raf")
    page.get_by_role("button", name="Pause").click()  # no poll in the middle of a switch
    first = [page.evaluate(SWITCH, stat) for stat in STATS[1:]]
    again = [page.evaluate(SWITCH, stat) for _ in range(rounds) for stat in STATS]
    context.close()
    return first, again


def _p50(pairs: list, i: int) -> float:
    return statistics.median(p[i] for p in pairs)


def idle_traffic(browser, url: str, seconds: float) -> tuple[int, int, int]:
    """(bytes received, bytes sent, requests) of a tab left on the run view for `seconds`."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{url}/?run={RUN}")
    page.wait_for_function(DRAWN, polling="raf")
    page.wait_for_timeout(6000)  # one refresh: the tab's cache holds every answer
    cdp = context.new_cdp_session(page)
    totals = {"received": 0, "sent": 0, "requests": 0}

    def finished(event):
        totals["received"] += int(event["encodedDataLength"])

    def sent(event):
        totals["requests"] += 1
        request = event["request"]
        totals["sent"] += len(request["method"]) + len(request["url"]) + 12 + sum(
            len(k) + len(str(v)) + 4 for k, v in request.get("headers", {}).items())

    cdp.on("Network.loadingFinished", finished)
    cdp.on("Network.requestWillBeSent", sent)
    cdp.send("Network.enable")
    page.wait_for_timeout(seconds * 1000)
    cdp.send("Network.disable")
    context.close()
    return totals["received"], totals["sent"], totals["requests"]


def worst_in_one_click(browser, url: str) -> tuple[bool, float]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url + "/")
    page.wait_for_selector("#run-list .run-item")
    t0 = time.perf_counter()
    page.select_option("#run-sort", "-severity")  # the one click
    page.wait_for_function("name => { const first = document.querySelector('#run-list .run-item');"
                           " return first && first.dataset.run === name; }", arg=WORST, polling="raf")
    ms = (time.perf_counter() - t0) * 1000
    found = page.locator("#run-list .run-item").first.get_attribute("data-run") == WORST
    context.close()
    return found, ms


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", help="an empty database (default: a fresh SQLite file)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=1000, help="runs in the fleet (the big run is one more)")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of switches after the first ones")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results/dashboard.csv")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    rec = Recorder("dashboard", gpu="cpu")
    with tempfile.TemporaryDirectory(prefix="fp8mon-bench-dashboard-") as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'dashboard.db'}"
        engine = create_db_engine(url)
        upgrade(engine)
        engine.dispose()
        store = SqlAlchemyStore(url)
        t0 = time.perf_counter()
        fill_fleet(store, args.runs)
        fill_big_run(store, args.layers, args.steps)  # last: the newest run, first in the list
        store.close()
        print(f"data: {args.runs} runs + {args.layers} layers x {args.steps} steps x {len(STATS)} statistics in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        server = ServerProcess(url, log=Path(tmp) / "server.log").start(timeout=60)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                measure(browser, server.url, args, rec)
                browser.close()
        finally:
            server.stop()
    for row in rec.rows:
        target = TARGETS.get(row["metric"])
        verdict = "" if target is None else f"   [target {target}: {'met' if float(row['value']) <= target else 'MISSED'}]"
        print(f"{row['metric']:<28}{row['value']:>12} {row['unit']}{verdict}")
    if not args.no_record:
        rec.write()
    return 0


def measure(browser, url: str, args, rec: Recorder) -> None:
    rec.add("load_average_1min_at_start", os.getloadavg()[0], "load")  # the machine is shared: read with this
    cold, warm = first_render(browser, url, args.reloads)
    rec.add("first_render_cold_ms", cold, "ms")
    rec.add("first_render_warm_ms", statistics.median(warm), "ms")
    first, again = heatmap_switches(browser, url, args.rounds)
    rec.add("heatmap_switch_p50_ms", _p50(first, 0), "ms")
    rec.add("heatmap_switch_max_ms", max(p[0] for p in first), "ms")
    rec.add("heatmap_switch_again_p50_ms", _p50(again, 0), "ms")
    # of which the request (server, transfer) and the drawing (traces and plotly, heatmap.js's performance
    # measure); the rest is the event, the JSON parse and the wait for the next frame
    rec.add("heatmap_switch_request_p50_ms", _p50(first + again, 1), "ms")
    rec.add("heatmap_switch_draw_p50_ms", _p50(first + again, 2), "ms")
    received, sent, requests = idle_traffic(browser, url, args.idle_seconds)
    scale = 30.0 / args.idle_seconds
    rec.add("idle_bytes_30s", (received + sent) * scale, "B")
    rec.add("idle_bytes_received_30s", received * scale, "B")
    rec.add("idle_requests_30s", requests * scale, "requests")
    found, ms = worst_in_one_click(browser, url)
    rec.add(f"worst_of_{args.runs}_first_after_one_click", float(found), "bool")
    rec.add(f"worst_of_{args.runs}_sort_ms", ms, "ms")


if __name__ == "__main__":
    sys.exit(main())
