"""`fp8mon serve` as a child process on 127.0.0.1, started and waited for until it answers /healthz: what
the tests, the benchmarks and scripts/make_fixtures.py run when they need a real server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """`fp8mon serve` on `database_url`; `args` are more serve flags (e.g. "--migrate", "--workers", "4"),
    `env` overrides the environment, `log` collects its output (appended); `quiet`: warnings only, no access
    log."""

    database_url: str
    port: int = field(default_factory=free_port)
    env: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()
    log: Path | None = None
    quiet: bool = True
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start it and return once /healthz answers 200; RuntimeError if it exits or stays silent."""
        self._log_file = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fp8mon", "serve", "--database-url", self.database_url,
             "--port", str(self.port), *self.args,
             *(("--no-access-log", "--log-level", "warning") if self.quiet else ())],
            env={**os.environ, **self.env}, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not come up in {timeout:g} s; log: {self.log}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
