"""A real HTTP webhook receiver on 127.0.0.1 for the tests: records every POST; can fail the first ones."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, fail_first: int = 0, fail_status: int = 503, delay: float = 0.0):
        self.fail_first, self.fail_status, self.delay = fail_first, fail_status, delay
        self.attempts: list[tuple[float, int]] = []  # (time, status answered)
        self.received: list[dict] = []  # payloads answered with 200
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if receiver.delay:
                    time.sleep(receiver.delay)
                with receiver._lock:
                    status = receiver.fail_status if len(receiver.attempts) < receiver.fail_first else 200
                    receiver.attempts.append((time.monotonic(), status))
                    if status == 200:
                        receiver.received.append(json.loads(body))
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, predicate, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [p for p in self.received if predicate(p)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no matching webhook within {timeout}s; received {self.received}, "
                             f"attempts {self.attempts}")
