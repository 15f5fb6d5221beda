"""Waiting for a Prometheus-family server started by a test (Prometheus, Alertmanager) to answer /-/ready."""

import subprocess
import time
from pathlib import Path

import httpx


def wait_ready(proc: subprocess.Popen, url: str, log: Path, name: str, timeout: float, poll: float) -> None:
    """Return once ``url``/-/ready answers 200; RuntimeError (with the end of ``log``) if ``proc`` exits first, or
    if ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"{name} did not become ready")
