"""The alerts panel at 500 alerts and the comparison views, in a real headless Chromium (tests/web/conftest.py)
against a real server; data written through the store.

Alerts: polling an idle run gets 304s only; one row per rule (warning and above by default), exact steps, a timeline with one row per rule, chart
markers coloured by the severity an alert had at that step, acknowledge / un-acknowledge / acknowledge all
changing the run list's firing count. Compare: two ticked runs overlaid, their difference heatmap, the parity
view's loss gap; every run paired by precision from the run list."""

import re

import pytest

from fp8mon.monitor.alerting.lifecycle import Alert
from fp8mon.monitor.storage.entities import AlertWrite
from fp8mon.monitor.wire import IngestBatch
from tests.monitor.twins import LAYERS, ingest

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - the browser fixture skips the module
    expect = None
else:
    expect.set_options(timeout=15_000)

pytestmark = pytest.mark.sqlite_only
RUN = "team/noisy"  # a name with "/": every URL the page builds encodes it
RULES = ["kurtosis_jump", "underflow_rise", "overflow", "amax_growth", "scale_drift", "loss_spike",
         "grad_spike", "nonfinite"]
INFO_RULES = {"scale_drift", "grad_spike"}  # only info alerts: hidden by the default filter
WARNING, CRITICAL = "#e08a00", "#d93025"


def _alerts() -> list[Alert]:
    """500 alerts over 8 rules and 63 layers; the first is the escalated one: fired as a warning at step 9432,
    critical from step 120350."""
    out = []
    for i in range(500):
        rule = RULES[i % len(RULES)]
        severity = "info" if rule in INFO_RULES else ("critical", "warning", "info")[i % 3]
        state = ("firing", "firing", "resolved", "pending")[i % 4]
        first = 10_000 + 200 * i
        alert = Alert(run=RUN, rule=rule, layer=f"blocks.{i // len(RULES)}.mlp", site="input", severity=severity,
                      state=state, message=f"{rule} on layer {i // len(RULES)}", first_step=first,
                      last_step=first + 150, fired_step=None if state == "pending" else first + 20,
                      resolved_step=first + 150 if state == "resolved" else None)
        out.append(alert)
    out[0] = Alert(run=RUN, rule="kurtosis_jump", layer="blocks.0.mlp", site="input", severity="critical",
                   state="firing", message="kurtosis 40x", first_step=9432, last_step=120_360, fired_step=9432,
                   escalated_step=120_350)
    return out


def _write_alerts(store) -> list[Alert]:
    steps = list(range(0, 120_401, 50))
    run_id = store.ingest(IngestBatch.model_validate({
        "version": 1, "batch_id": "big-loss", "run": RUN,
        "scalars": {"step": steps, "name": ["loss"] * len(steps), "value": [2.0] * len(steps)}})).run_id
    alerts = _alerts()
    store.record_assessments(run_id, [], [AlertWrite(a, resolved=a.state == "resolved") for a in alerts], {})
    return alerts


def _firing(alerts, floor=("info", "warning", "critical")) -> int:
    return sum(a.state == "firing" and a.severity in floor for a in alerts)


def test_alerts_panel_reads_at_500_alerts_and_acknowledging_changes_the_counts(store, live_server, page):
    alerts = _write_alerts(store)
    page.goto(f"{live_server.url}/?run={RUN.replace('/', '%2F')}&refresh=1")
    shown_rules = [r for r in RULES if r not in INFO_RULES]
    groups = page.locator("#alert-table tr.alert-group")
    expect(groups).to_have_count(len(shown_rules))

    # polling an idle run: every answer is a bodyless 304 (the browser revalidates its copy by ETag), while the
    # server's compactor catches up on the run's 2,400 losses too
    expect(page.locator("#refresh-status")).to_contain_text("updated")
    urls, wire = {}, {}  # the status on the wire (fetch() itself reads the cached 200) and the bytes received
    cdp = page.context.new_cdp_session(page)
    cdp.on("Network.requestWillBeSent", lambda e: urls.setdefault(e["requestId"], e["request"]["url"]))
    cdp.on("Network.responseReceivedExtraInfo", lambda e: wire.setdefault(e["requestId"], [e["statusCode"], 0]))
    cdp.on("Network.loadingFinished", lambda e: e["requestId"] in wire and wire[e["requestId"]].__setitem__(
        1, e["encodedDataLength"]))
    cdp.send("Network.enable")
    page.wait_for_timeout(3000)
    cdp.send("Network.disable")
    page.select_option("#refresh-interval", "60")
    answers = [wire[i] for i, url in urls.items() if "/api/v1/" in url and "grad_norm" not in url and i in wire]
    assert len(answers) >= 6 and {status for status, _ in answers} == {304}, answers  # (no grad_norm: 404s)
    assert max(size for _, size in answers) < 1000
    expect(groups.first).to_have_attribute("data-rule", "kurtosis_jump")  # the worst first
    expect(groups.first.locator("td.num").first).to_have_text("9432")  # exact, not 9.43e+3 or 9430
    expect(page.locator("#alert-message")).to_contain_text("below warning hidden")

    # the timeline: one row per rule, not one per alert; a readable height
    page.wait_for_function("() => (document.getElementById('alert-chart').data || []).length > 0")
    rows = page.evaluate("() => [...new Set(document.getElementById('alert-chart').data.flatMap(t => t.y))]")
    assert sorted(rows) == sorted(shown_rules)
    assert 200 <= page.locator("#alert-chart").bounding_box()["height"] <= 640

    # markers: the escalated alert fired as a warning and became critical later
    page.wait_for_function("() => (document.getElementById('loss-chart').data || [])"
                           ".some(t => t.name === 'alerts fired')")
    markers = page.evaluate("() => document.getElementById('loss-chart').data.find(t => t.name === 'alerts fired')")
    colour = dict(zip(markers["x"], markers["marker"]["color"]))
    assert (colour[9432], colour[120_350]) == (WARNING, CRITICAL)

    # with the server's escalation history (every rise, from what): each step gets the severity of its time
    at = page.evaluate("""() => [5, 10, 15, 20, 25].map(step => window.fp8monAlerts.severityAt({severity: 'critical',
        escalated_step: 20, escalations: [{step: 10, severity: 'warning', from: 'info'},
                                          {step: 20, severity: 'critical', from: 'warning'}]}, step))""")
    assert at == ["info", "warning", "warning", "critical", "critical"]

    groups.first.locator(".alert-toggle").click()
    escalated = page.locator("#alert-table tr.alert-detail").first
    expect(escalated).to_contain_text("fired 9432")
    expect(escalated).to_contain_text("escalated 120350")
    expect(escalated).to_contain_text("warning → critical")

    page.select_option("#alert-severity", "info")
    expect(groups).to_have_count(len(RULES))
    assert "alerts=info" in page.url

    firing = page.locator(".run-item .run-firing")
    expect(firing).to_have_text(f"{_firing(alerts)} firing")
    escalated.get_by_role("button", name="Acknowledge").click()
    expect(firing).to_have_text(f"{_firing(alerts) - 1} firing")
    expect(escalated.get_by_role("button")).to_have_text("Un-acknowledge")
    escalated.get_by_role("button", name="Un-acknowledge").click()
    expect(firing).to_have_text(f"{_firing(alerts)} firing")

    page.select_option("#alert-severity", "warning")
    page.get_by_role("button", name=re.compile(r"Acknowledge all \(\d+\)")).click()
    expect(firing).to_have_text(f"{_firing(alerts, ('info',))} firing")  # the info alerts are left
    expect(page.get_by_role("button", name="Acknowledge all")).to_be_disabled()
    assert page.errors == []


def test_compare_overlays_two_runs_draws_their_difference_and_pairs_by_precision(store, live_server, page):
    for seed in (1, 2):
        ingest(store, f"bf16-s{seed}", precision="bf16", seed=seed, steps=range(30), loss=lambda s: 3.0 - 0.05 * s)
        ingest(store, f"fp8-s{seed}", precision="fp8", seed=seed, steps=range(30),
               loss=lambda s, k=seed: 3.0 - 0.05 * s + 0.01 * k * s,
               kurtosis=lambda j, s: 40.0 if (j, s) == (2, 20) else 3.0 + j)
    page.goto(live_server.url + "/")
    expect(page.locator("#compare-open")).to_be_disabled()
    for name in ("bf16-s1", "fp8-s1"):
        page.locator(f".run-item[data-run='{name}'] .compare-pick").check()
    expect(page.locator("#compare-count")).to_have_text("2 runs ticked")
    page.locator("#compare-open").click()
    expect(page.locator("#compare-view")).to_be_visible()
    expect(page.locator("#run-empty")).to_be_hidden()
    assert page.url.endswith("?compare=bf16-s1&compare=fp8-s1")

    page.wait_for_function("() => (document.getElementById('compare-scalar-chart').data || []).length === 2")
    names = page.evaluate("() => document.getElementById('compare-scalar-chart').data.map(t => t.name)")
    assert names == ["bf16-s1", "fp8-s1"]

    page.wait_for_function("() => (document.getElementById('compare-diff-chart').data || [])"
                           ".some(t => t.type === 'heatmap')")
    diff = page.evaluate("() => document.getElementById('compare-diff-chart').data[0]")
    assert diff["y"] == LAYERS
    assert diff["z"][2][20] == 40.0 - 5.0 and diff["z"][0][0] == 0.0

    page.wait_for_function("() => (document.getElementById('parity-chart').data || []).length === 1")
    gap = page.evaluate("() => document.getElementById('parity-chart').data[0]")
    assert gap["name"] == "fp8-s1 − bf16-s1"
    assert [round(g, 9) for g in gap["y"]] == [round(0.01 * s, 9) for s in range(30)]
    expect(page.locator("#parity-key")).to_have_value("precision")

    # live: ten more steps of both runs reach all three views at the next refresh
    page.select_option("#refresh-interval", "2")
    for name, precision in (("bf16-s1", "bf16"), ("fp8-s1", "fp8")):
        ingest(store, name, precision=precision, seed=1, steps=range(30, 40), loss=lambda s: 2.0)
    page.wait_for_function("() => document.getElementById('compare-scalar-chart').data"
                           ".every(t => t.x.length === 40)")
    page.wait_for_function("() => (document.getElementById('parity-chart').data || [])[0]?.x.length === 40")
    page.wait_for_function("() => Math.max(...document.getElementById('compare-diff-chart').data[0].x) > 35")

    page.locator("#compare-close").click()
    expect(page.locator("#compare-view")).to_be_hidden()
    page.get_by_role("button", name="FP8 vs BF16 parity").click()  # every listed run, paired
    expect(page.locator("#parity-table tbody tr")).to_have_count(2)
    expect(page.locator("#compare-scalars-panel")).to_be_hidden()
    assert "parity=all" in page.url
    assert page.errors == []
