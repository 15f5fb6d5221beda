"""The dashboard (GET /) in a real headless Chromium, against a real server fed with a labelled diverging run.

Debian's chromium (/usr/bin/chromium, from scripts/test.sh) is driven by the `playwright` package of the dev
extra; no browser is ever downloaded. The run is replayed under a name with '/' in it, so every URL the page
builds has to encode the name.
"""

import math
import re
import time
from functools import lru_cache
from importlib.resources import files
from urllib.parse import quote

import httpx
import pytest

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.fixtures import FIXTURE_DIR, load_fixture
from tests.web.conftest import WAIT_MS

expect = pytest.importorskip("playwright.sync_api", reason="the playwright package (dev extra)").expect

pytestmark = pytest.mark.sqlite_only
RUN = "team/fog-fp8/ramp"
FIXTURE = FIXTURE_DIR / "cpu-fog-fp8-ramp.json.gz"
FIRST_PART = 34  # batches of 10 steps: steps 0..339 before the page loads, the rest (to 419) while it is open
expect.set_options(timeout=WAIT_MS)


@lru_cache(maxsize=1)
def batches() -> tuple[dict, ...]:
    return tuple({**batch, "run": RUN} for batch in load_fixture(FIXTURE).batches)


def api(server, path: str, token: str | None = None, **params):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{server.url}/api/v1{path}", params=params, headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()


def run_api(server, suffix: str = "", **params):
    return api(server, f"/runs/{quote(RUN)}{suffix}", **params)


def post(server, some_batches, token: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {CLIENT_HEADER: "tests"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        for batch in some_batches:
            client.post("/api/v1/ingest", json=batch).raise_for_status()


def wait_for_predictor(server, last_step: int) -> None:
    """Predictions run in the background: wait until the predictor has seen the last posted step."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = run_api(server, "/predictions", limit=1)
        if body["predictions"] and body["predictions"][-1]["step"] >= last_step:
            return
        time.sleep(0.1)
    raise AssertionError(f"no prediction at step {last_step} within 30 s")


def last_step_of(some_batches) -> int:
    return max(step for batch in some_batches for step in batch["scalars"]["step"])


def feed(server):
    """The server, now holding the first part of a diverging run, with firing alerts and predictions."""
    post(server, batches()[:FIRST_PART])
    wait_for_predictor(server, last_step_of(batches()[:FIRST_PART]))
    assert any(a["state"] == "firing" for a in run_api(server, "/alerts")["alerts"])
    return server


@pytest.fixture(scope="module")
def fed_server(module_live_server):
    """A fed server shared by the tests that add no steps (feeding one takes seconds): acknowledging an alert
    changes nothing another of them reads."""
    return feed(module_live_server)


@pytest.fixture
def own_fed_server(live_server):
    """A fed server of the test's own, for a test that posts the rest of the run."""
    return feed(live_server)


class Tab:
    """A page that records console errors, uncaught exceptions and every URL it requested."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda msg: msg.type == "error" and self.errors.append(msg.text))
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        page.on("request", lambda request: self.requests.append(request.url))

    def errors_besides(self, *statuses: int) -> list[str]:
        """Errors other than Chromium's own log line for an expected HTTP error status."""
        codes = "|".join(map(str, statuses))
        expected = re.compile(rf"Failed to load resource: the server responded with a status of ({codes})")
        return [e for e in self.errors if not expected.search(e)]

    def chart(self, element_id: str) -> dict:
        """The data and layout plotly drew into a chart's element."""
        return self.page.evaluate("""id => {
            const gd = document.getElementById(id);
            return {data: gd.data || [], layout: gd.layout || {}};
        }""", element_id)

    def wait_for_trace(self, element_id: str, condition: str, arg=None) -> None:
        """Wait until some trace `t` of the chart satisfies the JS expression `condition` (with `arg`)."""
        self.page.wait_for_function(
            f"([id, arg]) => ((document.getElementById(id) || {{}}).data || []).some(t => {condition})",
            arg=[element_id, arg], timeout=WAIT_MS)


@pytest.fixture
def tab(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(WAIT_MS)
    yield Tab(context.new_page())
    context.close()


def run_item(tab):
    return tab.page.locator(".run-item", has_text=RUN)


def worst(alerts) -> str:
    return max((a["severity"] for a in alerts), key=["info", "warning", "critical"].index)


def test_run_list_health_then_loss_and_grad_norm_with_alert_markers_then_acknowledging_an_alert(fed_server, tab):
    alerts = run_api(fed_server, "/alerts")["alerts"]
    firing = [a for a in alerts if a["state"] == "firing"]
    risk = run_api(fed_server, "/predictions/latest")["risk"]
    tab.page.goto(fed_server.url + "/")

    item = run_item(tab)
    expect(item.locator(".badge")).to_have_text("running")
    expect(item.locator(".run-step")).to_have_text(f"step {last_step_of(batches()[:FIRST_PART])}")
    expect(item.locator(".run-risk")).to_have_text(f"risk {risk:.2g}")
    expect(item.locator(".run-firing")).to_have_text(f"{len(firing)} firing")
    expect(item).to_have_class(re.compile(f"sev-{worst(firing)}"))

    item.click()
    expect(tab.page).to_have_url(re.compile(r"\?run=team%2Ffog-fp8%2Framp$"))
    expect(tab.page.locator("#run-title")).to_have_text(RUN)
    tab.page.select_option("#alert-severity", "info")  # every alert, info ones too (the default: warning and up)
    fired_steps = sorted({a[key] for a in alerts for key in ("fired_step", "escalated_step") if a[key] is not None})
    for chart, scalar in (("loss-chart", "loss"), ("grad-norm-chart", "grad_norm")):
        tab.wait_for_trace(chart, "t.name === arg", scalar)
        tab.wait_for_trace(chart, "t.name === 'alerts fired' && t.x.length === arg", len(fired_steps))
        drawn = tab.chart(chart)
        line = next(t for t in drawn["data"] if t["name"] == scalar)
        assert line["x"][0] == 0 and line["x"][-1] == last_step_of(batches()[:FIRST_PART])
        markers = next(t for t in drawn["data"] if t["name"] == "alerts fired")
        assert markers["x"] == fired_steps
        assert sorted(s["x0"] for s in drawn["layout"]["shapes"]) == fired_steps
    expect(tab.page.locator("#loss-chart .main-svg").first).to_be_visible()
    expect(tab.page.locator("#prediction")).to_contain_text("risk")
    expect(tab.page.locator("#prediction .list-culprits li").first).to_be_visible()

    # the alerts panel: one row per rule; a rule opens onto its alerts; acknowledging one reaches the API and
    # takes it out of the run's firing count
    alert = firing[0]
    rules = {a["rule"] for a in alerts}
    expect(tab.page.locator("#alert-table tr.alert-group")).to_have_count(len(rules))
    tab.page.locator(f"#alert-table tr.alert-group[data-rule='{alert['rule']}'] .alert-toggle").click()
    row = tab.page.locator(f"#alert-table tr[data-alert-id='{alert['id']}']")
    for text in (alert["severity"], "firing", str(alert["fired_step"])):
        expect(row).to_contain_text(text)
    expect(tab.page.locator("#alert-table tr.alert-detail")).to_have_count(
        sum(a["rule"] == alert["rule"] for a in alerts))
    tab.wait_for_trace("alert-chart", "t.type === 'bar' && t.name === arg", alert["severity"])
    row.get_by_role("button", name="Acknowledge").click()
    expect(row.get_by_role("button")).to_have_text("Un-acknowledge")
    expect(item.locator(".run-firing")).to_have_text(f"{len(firing) - 1} firing")
    acked = next(a for a in run_api(fed_server, "/alerts")["alerts"] if a["id"] == alert["id"])
    assert acked["acknowledged_at"] is not None

    assert tab.errors == []
    # plotly.js and everything else came from the monitor itself: no CDN
    fetched = [url for url in tab.requests if not url.startswith("data:")]
    assert fetched and all(url.startswith(fed_server.url + "/") for url in fetched)
    assert any("/static/plotly.min.js" in url for url in tab.requests)


def test_heatmap_has_a_row_per_layer_and_refetches_on_another_statistic_or_site(fed_server, tab):
    layers = [entry["layer"] for entry in run_api(fed_server, "/catalogue")["layers"]]
    tab.page.goto(f"{fed_server.url}/?run={quote(RUN, safe='')}")

    tab.wait_for_trace("heatmap-chart", "t.type === 'heatmap' && t.name === 'kurtosis'")
    heatmap = tab.chart("heatmap-chart")["data"][0]
    assert heatmap["y"] == layers
    last_tensor_step = max(step for batch in batches()[:FIRST_PART] for step in batch["tensors"]["step"])
    assert len(heatmap["z"]) == len(layers) and max(heatmap["x"]) == last_tensor_step
    expect(tab.page.locator("#heatmap-site")).to_have_value("input")

    with tab.page.expect_request(lambda r: "/heatmap?" in r.url and "stat=amax" in r.url and "site=input" in r.url):
        tab.page.select_option("#heatmap-stat", "amax")
    tab.wait_for_trace("heatmap-chart", "t.type === 'heatmap' && t.name === 'amax'")

    with tab.page.expect_request(lambda r: "/heatmap?" in r.url and "stat=amax" in r.url
                                 and "site=grad_output" in r.url):
        tab.page.select_option("#heatmap-site", "grad_output")
    expected = run_api(fed_server, "/heatmap", stat="amax", site="grad_output", max_points=600,
                       digits=4)  # the page asks for 4 significant digits
    first_reported = next(v for v in expected["values"][0] if v is not None)
    tab.wait_for_trace("heatmap-chart", "t.type === 'heatmap' && Math.abs(t.z[0][0] - arg) < 1e-9",
                       math.log10(first_reported))  # amax is drawn on a log scale

    # the choice is in the URL, so a reload (or a shared link) shows the same map
    tab.page.reload()
    expect(tab.page.locator("#heatmap-stat")).to_have_value("amax")
    expect(tab.page.locator("#heatmap-site")).to_have_value("grad_output")
    assert tab.errors == []


def test_live_refresh_shows_new_steps_keeps_the_zoom_and_can_be_paused(own_fed_server, tab):
    before, paused, final = (last_step_of(batches()[:n]) for n in (FIRST_PART, FIRST_PART + 2, len(batches())))
    tab.page.goto(f"{own_fed_server.url}/?run={quote(RUN, safe='')}&refresh=1")
    tab.wait_for_trace("loss-chart", "t.name === 'loss' && t.x[t.x.length - 1] === arg", before)
    tab.page.evaluate("Plotly.relayout('loss-chart', {'xaxis.range': [100, 200]})")

    tab.page.get_by_role("button", name="Pause").click()
    expect(tab.page.locator("#refresh-status")).to_have_text("paused")
    post(own_fed_server, batches()[FIRST_PART:FIRST_PART + 2])
    tab.page.wait_for_timeout(2500)  # more than two refresh intervals
    expect(run_item(tab).locator(".run-step")).to_have_text(f"step {before}")

    tab.page.get_by_role("button", name="Resume").click()
    expect(run_item(tab).locator(".run-step")).to_have_text(f"step {paused}")
    post(own_fed_server, batches()[FIRST_PART + 2:])
    expect(run_item(tab).locator(".run-step")).to_have_text(f"step {final}")
    expect(run_item(tab).locator(".badge")).to_have_text("finished")
    expect(tab.page.locator("#run-status")).to_have_text("finished")
    tab.wait_for_trace("loss-chart", "t.name === 'loss' && t.x[t.x.length - 1] === arg", final)
    assert tab.chart("loss-chart")["layout"]["xaxis"]["range"] == [100, 200]
    assert tab.errors == []


def test_a_server_with_read_tokens_asks_for_one_and_takes_it_from_the_url(server_factory, tab):
    server = server_factory(FP8MON_READ_TOKENS='["reader"]', FP8MON_WRITE_TOKENS='["writer"]').start()
    post(server, batches()[:3], token="writer")

    tab.page.goto(server.url + "/")
    expect(tab.page.locator("#banner")).to_contain_text("needs an API token")
    expect(tab.page.locator("#token-form")).to_be_visible()

    tab.page.goto(f"{server.url}/?token=reader&run={quote(RUN, safe='')}")
    expect(run_item(tab).locator(".run-step")).to_have_text(f"step {last_step_of(batches()[:3])}")
    expect(tab.page.locator("#run-title")).to_have_text(RUN)
    assert "token" not in tab.page.url  # the secret does not stay in the address bar
    expect(tab.page.locator("#banner")).to_be_hidden()
    assert tab.errors_besides(401) == []


def test_plotly_comes_from_the_installed_package_with_a_long_cache_and_messages_replace_blank_pages(
        live_server, tab):
    page = httpx.get(live_server.url + "/")
    assert page.headers["content-type"].startswith("text/html")
    src = re.search(r'src="(/static/plotly\.min\.js[^"]*)"', page.text).group(1)
    asset = httpx.get(live_server.url + src)
    assert asset.status_code == 200
    assert asset.content == (files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    assert "max-age=31536000" in asset.headers["cache-control"]

    tab.page.goto(live_server.url + "/")
    expect(tab.page.locator("#run-empty")).to_contain_text("Select a run")
    expect(tab.page.locator("#run-list-message")).to_contain_text("No runs yet")

    tab.page.goto(live_server.url + "/?run=no/such-run")
    expect(tab.page.locator("#run-empty")).to_contain_text("Cannot show run 'no/such-run'")
    expect(tab.page.locator("#run-empty")).to_contain_text("not found")
    assert tab.errors_besides(404) == []

