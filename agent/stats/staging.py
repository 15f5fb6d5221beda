"""Host-to-device copies of the launch tables without a host sync (``Staging``), also under CUDA-graph capture."""

from __future__ import annotations

import threading

import numpy as np
import torch

from .tuning import CAPTURE_STAGING_WORDS


class Staging:
    """Host-to-device staging without a host sync: a ring of persistent pinned int64 buffers, each reused
    only once the copy that last read it has completed (a CUDA event, polled with ``query()``, never waited
    on). When every buffer is still in flight, the ring grows by one (pinned allocation: rare, bounded by
    the number of copies in flight)."""

    def __init__(self, device: torch.device, size: int = 1 << 14, arena_words: int = CAPTURE_STAGING_WORDS):
        self.device, self.size, self.arena_words = device, size, arena_words
        self.bufs: list[list] = []  # [pinned tensor, event or None]
        self.next = 0
        self.lock = threading.Lock()
        # Under CUDA-graph capture a table is the same at every replay, so it goes to the device once, outside the
        # graph: into a device arena whose words are handed out once and never reused (graphs freed later do not
        # return their words), by a copy on a side stream that the capture does not follow. A copy captured into
        # the graph would be a node per launch, re-reading its pinned source at every replay, with idle gaps between
        # the copies and the kernels. The arenas (pinned source, device words) and the stream are made with the first
        # (eager) copy: nothing is allocated while a stream captures, and eager warm-up steps precede a capture.
        # ``Engine.captured_copies_done`` waits for the side copies; a captured launch's graph must not replay before
        # it (``StepGraphs`` calls it after each capture).
        self.arena: torch.Tensor | None = None
        self.dev_arena: torch.Tensor | None = None
        self.side: torch.cuda.Stream | None = None
        self.side_event: torch.cuda.Event | None = None
        self.arena_used = 0

    def put(self, data: bytes | bytearray) -> torch.Tensor:
        """The int64 values whose little-endian bytes are ``data``, in a new device tensor."""
        n = len(data) // 8
        if torch.cuda.is_current_stream_capturing():
            return self._put_captured(data, n)
        with self.lock:
            if self.arena is None:
                self.arena = torch.empty(self.arena_words, dtype=torch.int64, pin_memory=True)
                self.dev_arena = torch.empty(self.arena_words, dtype=torch.int64, device=self.device)
                self.side = torch.cuda.Stream(self.device)
                self.side_event = torch.cuda.Event()
            slot = None
            for j in range(len(self.bufs)):
                i = (self.next + j) % len(self.bufs)
                b = self.bufs[i]
                if b[0].numel() >= n and (b[1] is None or b[1].query()):
                    slot, self.next = b, (i + 1) % len(self.bufs)
                    break
            if slot is None:
                slot = [torch.empty(max(self.size, n), dtype=torch.int64, pin_memory=True), None]
                self.bufs.append(slot)
            host = slot[0][:n]
            host.numpy()[:] = np.frombuffer(data, dtype="<i8")  # a memcpy: no torch op
            dev = torch.empty(n, dtype=torch.int64, device=self.device)
            dev.copy_(host, non_blocking=True)
            if slot[1] is None:
                slot[1] = torch.cuda.Event()
            slot[1].record()
            return dev

    def _put_captured(self, data, n: int) -> torch.Tensor:
        with self.lock:
            if self.arena is None or self.arena_used + n > self.arena.numel():
                raise RuntimeError(
                    f"fp8mon statistics: the capture staging arena ({self.arena_words} words) is "
                    + ("exhausted by the graphs captured so far" if self.arena is not None else
                       "not allocated: run the step eagerly once before capturing it")
                    + "; make the device's Engine with more capture_words before the first launch")
            host = self.arena[self.arena_used: self.arena_used + n]
            words = slice(self.arena_used, self.arena_used + n)
            self.arena_used += n
            host.numpy()[:] = np.frombuffer(data, dtype="<i8")
            dev = self.dev_arena[words]
            with torch.cuda.stream(self.side):
                dev.copy_(host, non_blocking=True)
                self.side_event.record()
            return dev

    def copies_done(self) -> None:
        if self.side_event is not None:
            self.side_event.synchronize()
