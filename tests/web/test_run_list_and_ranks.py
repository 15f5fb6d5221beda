"""The dashboard at scale in a real headless Chromium: 1,000 runs (search reaches past the newest page, sorting by
severity puts the worst run first with the server's firing counts) and the rank selector (a reduce_ranks run drawn
from its merged rank -1; an 8-rank run, one rank or the worst over ranks). Data is written through the store."""

import re
from urllib.parse import quote

import pytest

from fp8mon.monitor.wire import IngestBatch
from tests.monitor.fleet import SEARCHED, WORST, make_fleet

expect = pytest.importorskip("playwright.sync_api", reason="the playwright package (dev extra)").expect
LAYERS = [f"blocks.{i}.mlp" for i in range(4)]


def test_search_and_sort_by_severity_reach_every_one_of_1000_runs(store, live_server, page):
    fleet = make_fleet(store, n=1000)
    page.goto(live_server.url + "/")
    items = page.locator("#run-list .run-item")
    expect(page.locator("#run-list-message")).to_have_text("50 of 1000 runs")
    expect(items).to_have_count(50)
    expect(page.locator(".run-item", has_text=WORST)).to_have_count(0)  # the oldest runs are not on the first page

    page.fill("#run-filter", "fog")
    expect(items).to_have_count(len(SEARCHED))
    expect(page.locator("#run-list-message")).to_have_text("5 of 5 runs")
    assert "q=fog" in page.url
    page.fill("#run-filter", "team=fog")  # a tag
    expect(items).to_have_count(len(SEARCHED))
    page.fill("#run-filter", "")
    expect(items).to_have_count(50)

    page.select_option("#run-sort", "-severity")  # the one click
    first = items.first
    expect(first).to_have_attribute("data-run", WORST)
    expect(first).to_have_class(re.compile("sev-critical"))
    expect(first.locator(".run-firing")).to_have_text("6 firing")
    expect(first.locator(".run-risk")).to_have_text("risk 0.95")
    # every listed run shows its own count, though the 1,200 newest alerts belong to other runs
    shown = page.eval_on_selector_all(
        "#run-list .run-item", "els => els.map(e => [e.dataset.run, e.querySelector('.run-firing').textContent])")
    assert len(shown) == 50
    assert shown == [[name, f"{sum(fleet.firing.get(name, {}).values())} firing"] for name, _ in shown]
    assert sum(1 for name, text in shown if text != "0 firing") == 50  # 15 runs with critical alerts, then info ones

    page.get_by_role("button", name="Show more runs").click()
    expect(items).to_have_count(100)
    first.click()
    expect(page.locator("#run-title")).to_have_text(WORST)
    assert page.errors == []


def _ranked(store, run, ranks):
    """Kurtosis of layer j on rank r: 3 + 10 (r + 1) + j (rank -1, the merged one: 3 + j); rank 5 holds a spike
    at layer 2, step 12. The loss comes from rank 0, as the agent ships it."""
    steps = range(20)
    for r in ranks:
        kurtosis = [300.0 if (r, j, s) == (5, 2, 12) else 3.0 + 10 * (r + 1) + j
                    for s in steps for j in range(len(LAYERS))]
        store.ingest(IngestBatch.model_validate({
            "version": 1, "batch_id": f"{run}-{r}", "run": run,
            "tensors": {"step": [s for s in steps for _ in LAYERS], "layer": LAYERS * len(steps),
                        "site": ["input"] * len(kurtosis), "rank": r, "stats": {"kurtosis": kurtosis}}}))
    store.ingest(IngestBatch.model_validate({
        "version": 1, "batch_id": f"{run}-loss", "run": run,
        "scalars": {"step": list(steps), "name": ["loss"] * len(steps), "value": [1.0] * len(steps), "rank": 0}}))


def heatmap_z(page):
    page.wait_for_function("() => (document.getElementById('heatmap-chart').data || [])"
                           ".some(t => t.type === 'heatmap')")
    return page.evaluate("() => document.getElementById('heatmap-chart').data.find(t => t.type === 'heatmap').z")


@pytest.mark.sqlite_only
def test_rank_selector_draws_the_merged_rank_one_rank_or_the_worst_over_ranks(store, live_server, page):
    _ranked(store, "reduced", [-1])
    _ranked(store, "dp/eight", range(8))

    page.goto(f"{live_server.url}/?run=reduced")
    expect(page.locator("#heatmap-rank")).to_have_value("-1")
    z = heatmap_z(page)  # drawn on a log scale
    assert [round(10 ** row[0], 6) for row in z] == [3.0, 4.0, 5.0, 6.0]
    page.select_option("#heatmap-rank", "0")  # rank 0 has only the loss: the map says why it is empty
    expect(page.locator("#heatmap-message")).to_have_text(
        "No kurtosis at the input site on rank 0: this run reports it on the merged rank (−1).")
    assert page.locator("#heatmap-chart").evaluate("el => el.classList.contains('blank')")

    page.goto(f"{live_server.url}/?run={quote('dp/eight', safe='')}")
    options = page.locator("#heatmap-rank option")
    expect(options).to_have_count(9)
    expect(page.locator("#heatmap-rank")).to_have_value("0")
    z = heatmap_z(page)
    assert round(10 ** z[1][0], 6) == 14.0
    with page.expect_request(lambda r: "/heatmap?" in r.url and "rank=6" in r.url):
        page.select_option("#heatmap-rank", "6")
    page.wait_for_function("() => { const t = (document.getElementById('heatmap-chart').data || [])"
                           ".find(t => t.type === 'heatmap'); return t && Math.abs(10 ** t.z[0][0] - 73) < 1e-6; }")
    with page.expect_request(lambda r: "/heatmap?" in r.url and "worst_over_ranks=true" in r.url):
        page.select_option("#heatmap-rank", "worst")
    page.wait_for_function("() => { const t = (document.getElementById('heatmap-chart').data || [])"
                           ".find(t => t.type === 'heatmap'); return t && Math.abs(10 ** t.z[2][12] - 300) < 1e-6; }")
    expect(page.locator("#heatmap-message")).to_contain_text("largest over ranks 0, 1, 2, 3, 4, 5, 6, 7")
    z = heatmap_z(page)
    assert round(10 ** z[0][0], 6) == 83.0  # rank 7 is the largest elsewhere
    assert "rank=worst" in page.url
    page.reload()
    expect(page.locator("#heatmap-rank")).to_have_value("worst")
    assert page.errors == []
