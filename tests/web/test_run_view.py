"""The run view in a real headless Chromium against one real server: a run of 560 layers (the planted anomalous layer
first among the worst, named on hover, a click opening its statistics and its log2 histograms with the E4M3 limits),
every scalar as its own panel (log y, smoothing, one zoom for all), an 8-rank run's drill-down on the chosen rank,
a killed run read as stalled with its last-seen time, the layout at phone width (390 px), and a downsampled map
drawn as one scaled image whose partial last column names its steps."""

import math
import re
import time
from urllib.parse import quote

import httpx
import pytest

from fp8mon.agent.wire import CLIENT_HEADER, LOG2_HIST_BINS, LOG2_HIST_LO
from fp8mon.monitor.localserver import ServerProcess
from tests.web.conftest import WAIT_MS

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - the browser fixture skips
    expect = None


DEEP = "deep/560"
LAYERS = [f"blocks.{i // 5}.{('q', 'k', 'v', 'o', 'mlp')[i % 5]}" for i in range(560)]
PLANTED = LAYERS[377]
STEPS = range(12)
SCALARS = ("loss", "lr", "tokens_per_s", "attn_max_logit", "logit_logsumexp", "my/custom")
EIGHT = "dp/eight"
LONG = "long/2002"
KILLED = "team/killed"


def post(server, body: dict) -> None:
    httpx.post(f"{server.url}/api/v1/ingest", json={"version": 1, **body}, headers={CLIENT_HEADER: "tests"},
               timeout=30).raise_for_status()


def hist(peak: int) -> list[int]:
    counts = [0] * LOG2_HIST_BINS
    for offset, n in ((-1, 300), (0, 1000), (1, 300)):
        counts[peak + offset - LOG2_HIST_LO] = n
    return counts


def deep_run(server) -> None:
    """Kurtosis 3 + j/1000 on layer j; the planted layer jumps x148 from step 6 and carries log2 histograms."""
    records = [(s, j) for s in STEPS for j in range(len(LAYERS))]
    kurtosis = [3.0 * 148 if (j == 377 and s >= 6) else 3.0 + j / 1000 for s, j in records]
    post(server, {"batch_id": "deep-t", "run": DEEP,
                  "run_meta": {"config": {"lr": 3e-4, "trainer_args": ["--arch", "fog"]},
                               "tags": {"host": "gpu-node-7", "team": "fog"}},
                  "tensors": {"step": [s for s, _ in records], "layer": [LAYERS[j] for _, j in records],
                              "site": ["input"] * len(records),
                              "stats": {"kurtosis": kurtosis, "amax": [1.0] * len(records),
                                        "scale": [2.0] * len(records)},
                              "log2_hist": [hist(-3 + s // 4) if j == 377 else None for s, j in records]}})
    post(server, {"batch_id": "deep-s", "run": DEEP,
                  "scalars": {"step": [s for s in STEPS for _ in SCALARS], "name": list(SCALARS) * len(STEPS),
                              "value": [10.0 / (s + 1) + k for s in STEPS for k in range(len(SCALARS))]}})


def eight_ranks(server) -> None:
    """Kurtosis 3 + 10 (r + 1) + j on rank r; rank 5 spikes to 300 at layer 2, step 12. Loss 1 + r on rank r; rank 3
    spikes to 99 at step 7. Rank r's log2 histograms peak at 2^(3r - 20) (three binades each, no two ranks' shared)."""
    layers = [f"blocks.{j}.mlp" for j in range(4)]
    for r in range(8):
        kurtosis = [300.0 if (r, j, s) == (5, 2, 12) else 3.0 + 10 * (r + 1) + j for s in range(20) for j in range(4)]
        post(server, {"batch_id": f"eight-{r}", "run": EIGHT,
                      "tensors": {"step": [s for s in range(20) for _ in layers], "layer": layers * 20,
                                  "site": ["input"] * 80, "rank": r, "stats": {"kurtosis": kurtosis},
                                  "log2_hist": [hist(3 * r - 20)] * 80},
                      "scalars": {"step": list(range(20)), "name": ["loss"] * 20, "rank": r,
                                  "value": [99.0 if (r, s) == (3, 7) else 1.0 + r for s in range(20)]}})


def long_run(server) -> None:
    """Three layers over 2002 steps (600 columns of 4 steps, the last of 2); layer 2 ends at 1234.56789."""
    layers = [f"blocks.{j}.mlp" for j in range(3)]
    steps = range(2002)
    kurtosis = [1234.56789 if (j, s) == (2, 2001) else 3.0 + j for s in steps for j in range(3)]
    post(server, {"batch_id": "long", "run": LONG,
                  "tensors": {"step": [s for s in steps for _ in layers], "layer": layers * len(steps),
                              "site": ["input"] * len(kurtosis), "stats": {"kurtosis": kurtosis}}})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module; a run silent for 1 s (and five of its intervals) reads as stalled."""
    tmp = tmp_path_factory.mktemp("runview")
    server = ServerProcess(f"sqlite:///{tmp / 'fp8mon.db'}", args=("--migrate",), log=tmp / "server.log",
                           env={"FP8MON_STALL_MIN_SECONDS": "1"}).start()
    deep_run(server)
    eight_ranks(server)
    long_run(server)
    yield server
    server.stop()


@pytest.fixture
def page(page):
    """conftest's page, also recording the URLs it requests."""
    page.requests = []
    page.on("request", lambda request: page.requests.append(request.url))
    return page


def chart(page, element_id: str) -> dict:
    return page.evaluate("id => { const gd = document.getElementById(id); "
                         "return {data: gd.data || [], layout: gd.layout || {}}; }", element_id)


def wait_for_trace(page, element_id: str, condition: str, arg=None) -> None:
    page.wait_for_function(f"([id, arg]) => ((document.getElementById(id) || {{}}).data || []).some(t => {condition})",
                           arg=[element_id, arg], timeout=WAIT_MS)


def cell_position(page, layer: str) -> tuple[float, float]:
    """Page coordinates of the heatmap's column at 3/4 of the steps (clear of plotly's toolbar) in `layer`'s row."""
    page.locator("#heatmap-chart").scroll_into_view_if_needed()
    return tuple(page.evaluate("""layer => {
        const gd = document.getElementById('heatmap-chart');
        const t = gd.data[0], xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(t.x[Math.floor(t.x.length * 3 / 4)]), box.top + ya._offset + ya.d2p(layer)];
    }""", layer))


def test_560_layers_open_on_the_worst_with_the_planted_one_named_and_a_click_opens_its_detail(server, page):
    page.goto(f"{server.url}/?run={quote(DEEP, safe='')}")
    expect(page.locator("#heatmap-rows")).to_have_value("32")  # hundreds of layers: the worst ones first
    wait_for_trace(page, "heatmap-chart", "t.type === 'heatmap' && t.y.length === 32")
    heatmap = chart(page, "heatmap-chart")
    assert heatmap["data"][0]["y"][0] == PLANTED and heatmap["data"][0]["y"][1:4] == LAYERS[559:556:-1]
    assert heatmap["layout"]["height"] >= 32 * 16
    expect(page.locator("#heatmap-message")).to_contain_text("The 32 of 560 layers with the largest kurtosis")

    x, y = cell_position(page, PLANTED)
    page.mouse.move(x, y)
    expect(page.locator("#heatmap-chart .hoverlayer")).to_contain_text(PLANTED)
    expect(page.locator("#heatmap-chart .hoverlayer")).to_contain_text("kurtosis 444")

    page.mouse.click(x, y)
    expect(page.locator("#detail-title")).to_have_text(f"{PLANTED} · input")
    wait_for_trace(page, "detail-chart", "t.name === 'kurtosis' && Math.max(...t.y) === 444")
    detail = chart(page, "detail-chart")
    assert {t["name"] for t in detail["data"]} >= {"kurtosis", "amax", "scale"}
    kurtosis = next(t for t in detail["data"] if t["name"] == "kurtosis")
    assert kurtosis["y"] == [3.377] * 6 + [444.0] * 6
    assert any("/series?" in u and "stat=kurtosis" in u and f"layer={quote(PLANTED)}" in u for u in page.requests)
    assert f"layer={quote(PLANTED)}" in page.url

    # its log2 histograms: binades x steps, E4M3's limits at the scale in use (2): overflow above 464/2
    wait_for_trace(page, "histogram-chart", "t.name === 'E4M3 overflow'")
    drawn = chart(page, "histogram-chart")["data"]
    assert drawn[0]["type"] == "heatmap" and len(drawn[0]["x"]) == len(STEPS)
    limit = {t["name"]: t["y"] for t in drawn[1:]}
    assert limit["E4M3 overflow"] == [math.log2(464 / 2)] * len(STEPS)
    assert limit["E4M3 underflow (→ 0)"] == [-10 - 1] * len(STEPS)
    expect(page.locator("#histogram-message")).to_contain_text("E4M3 limits at the scale in use")

    # a row's label opens that layer too
    page.locator("#heatmap-chart .ytick text", has_text=LAYERS[558]).click()
    expect(page.locator("#detail-title")).to_have_text(f"{LAYERS[558]} · input")

    # every layer, each row labelled and readable in a box that scrolls; a step zoom asks for those steps only
    page.select_option("#heatmap-rows", "all")
    wait_for_trace(page, "heatmap-chart", "t.type === 'heatmap' && t.y.length === 560")
    assert chart(page, "heatmap-chart")["layout"]["height"] >= 560 * 16
    expect(page.locator("#heatmap-chart g.ytick text")).to_have_count(560)
    assert page.evaluate("() => { const b = document.querySelector('.heatmap-scroll'); "
                         "return b.scrollHeight > b.clientHeight; }")
    with page.expect_request(lambda r: "/heatmap?" in r.url and "start=2" in r.url and "end=5" in r.url):
        page.evaluate("Plotly.relayout('heatmap-chart', {'xaxis.range': [2.2, 4.6]})")
    assert page.errors == []


def test_every_scalar_has_its_panel_with_log_y_smoothing_one_zoom_for_all_and_a_phone_layout(server, page):
    page.goto(f"{server.url}/?run={quote(DEEP, safe='')}&refresh=1")
    panels = page.locator("#scalar-panels .scalar-panel")
    expect(panels).to_have_count(len(SCALARS))
    assert panels.evaluate_all("els => els.map(e => e.dataset.scalar)") == [
        "loss", "lr", "tokens_per_s", "attn_max_logit", "logit_logsumexp", "my/custom"]
    for element_id, name in (("loss-chart", "loss"), ("my-custom-chart", "my/custom"), ("lr-chart", "lr")):
        wait_for_trace(page, element_id, "t.name === arg && t.x.length === 12", name)
    expect(page.locator("#run-overview")).to_contain_text("gpu-node-7")
    expect(page.locator("#run-tags")).to_contain_text("team=fog")
    expect(page.locator("#run-config")).to_contain_text("--arch fog")

    page.locator(".scalar-panel[data-scalar='loss'] input.log-y").check()
    page.wait_for_function("() => document.getElementById('loss-chart').layout.yaxis.type === 'log'")
    assert chart(page, "lr-chart")["layout"]["yaxis"]["type"] == "linear"

    page.locator("#scalar-smoothing").fill("0.9")
    wait_for_trace(page, "lr-chart", "t.name === 'lr (smoothed)'")
    smooth = next(t for t in chart(page, "lr-chart")["data"] if t["name"] == "lr (smoothed)")
    raw = next(t for t in chart(page, "lr-chart")["data"] if t["name"] == "lr")
    assert smooth["y"][0] == pytest.approx(raw["y"][0]) and smooth["y"][-1] > raw["y"][-1]  # lags the fall

    wait_for_trace(page, "risk-chart", "t.name === 'risk' && t.x.length > 0")
    page.evaluate("Plotly.relayout('loss-chart', {'xaxis.range': [3, 8]})")
    for other in ("lr-chart", "my-custom-chart", "risk-chart"):
        page.wait_for_function("id => JSON.stringify(document.getElementById(id).layout.xaxis.range) === '[3,8]'",
                               arg=other)

    # polls of a run without new data ask for no series, heatmap or histogram again, and only newer predictions
    page.requests.clear()
    for _ in range(3):  # two whole polls at refresh=1 lie between the first and the third run-list request
        with page.expect_request(lambda r: "/api/v1/runs?" in r.url):
            pass
    polled = [u for u in page.requests if "/api/v1/" in u]
    assert sum("/predictions?" in u and "limit=5000" in u for u in polled) >= 2
    assert not [u for u in polled if any(part in u for part in ("/series?", "/heatmap?", "/histogram?"))]
    assert all("from_step=" in u for u in polled if "/predictions?" in u and "limit=5000" in u)

    # a scalar first logged later gets its own panel; the others keep their charts
    post(server, {"batch_id": "deep-late", "run": DEEP, "scalars": {"step": [11], "name": ["late"], "value": [1.0]}})
    expect(panels).to_have_count(len(SCALARS) + 1)
    wait_for_trace(page, "late-chart", "t.name === 'late'")
    wait_for_trace(page, "loss-chart", "t.name === 'loss' && t.x.length === 12")

    # at phone width (390 px) the page stacks: the run list above the run, every chart about the screen's width
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_function("() => ['loss-chart', 'heatmap-chart', 'risk-chart', 'my-custom-chart'].every(id => { "
                           "const w = document.getElementById(id).querySelector('.main-svg').getBoundingClientRect()"
                           ".width; return w >= 330 && w <= 390; })")
    sidebar, main = page.evaluate("() => ['.sidebar', '#main'].map(s => { "
                                  "const r = document.querySelector(s).getBoundingClientRect(); return [r.top, r.bottom]; })")
    assert main[0] >= sidebar[1] - 1
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    assert page.errors == []


def test_a_killed_run_reads_stalled_with_its_last_seen_time_and_eight_ranks_drill_into_the_chosen_one(server, page):
    for step in range(3):  # then the trainer is killed: nothing more arrives
        post(server, {"batch_id": f"killed-{step}", "run": KILLED,
                      "scalars": {"step": [step], "name": ["loss"], "value": [2.0]}})
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/api/v1/runs/{quote(KILLED)}").json()["status"] != "stalled":
        assert time.monotonic() < deadline, "the killed run never read as stalled"
        time.sleep(0.2)
    last_seen = httpx.get(f"{server.url}/api/v1/runs/{quote(KILLED)}").json()["last_seen_at"]

    page.goto(f"{server.url}/?q=killed")
    item = page.locator(".run-item", has_text=KILLED)
    expect(item.locator(".badge")).to_have_text("stalled")
    expect(item.locator(".badge")).to_have_attribute("title", "no data since " + page.evaluate(
        "iso => new Date(iso).toLocaleString()", last_seen))
    expect(item.locator(".run-last-seen")).to_have_text("since " + page.evaluate(
        "iso => new Date(iso).toLocaleTimeString([], {hour: '2-digit', minute: '2-digit'})", last_seen))
    item.click()
    expect(page.locator("#run-status")).to_have_text("stalled")
    expect(page.locator("#run-overview .overview-status")).to_contain_text("stalled: no data since")
    expect(page.locator("#run-overview .overview-last-seen")).to_have_attribute("title", last_seen)

    page.goto(f"{server.url}/?run={quote(EIGHT, safe='')}&rank=5")
    expect(page.locator("#heatmap-rank option")).to_have_count(9)
    wait_for_trace(page, "heatmap-chart", "t.type === 'heatmap' && Math.abs(10 ** t.z[2][12] - 300) < 1e-6")
    x, y = cell_position(page, "blocks.2.mlp")
    with page.expect_request(lambda r: "/series?" in r.url and "rank=5" in r.url and "blocks.2.mlp" in r.url):
        page.mouse.click(x, y)
    wait_for_trace(page, "detail-chart", "t.name === 'kurtosis' && Math.max(...t.y) === 300")
    expect(page.locator("#detail-message")).to_contain_text("rank 5")
    assert page.errors == []


def test_a_downsampled_map_is_one_scaled_image_and_its_partial_last_column_names_its_steps(server, page):
    page.goto(f"{server.url}/?run={quote(LONG, safe='')}")
    wait_for_trace(page, "heatmap-chart", "t.type === 'heatmap' && t.x.length === 501")
    x = chart(page, "heatmap-chart")["data"][0]["x"]
    assert x[:2] == [1.5, 5.5] and x[-1] == 2001.5  # evenly spaced: every column its whole bucket's centre
    # evenly spaced columns are painted one pixel per cell and scaled (what keeps a switch fast)
    expect(page.locator("#heatmap-chart image")).to_have_attribute("style", re.compile("pixelated"))
    expect(page.locator("#heatmap-message")).to_contain_text("4 steps per column")

    page.locator("#heatmap-chart").scroll_into_view_if_needed()
    cx, cy = page.evaluate("""() => {
        const gd = document.getElementById('heatmap-chart');
        const t = gd.data[0], xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(t.x[t.x.length - 1]), box.top + ya._offset + ya.d2p('blocks.2.mlp')];
    }""")
    page.mouse.move(cx, cy)
    hover = page.locator("#heatmap-chart .hoverlayer")
    expect(hover).to_contain_text("step 2000–2001")
    expect(hover).to_contain_text("kurtosis 1235")  # 4 significant digits, as the server sends them
    assert page.errors == []


def test_worst_over_ranks_drives_the_layer_detail_and_the_scalar_panels(server, page):
    page.goto(f"{server.url}/?run={quote(EIGHT, safe='')}&layer=blocks.2.mlp&lsite=input")
    wait_for_trace(page, "loss-chart", "t.name === 'loss' && t.y.every(y => y === 1)")  # rank 0 first
    wait_for_trace(page, "detail-chart", "t.name === 'kurtosis' && t.y.every(y => y === 15)")

    page.select_option("#heatmap-rank", "worst")
    # every step the largest over the eight ranks: rank 7's, and rank 5's spike, rank 3's loss spike
    wait_for_trace(page, "detail-chart", "t.name === 'kurtosis' && Math.max(...t.y) === 300")
    kurtosis = next(t for t in chart(page, "detail-chart")["data"] if t["name"] == "kurtosis")
    assert kurtosis["y"] == [85.0] * 12 + [300.0] + [85.0] * 7
    expect(page.locator("#detail-message")).to_contain_text("the largest over ranks 0, 1, 2, 3, 4, 5, 6, 7")
    # histograms have no largest: each step's are summed, the eight ranks' binades in one column
    wait_for_trace(page, "histogram-chart", "t.type === 'heatmap' && t.z.filter(row => row[0] !== null).length === 24")
    expect(page.locator("#histogram-message")).to_contain_text("all ranks' values together")
    wait_for_trace(page, "loss-chart", "t.name === 'loss' && Math.max(...t.y) === 99")
    loss = next(t for t in chart(page, "loss-chart")["data"] if t["name"] == "loss")
    assert loss["y"] == [8.0] * 7 + [99.0] + [8.0] * 12
    expect(page.locator("#loss-message")).to_contain_text("largest over ranks 0, 1, 2, 3, 4, 5, 6, 7")
    assert "rank=worst" in page.url

    page.select_option("#heatmap-rank", "2")
    wait_for_trace(page, "loss-chart", "t.name === 'loss' && t.y.every(y => y === 3)")
    wait_for_trace(page, "detail-chart", "t.name === 'kurtosis' && t.y.every(y => y === 35)")
    expect(page.locator("#detail-message")).to_contain_text("rank 2")
    wait_for_trace(page, "histogram-chart", "t.type === 'heatmap' && t.z.filter(row => row[0] !== null).length === 3")
    assert page.errors == []
