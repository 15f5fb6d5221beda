"""An on-disk queue of encoded batches: written atomically, read back oldest first, bounded in size.

Each batch is one file `<sequence>-<batch_id>.fp8b`, so a batch keeps its id across a process restart
and the server's idempotency makes a replay after a crash harmless. The directory is listed once, when the
spool opens; afterwards the order lives in memory, so replaying n batches costs O(n).

A directory that cannot be written (disk full, read-only, not creatable) degrades the spool to memory for the
rest of the process: one error, new batches are kept in a bounded in-memory queue and still delivered from there;
whatever is still in memory at ``close`` is written to the directory if it has become writable, else it is lost
and counted.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fp8mon.agent")

_NAME = re.compile(r"^(\d{16})-([0-9a-f]{32})\.fp8b$")
_MEMORY_BYTES = 256 << 20  # the in-memory queue of a degraded spool holds at most this much (or max_bytes)


def spool_root() -> Path:
    """Where every run's spool lives unless ``spool_dir`` says otherwise."""
    return Path.home() / ".cache" / "fp8mon" / "spool"


def default_spool_dir(run: str) -> Path:
    return spool_root() / run.replace("/", "_")


@dataclass
class Entry:
    batch_id: str
    name: str  # <sequence>-<batch_id>.fp8b
    size: int
    body: bytes | None = None  # set while the batch lives in memory only


class Spool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = 1 << 30):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.dropped_batches = 0
        self.unwritable: str | None = None  # why the spool keeps new batches in memory
        self._disk: deque[Entry] = deque()
        self._memory: deque[Entry] = deque()  # newer than every batch on disk
        self._bytes = self._memory_bytes = 0
        self._next = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            names = sorted(n for n in os.listdir(self.directory) if _NAME.match(n))
        except OSError as exc:
            self._degrade(exc)
            names = []
        for name in names:
            try:
                size = (self.directory / name).stat().st_size
            except OSError:
                continue
            self._disk.append(Entry(_NAME.match(name)[2], name, size))
            self._bytes += size
        if names:
            self._next = int(_NAME.match(names[-1])[1]) + 1

    def __len__(self) -> int:
        return len(self._disk) + len(self._memory)

    @property
    def on_disk(self) -> int:
        return len(self._disk)

    @property
    def in_memory(self) -> int:
        return len(self._memory)

    @property
    def bytes(self) -> int:
        return self._bytes

    def push(self, batch_id: str, body: bytes) -> None:
        """Keep a batch until ``remove``; never raises for the disk (it degrades to memory instead)."""
        while self._bytes + len(body) > self.max_bytes and self._drop_oldest(self._disk or self._memory):
            pass
        entry = Entry(batch_id, f"{self._next:016d}-{batch_id}.fp8b", len(body))
        self._next += 1
        if self.unwritable is None:
            try:
                self._write(self.directory / entry.name, body)
                self._disk.append(entry)
                self._bytes += entry.size
                return
            except OSError as exc:
                self._degrade(exc)
        while self._memory_bytes + len(body) > min(self.max_bytes, _MEMORY_BYTES) and \
                self._drop_oldest(self._memory):
            pass
        entry.body = body
        self._memory.append(entry)
        self._bytes += entry.size
        self._memory_bytes += entry.size

    def peek(self) -> tuple[Entry, bytes] | None:
        """The oldest batch and its encoded body; None when the spool is empty."""
        while self._disk:
            entry = self._disk[0]
            try:
                return entry, (self.directory / entry.name).read_bytes()
            except OSError as exc:  # removed or unreadable behind our back: nothing to send
                log.error("fp8mon: spooled batch %s cannot be read (%r); skipped", entry.name, exc)
                self._pop(entry)
                self.dropped_batches += 1
        if self._memory:
            return self._memory[0], self._memory[0].body
        return None

    def remove(self, entry: Entry) -> None:
        """Forget a delivered batch (the oldest, as ``peek`` gave it)."""
        if self._pop(entry) and entry.body is None:
            try:
                (self.directory / entry.name).unlink()
            except FileNotFoundError:
                pass

    def reject(self, entry: Entry, body: bytes, reason: str) -> Path | None:
        """Set aside a batch the server refused for good, with its answer beside it; never retried. None when
        it could not be written (then it is dropped and counted)."""
        if not self._pop(entry):
            return None
        rejected = self.directory / "rejected"
        kept = rejected / entry.name
        try:
            rejected.mkdir(exist_ok=True)
            if entry.body is None:
                os.replace(self.directory / entry.name, kept)
            else:
                self._write(kept, body)
            kept.with_suffix(".reason").write_text(reason + "\n")
            return kept
        except OSError as exc:
            log.error("fp8mon: could not set refused batch %s aside under %s (%r): dropped", entry.name, rejected, exc)
            self.dropped_batches += 1
            return None

    def persist(self) -> int:
        """At close: write the batches held in memory to the directory, if it can be written now; the ones it cannot
        take are dropped (the process ends) and counted. Returns how many were dropped."""
        dropped = 0
        while self._memory:
            entry = self._memory[0]
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._write(self.directory / entry.name, entry.body)
            except OSError:
                self._pop(entry)
                dropped += 1
                continue
            self._pop(entry)
            entry.body = None
            self._disk.append(entry)
            self._bytes += entry.size
        self.dropped_batches += dropped
        return dropped

    def _pop(self, entry: Entry) -> bool:
        """Forget the oldest batch; False when ``entry`` is not it (dropped for room while it was being sent)."""
        queue = self._disk if self._disk and self._disk[0] is entry else self._memory
        if not queue or queue[0] is not entry:
            return False
        queue.popleft()
        self._bytes -= entry.size
        if entry.body is not None:
            self._memory_bytes -= entry.size
        return True

    def _drop_oldest(self, queue: deque) -> bool:
        if not queue:
            return False
        entry = queue[0]
        where = "memory" if entry.body is not None else str(self.directory)
        if not self.dropped_batches:
            log.error("fp8mon spool %s is full: dropping its oldest batches, the first %s (counted in "
                      "agent.status().lost)", where, entry.name)
        self.remove(entry)
        self.dropped_batches += 1
        return True

    def _degrade(self, exc: OSError) -> None:  # the transport reports it, once
        self.unwritable = f"{self.directory}: {exc.strerror or exc!r}"

    @staticmethod
    def _write(path: Path, body: bytes) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a reader never sees half a batch
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
