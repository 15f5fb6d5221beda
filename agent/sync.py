"""`fp8mon sync`: deliver the batches that runs left in their spools (a killed training, a monitor that was down at
exit, a token fixed since), oldest first per spool, the ones set aside under ``rejected/`` too.

Every batch keeps the id it was encoded with and the monitor stores a batch id once, so a sync interrupted or run
twice stores nothing twice. A delivered batch's file is removed; one refused again stays under ``rejected/`` with
the server's answer; an unreachable monitor, a wrong address (404) or a refused token stops the sync (nothing else
could pass).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from . import delivery
from .wire import CLIENT_HEADER

__all__ = ["leftover_batches", "sync"]

_RETRIES = (0.5, 1.0, 2.0)  # seconds between attempts while the monitor is unreachable or answers 5xx


def leftover_batches(roots: Iterable[Path]) -> list[Path]:
    """The spooled batch files under ``roots``, grouped by spool (``rejected/`` with its spool), oldest first."""
    files: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a spool directory")
        files.update(p for p in root.rglob("*.fp8b") if p.is_file())

    def order(path: Path) -> tuple[str, str]:
        spool = path.parent.parent if path.parent.name == "rejected" else path.parent
        return str(spool), path.name

    return sorted(files, key=order)


def sync(roots: list[Path], url: str, token: str | None) -> int:
    """Replay every leftover batch under ``roots`` to the monitor at ``url``; the process exit status."""
    try:
        endpoint = delivery.ingest_url(url)
        batches = leftover_batches(roots)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if not batches:
        print(f"fp8mon sync: nothing to replay under {', '.join(map(str, roots))}", file=sys.stderr)
        return 0
    from tqdm import tqdm

    headers = {"content-type": "application/msgpack", "content-encoding": "gzip", CLIENT_HEADER: "agent"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    delivered = duplicates = refused = 0
    last_refusal = ""
    bar = None  # shown once the monitor answered: an unreachable one is one line, not a bar at 0%
    with httpx.Client(headers=headers, timeout=30.0) as client:
        for done, path in enumerate(batches):
            try:
                body = path.read_bytes()
            except OSError as exc:
                return _fail(f"cannot read {path}: {exc.strerror or exc}", bar)
            outcome = _post(client, endpoint, body)
            if outcome.kind == delivery.STORED:
                _remove(path)
                delivered += 1
                duplicates += outcome.duplicate
            elif outcome.kind == delivery.REFUSED and not _wrong_address(outcome):
                _set_aside(path, outcome.message)
                refused += 1
                last_refusal = outcome.message
            else:
                reason = outcome.message if outcome.code else (
                    f"cannot reach the monitor at {url} ({outcome.message}): is it running, and is --url its address?")
                return _fail(f"{reason}; {len(batches) - done} batches left in place, run sync again", bar)
            if bar is None:
                bar = tqdm(total=len(batches), initial=done, unit="batch", desc="fp8mon sync", file=sys.stderr)
            bar.update()
    if bar is not None:
        bar.close()
    print(f"fp8mon sync: {delivered} batches delivered ({duplicates} of them already stored)"
          + (f", {refused} refused again (kept under rejected/ with the answer; the last: {last_refusal})"
             if refused else ""), file=sys.stderr)
    return 1 if refused else 0


def _wrong_address(outcome: delivery.Outcome) -> bool:
    """No fp8mon ingest at that address (404, a redirect): every batch would be refused, none set aside for it."""
    return outcome.code == 404 or 300 <= outcome.code < 400


def _post(client: httpx.Client, endpoint: str, body: bytes) -> delivery.Outcome:
    outcome = delivery.post(client, endpoint, body)
    for pause in _RETRIES:
        if outcome.kind != delivery.RETRY:
            break
        time.sleep(max(pause, outcome.retry_after))
        outcome = delivery.post(client, endpoint, body)
    return outcome


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(".reason").unlink(missing_ok=True)


def _set_aside(path: Path, reason: str) -> None:
    if path.parent.name != "rejected":
        rejected = path.parent / "rejected"
        rejected.mkdir(exist_ok=True)
        os.replace(path, rejected / path.name)
        path = rejected / path.name
    path.with_suffix(".reason").write_text(reason + "\n")


def _fail(message: str, bar=None) -> int:
    if bar is not None:
        bar.close()
    print(f"fp8mon sync: {message}", file=sys.stderr)
    return 1
