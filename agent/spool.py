"""An on-disk queue of encoded batches: written atomically, read back oldest first, bounded in size.

Each batch is one file `<sequence>-<batch_id>.fp8b`, so a batch keeps its id across a process restart
and the server's idempotency makes a replay after a crash harmless.
"""

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("fp8mon.agent")

_NAME = re.compile(r"^(\d{16})-([0-9a-f]{32})\.fp8b$")


def default_spool_dir(run: str) -> Path:
    return Path.home() / ".cache" / "fp8mon" / "spool" / run.replace("/", "_")


class Spool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = 1 << 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dropped_batches = 0
        entries = self._entries()
        self._next = (int(_NAME.match(entries[-1].name)[1]) + 1) if entries else 0
        self._bytes = sum(p.stat().st_size for p in entries)

    def _entries(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def __len__(self) -> int:
        return len(self._entries())

    @property
    def bytes(self) -> int:
        return self._bytes

    def push(self, batch_id: str, body: bytes) -> None:
        while self._bytes + len(body) > self.max_bytes and self._drop_oldest():
            pass
        path = self.directory / f"{self._next:016d}-{batch_id}.fp8b"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a reader never sees half a batch
        self._next += 1
        self._bytes += len(body)

    def peek(self) -> tuple[Path, str, bytes] | None:
        entries = self._entries()
        if not entries:
            return None
        path = entries[0]
        return path, _NAME.match(path.name)[2], path.read_bytes()

    def remove(self, path: Path) -> None:
        size = path.stat().st_size
        path.unlink()
        self._bytes -= size

    def reject(self, batch_id: str, body: bytes, reason: str, path: Path | None = None) -> Path:
        """Keep a batch the server refused as invalid aside for inspection; it is never retried."""
        rejected = self.directory / "rejected"
        rejected.mkdir(exist_ok=True)
        kept = rejected / f"{batch_id}.fp8b"
        kept.write_bytes(body)
        kept.with_suffix(".reason").write_text(reason)
        if path is not None:
            self.remove(path)
        return kept

    def _drop_oldest(self) -> bool:
        entries = self._entries()
        if not entries:
            return False
        log.error("fp8mon spool %s is full (%d bytes): dropping its oldest batch %s",
                  self.directory, self.max_bytes, entries[0].name)
        self.remove(entries[0])
        self.dropped_batches += 1
        return True
