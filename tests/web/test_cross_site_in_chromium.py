"""A page from another origin, in a real headless Chromium, cannot acknowledge the monitor's alerts or inject a
run into it (the monitor has no tokens, as by default), while the dashboard itself still acknowledges.

The other origin is a second HTTP server on another loopback port serving the attacker's page: a form that posts
to the monitor, `no-cors` fetches (which need no CORS permission to be sent), and a fetch that tries the client
header (which needs a CORS preflight that the monitor never grants).
"""

import http.server
import json
import threading
import time

import httpx
import pytest

from fp8mon.agent.wire import CLIENT_HEADER
from fp8mon.monitor.localserver import free_port
from tests.integration.streams import fake_predictor_env, kurtosis_stream

INJECTED = {"version": 1, "batch_id": "injected-0", "run": "injected",
            "scalars": {"step": [0], "name": ["loss"], "value": [1.0]}}


def attacker_pages(monitor: str, alert_id: int) -> dict[str, str]:
    ack = f"{monitor}/api/v1/alerts/{alert_id}/ack"
    ingest = f"{monitor}/api/v1/ingest"
    batch = json.dumps(INJECTED)
    return {
        "/form.html": f"""<form id=f method=POST action="{ack}"></form>
            <script>document.getElementById('f').submit()</script>""",
        "/form-ingest.html": f"""<form id=f method=POST enctype="text/plain" action="{ingest}">
            <input type=hidden name='{batch[:-1]}, "x": "' value='"}}'></form>
            <script>document.getElementById('f').submit()</script>""",
        "/fetch.html": f"""<script>
            window.done = (async () => {{
              const results = [];
              const tries = [
                ["{ack}", {{method: "POST", mode: "no-cors"}}],
                ["{ingest}", {{method: "POST", mode: "no-cors", body: new Blob([{json.dumps(batch)}])}}],
                ["{ack}", {{method: "POST", headers: {{"{CLIENT_HEADER}": "x"}}}}],
                ["{ingest}", {{method: "POST", body: {json.dumps(batch)},
                               headers: {{"{CLIENT_HEADER}": "x", "Content-Type": "application/json"}}}}],
              ];
              for (const [url, init] of tries) {{
                try {{ await fetch(url, init); results.push("sent"); }}
                catch (err) {{ results.push("blocked: " + err.message); }}
              }}
              return results;
            }})();
        </script>""",
    }


@pytest.fixture
def attacker():
    """`serve(pages)`: a second server, on another loopback port, serving {path: html}; returns its base URL."""
    servers = []

    def serve(pages: dict[str, str]) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                body = pages.get(self.path, "").encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def firing_alerts(server) -> list[dict]:
    """Feed a run whose kurtosis jumps (the fake threshold predictor) and wait for its alerts."""
    with httpx.Client(base_url=server.url, timeout=30, headers={CLIENT_HEADER: "tests"}) as client:
        for body in kurtosis_stream("victim", range(0, 40), lambda s: 30.0 if s > 5 else 3.0):
            client.post("/api/v1/ingest", json=body).raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alerts = client.get("/api/v1/alerts").json()["alerts"]
            if alerts:
                return alerts
            time.sleep(0.1)
    raise AssertionError("no alert within 30 s")


@pytest.mark.sqlite_only
def test_another_origin_cannot_acknowledge_or_inject_but_the_dashboard_can(server_factory, attacker, browser):
    server = server_factory(**fake_predictor_env()).start()
    alert = firing_alerts(server)[0]
    evil = attacker(attacker_pages(server.url, alert["id"]))

    page = browser.new_page()
    try:
        for path in ("/form.html", "/form-ingest.html"):
            with page.expect_navigation(url=f"{server.url}/**"):
                page.goto(evil + path)
            assert "cross-site" in page.content()  # the monitor's 403 answer, shown in the tab
        page.goto(evil + "/fetch.html")
        results = page.evaluate("window.done")
        assert results[:2] == ["sent", "sent"], results  # no-cors requests do leave the browser
        assert all(r.startswith("blocked") for r in results[2:]), results  # the preflight fails

        def api(path):
            return httpx.get(f"{server.url}/api/v1{path}", timeout=10)

        assert all(a["acknowledged_at"] is None for a in api("/alerts").json()["alerts"])
        assert api("/runs/injected").status_code == 404

        # the dashboard, from its own origin, through its own API helper
        page.goto(server.url + "/")
        acked = page.evaluate("id => window.fp8mon.api(`/alerts/${id}/ack`, {method: 'POST'})", alert["id"])
        assert acked["acknowledged_at"] is not None
        assert next(a for a in api("/alerts").json()["alerts"] if a["id"] == alert["id"])["acknowledged_at"]
    finally:
        page.close()
