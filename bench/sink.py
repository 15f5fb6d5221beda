"""A stand-in ingest endpoint (stdlib only) that acknowledges every batch: for measuring the agent's
client-side cost on machines where the monitor's server dependencies are not installed."""

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Ack(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"duplicate": False}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ack)
    print(server.server_address[1], flush=True)
    server.serve_forever()
