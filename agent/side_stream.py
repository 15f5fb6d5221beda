"""Statistics reads that the step never waits for, queued on a CUDA stream of their own.

A row that no scale decides and that nothing reads before the step's rows are merged (a forward tensor's row on
the Triton path, merged by the launch that ends the step) need not hold up the kernels queued after it. With
``ENABLED`` (``FP8MON_SIDE_READS=1``) such a read goes to a side stream: it waits for the kernels before it (``forked``),
and the step's stream waits for it only where rows are merged (``triton_stats.merge_later`` calls ``join``). It can
then run beside the step's GEMMs, which are bound by their arithmetic and leave memory bandwidth unused, with few
programs (``PROGRAMS``), so that it takes few SMs from them. Under CUDA-graph capture the fork and the join become
edges of the graph.

The tensors read there are kept alive until the join, since the step's stream may free them before the side stream
reads them (an activation freed in the backward pass). Nothing may write them in place before the join: an in-place
activation function after a watched linear would race with the read of its output. The trainer's model has none; a
model of any other code may, which is why this is off unless asked for.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

ENABLED = os.environ.get("FP8MON_SIDE_READS", "0") == "1"
# The weights' gradients too, each read as it comes (``Agent.observe_after_backward``), not at the backward's end.
GRADS = os.environ.get("FP8MON_SIDE_GRADS", "0") == "1"
# Programs of a launch on the side stream (about: its chunks are sized for it; ``triton_stats._chunk_elems``).
PROGRAMS = int(os.environ.get("FP8MON_SIDE_PROGRAMS", "16"))

_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}
_kept: dict[int, list[torch.Tensor]] = {}  # per device: what the side stream reads and the step has not waited for


def wanted(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def forked(device: torch.device, tensors: list[torch.Tensor]):
    """Launches made inside run on ``device``'s side stream, after everything queued so far on the current one."""
    key = _index(device)
    with _lock:
        side = _streams.get(key)
        if side is None:
            side = _streams[key] = torch.cuda.Stream(device=key)
    side.wait_stream(torch.cuda.current_stream(key))
    with torch.cuda.stream(side):
        yield
    with _lock:
        _kept.setdefault(key, []).extend(tensors)


def join() -> None:
    """The current stream of each device waits for the reads queued on its side stream so far."""
    if not _kept:
        return
    with _lock:
        pending = [key for key, kept in _kept.items() if kept]
    for key in pending:
        current = torch.cuda.current_stream(key)
        side = _streams[key]
        if current == side:  # a merge queued from inside ``forked`` is ordered after the reads already
            continue
        current.wait_stream(side)
        with _lock:
            _kept[key] = []
