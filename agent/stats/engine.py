"""The statistics engine of a device: what every launch on that device shares (``Engine``).

An ``Engine`` owns, for its device, the counter rows of the last-program merge, the staging of launch tables
(``staging.Staging``), the rows waiting for a later merge, the tensors deferred to the next launch, the epoch words
through which a statistics launch hands its cast the amax, and the launch shape (chunk, tile rows). ``engine(device)``
returns the device's one engine: fused kernels, the agent's hooks and the trainer's casts on a device share it
(launches on one stream are ordered, so they can share counter rows and merge queues).

The launches themselves: ``Engine.launch`` cuts a list of tensors into launches of ``kernels.standalone.stats_kernel``
(``launch.rows`` is the public entry); rows left to be merged later are merged by ``Engine.merge_later``, one
``kernels.merge.merge_kernel`` launch for all of them.
"""

from __future__ import annotations

import struct
import threading

import torch

from ..formats import by_name
from . import torch_path as tp
from .layout import (
    CTRW,
    FORMAT_CODES,
    MERGE_ROW,
    PW,
    SCALE_CAST,
    SCALE_CURRENT,
    SCALE_GIVEN,
    SCALE_NONE,
    TABLE_ROW,
    WIDTH,
)
from .staging import Staging
from .tuning import (
    CAPTURE_STAGING_WORDS,
    CHUNK,
    INTERPRET,
    MAX_DEFERRED,
    MAX_LATER,
    MAX_TENSORS,
    MAXNREG,
    MAXNREG_FP32,
    NUM_WARPS,
    P_BLOCK,
    ROWS,
)

DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}


def f32(v: float) -> float:
    """``v`` rounded to fp32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", float(v)))[0]


def scale_of_history(ahm: float, fmt) -> float:
    """``torch_path.scale_from_amax`` for a number: fp32(max / ahm), 1.0 for 0 or non-finite."""
    if not (ahm == ahm and 0 < ahm < float("inf")):
        return 1.0
    return f32(fmt.max / ahm)


def addressed(v: torch.Tensor, device, dtype, shape) -> torch.Tensor:
    """``v`` as a contiguous ``dtype`` tensor of ``shape`` on ``device`` that the kernel reads by address: ``v``
    itself when it already is one (no torch op: each costs microseconds of host time on CUDA)."""
    if v.device == device and v.dtype == dtype and v.shape == shape and v.is_contiguous():
        return v
    return v.detach().to(device=device, dtype=dtype).reshape(shape).contiguous()


def center_fields(c, device) -> tuple[torch.Tensor | None, float, float]:
    """(fp64 device tensor of 2 to read by address, or None; mean; std) of an outlier center (a ``Target``'s: (mean,
    std), a device tensor of 2, or None); no center: (None, 0, NaN), which counts no outlier."""
    if isinstance(c, torch.Tensor):
        return addressed(c, torch.device(device), torch.float64, (2,)), 0.0, float("nan")
    return (None, 0.0, float("nan")) if c is None else (None, float(c[0]), float(c[1]))


def merge_codes(target) -> tuple[int, int]:
    """(scale mode, format code) with which the merge kernel finishes a ``launch.Target``'s row."""
    if target.fmt is None:
        return SCALE_NONE, 0
    return SCALE_CURRENT, FORMAT_CODES[by_name(target.fmt).name]


_engines: dict = {}
_engines_lock = threading.Lock()


def engine(device) -> Engine:
    """The engine of ``device`` (made on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    with _engines_lock:
        e = _engines.get(key)
        if e is None:
            e = _engines[key] = Engine(device)
        return e


def engines() -> list[Engine]:
    """Every engine made so far."""
    with _engines_lock:
        return list(_engines.values())


class Engine:
    """The statistics engine of one device (see the module docstring). ``chunk``: the most elements per program of
    the standalone kernel; ``tile_rows``: rows of its [rows, 16 bytes] tiles (tests on the CPU make both small, so
    that small tensors span several programs and tiles). ``trace``: a list to receive each launch's
    ``[programs, 16]`` int32 timer stamps (benches), or None."""

    def __init__(self, device: torch.device, *, chunk: int = CHUNK, tile_rows: int = ROWS,
                 capture_words: int = CAPTURE_STAGING_WORDS):
        self.device = device
        self.chunk, self.tile_rows = chunk, tile_rows
        self.trace: list | None = None
        self._lock = threading.Lock()
        self._counters: torch.Tensor | None = None
        self._staging = Staging(device, arena_words=capture_words) if device.type == "cuda" else None
        self._slot_count: dict = {}
        self._later: list = []  # (partials, row buffer, hist, MERGE_ROW bytes): kept alive until merged
        self._later_dsts: set = set()  # (row buffer address, index) of the rows waiting
        self._deferred: list = []  # launch items (``launch_items``) waiting for the next launch
        self._epoch: torch.Tensor | None = None

    # ---- device memory shared by the launches ----------------------------------------------------------------

    def counters(self) -> torch.Tensor:
        """The int64 counter rows of the last-program-done merge (``[MAX_TENSORS, CTRW]``: programs done,
        histogram). Each launch leaves them at 0 again; launches on one stream are ordered, so they can share them."""
        with self._lock:
            if self._counters is None:
                self._counters = torch.zeros(MAX_TENSORS, CTRW, dtype=torch.int64, device=self.device)
            return self._counters

    def to_device(self, values: list[int] | bytes | bytearray) -> torch.Tensor:
        """int64 ``values`` (a list, or their little-endian bytes) as a tensor on the device, without a host sync on
        CUDA (``Staging``)."""
        data = values if isinstance(values, (bytes, bytearray)) else struct.pack(f"<{len(values)}q", *values)
        if self._staging is None:
            return torch.frombuffer(bytearray(data), dtype=torch.int64)
        with torch.cuda.device(self.device):
            return self._staging.put(data)

    def captured_copies_done(self) -> None:
        """Wait for the copies of the tables of launches captured so far: call it after a capture, before its graph
        first replays. Not while a stream captures."""
        if self._staging is not None:
            self._staging.copies_done()

    def epoch_words(self) -> torch.Tensor:
        """The two int64 words through which a ``LATER`` statistics launch hands its cast the amax: every program of
        the cast's tensor does an atomic max of ``(e + 1) << 32 | amax bits`` into word 0, where ``e`` is word 1, the
        epoch the last cast read (``quantize_transpose``'s ``EPOCH``), which records ``e + 1`` in turn. A value left
        from an earlier launch carries a lower epoch, so no reset is needed between launches. A statistics launch and
        its cast follow each other on one stream. Made on the first use, which must not be under CUDA-graph capture
        (eager warm-up steps precede a capture)."""
        if self._epoch is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fp8mon statistics: a cast's statistics launch under CUDA-graph capture before any "
                                   "eager one: run the step eagerly once before capturing it")
            self._epoch = torch.zeros(2, dtype=torch.int64, device=self.device)
        return self._epoch

    # ---- launch shape ----------------------------------------------------------------------------------------

    def _slots(self, cap: int) -> int:
        """Programs of the standalone kernel the GPU runs at once (SMs x programs per SM at register cap ``cap``)."""
        if cap not in self._slot_count:
            props = torch.cuda.get_device_properties(self.device.index)
            threads = 32 * NUM_WARPS
            per_sm = props.max_threads_per_multi_processor // threads
            if cap:
                per_sm = min(per_sm, props.regs_per_multiprocessor // (cap * threads))
            self._slot_count[cap] = props.multi_processor_count * max(1, per_sm)
        return self._slot_count[cap]

    def chunk_elems(self, numels: list[int], cap: int) -> int:
        """Elements per program: ``chunk``, or on a GPU the chunk that cuts tensors of ``numels`` elements into at
        most one program per slot, a whole number of [tile_rows, 8] tiles (so every start stays 16-byte aligned).
        Each tensor's last chunk may be partial, so k tensors need up to k programs more than total / chunk: the
        chunk is sized for target - k programs (a second wave of a few programs costs more than smaller chunks)."""
        if self.device.type != "cuda":
            return self.chunk
        tile = self.tile_rows * 8
        target = self._slots(cap)
        k = len(numels)
        per = -(-sum(numels) // (target - k if 2 * k <= target else target))
        return max(tile, min(self.chunk, -(-per // tile) * tile))

    # ---- the standalone kernel ---------------------------------------------------------------------------------

    def launch(self, tensors, fmts, scales, centers, k, ahms, hist, out, index, merges, aouts=None,
               later: bool = False) -> None:
        """``launch_once`` of the tensors, in as few launches as keep their rows apart: a tensor whose row is already
        the destination of an earlier tensor of the launch goes to the next launch. (A launch's programs run in any
        order: two merges into one row in one launch would race, and the second micro-batch's row of a tensor,
        deferred with the first's, could be read before the first is written.)"""
        aouts = aouts or [None] * len(tensors)
        start, seen = 0, set()
        for i, dst in enumerate(index):
            if int(dst) in seen:
                self.launch_once(tensors[start:i], fmts[start:i], scales[start:i], centers[start:i], k, ahms[start:i],
                                 hist, out, index[start:i], merges[start:i], aouts[start:i], later)
                start, seen = i, set()
            seen.add(int(dst))
        self.launch_once(tensors[start:], fmts[start:], scales[start:], centers[start:], k, ahms[start:], hist, out,
                         index[start:], merges[start:], aouts[start:], later)

    def _table_row(self, table: bytearray, i: int, x, fmt_name, s, center, k, ahm, index, merge, aout, first, nwork,
                   chunk, keep: list) -> tuple[int, int]:
        """Pack tensor ``x``'s row of the launch table at ``i``; (scale mode, format code)."""
        device = self.device
        fmt = None if fmt_name is None else by_name(fmt_name)
        smode, s_addr, s_val = SCALE_NONE, 0, float("nan")
        ahm_addr, ahm_val = 0, float("nan")
        if isinstance(ahm, torch.Tensor):
            ahm = addressed(ahm, device, torch.float32, ())
            keep.append(ahm)
            ahm_addr = ahm.data_ptr()
        elif ahm is not None:
            ahm_val = float(ahm)
        if fmt is not None:
            if s is None and ahm is not None:  # delayed scale from the history max, margin 0
                s = tp.scale_from_amax(ahm, fmt) if isinstance(ahm, torch.Tensor) else scale_of_history(ahm_val, fmt)
            if aout is not None:
                smode = SCALE_CAST
            elif s is None:
                smode = SCALE_CURRENT
            elif isinstance(s, torch.Tensor):
                s = addressed(s, device, torch.float32, ())
                keep.append(s)
                smode, s_addr = SCALE_GIVEN, s.data_ptr()
            else:
                smode, s_val = SCALE_GIVEN, f32(s)
        elif s is not None:
            raise ValueError("a scale needs an FP8 format (fmt='e4m3' or 'e5m2')")
        c, c_mean, c_std = center_fields(center, device)
        keep.append(c)
        c_addr = 0 if c is None else c.data_ptr()
        fcode = FORMAT_CODES.get(fmt.name, 0) if fmt is not None else 0
        TABLE_ROW.pack_into(table, i * TABLE_ROW.size, x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype], first, nwork,
                            int(index), int(bool(merge)), smode, s_addr, s_val, c_addr, c_mean, c_std, ahm_addr,
                            ahm_val, fcode, k, chunk, aout.data_ptr() if smode == SCALE_CAST else 0, 0)
        return smode, fcode

    def launch_once(self, tensors, fmts, scales, centers, k, ahms, hist, out, index, merges, aouts=None,
                    later: bool = False) -> None:
        """One launch of the standalone kernel (``launch.rows``). ``aouts``: per tensor None, or the fp32 device
        tensor that receives its finite amax; such a tensor's scale is that of its current-scaling cast
        (``cast_row``). ``later``: the rows are merged by the next ``merge_later``, and an amax goes to the
        ``epoch_words`` given as its ``aouts``."""
        from .kernels.standalone import stats_kernel

        device = self.device
        aouts = aouts or [None] * len(tensors)
        keep = []  # what the device reads by address: alive until the launch is queued
        table = bytearray(TABLE_ROW.size * len(tensors))
        spans, modes = [], []  # per tensor (first program, programs), (scale mode, format code)
        nwork_total = 0
        # other dtypes are read as fp32 (below): a launch without 16-bit tensors is an fp32 launch
        cap = MAXNREG if any(x.dtype in (torch.bfloat16, torch.float16) for x in tensors) else MAXNREG_FP32
        chunk = self.chunk_elems([x.numel() for x in tensors], cap)
        for i, x in enumerate(tensors):
            if x.device != device:
                raise ValueError("rows(): all tensors must be on one device")
            if x.dtype not in DTYPE_CODES:
                x = x.detach().to(torch.float32)
            if not x.is_contiguous() or (x.data_ptr() % 16 and x.numel()):  # the kernel loads 16 aligned bytes
                x = x.detach().contiguous() if not x.is_contiguous() else x.detach().clone()
            keep.append(x)
            nwork = max(1, -(-x.numel() // chunk))
            first, nwork_total = nwork_total, nwork_total + nwork
            modes.append(self._table_row(table, i, x, fmts[i], scales[i], centers[i], k, ahms[i], index[i], merges[i],
                                         aouts[i], first, nwork, chunk, keep))
            spans.append((first, nwork))
        tab = self.to_device(table)
        # field-major; merged later, with each program's histogram beside its partial
        part = torch.empty(PW + (64 if later and hist else 0), nwork_total, dtype=torch.float64, device=device)
        dsts = [(out.data_ptr(), int(i)) for i in index]
        if any(d in self._later_dsts for d in dsts):  # a row merged into twice: the first merge goes first
            self.merge_later()
        opts = {} if INTERPRET or not cap else {"maxnreg": cap}
        trace = None if self.trace is None else torch.zeros(nwork_total, 16, dtype=torch.int32, device=device)
        stats_kernel[(nwork_total,)](tab, len(tensors), part, self.counters(), out, part if trace is None else trace,
                                     HIST=bool(hist), R=self.tile_rows, TRACE=trace is not None,
                                     NARROW=chunk * P_BLOCK < 2**31, LATER=later, num_warps=NUM_WARPS, **opts)
        if trace is not None:
            self.trace.append(trace)
        del keep
        if later:
            for i, ((first, nwork), (smode, fcode)) in enumerate(zip(spans, modes)):
                self._queue_merge(part, nwork_total, first, nwork, out, dsts[i][1], bool(hist), bool(merges[i]), smode,
                                  fcode)
            if len(self._later) >= MAX_LATER:
                self.merge_later()

    # ---- rows merged later -------------------------------------------------------------------------------------

    def _queue_merge(self, part: torch.Tensor, stride: int, first: int, nwork: int, rows: torch.Tensor, index: int,
                     hist: bool, merge: bool, smode: int, fcode: int) -> None:
        """Queue the row ``rows[index]`` for ``merge_later``: the ``nwork`` partials from column ``first`` of ``part``
        (field-major, ``stride`` columns, the histograms beside them with ``hist``)."""
        with self._lock:
            self._later.append((part, rows, hist, MERGE_ROW.pack(part.data_ptr(), stride, first, nwork,
                                                                 rows.data_ptr() + index * WIDTH * 8, int(merge), smode,
                                                                 fcode)))
            self._later_dsts.add((rows.data_ptr(), index))

    def wait_for_merges(self, part: torch.Tensor, targets: list, spans: list[tuple[int, int]]) -> None:
        """Queue for ``merge_later`` the partials of the launch that follows: target i's ``spans[i]`` = (first column,
        programs) of ``part``. A row already waiting is merged first (never after queuing: the launch comes next)."""
        if any((t.rows.data_ptr(), int(t.index)) in self._later_dsts for t in targets) or \
                len(self._later) + len(targets) > MAX_LATER:
            self.merge_later()
        total = sum(n for _, n in spans)
        for t, (first, n) in zip(targets, spans, strict=True):
            smode, fcode = merge_codes(t)
            self._queue_merge(part, total, first, n, t.rows, int(t.index), bool(t.hist), bool(t.merge), smode, fcode)

    def merge_later(self) -> None:
        """Merge the rows that launches left in their partials: one launch per histogram setting."""
        if not self._later:
            return
        from .kernels.merge import merge_kernel

        with self._lock:
            todo, self._later = self._later, []
            self._later_dsts.clear()
        groups: dict = {}
        for part, out, hist, mrow in todo:
            groups.setdefault(hist, []).append((part, out, mrow))
        for hist, entries in groups.items():
            mtab = self.to_device(b"".join(m for _, _, m in entries))
            merge_kernel[(len(entries),)](mtab, mtab, HIST=hist, PB=8 if INTERPRET else P_BLOCK, num_warps=NUM_WARPS)
            del entries  # the partials (and a row buffer no longer used) may be reused once the launch is queued

    # ---- deferred rows and casts -------------------------------------------------------------------------------

    def launch_items(self, items: list, later: bool = False) -> None:
        """(tensor, Target, fmt, amax_out) items, each row into its target with the current scaling of ``fmt`` (the
        cast's, with x's amax into ``amax_out``, where that is not None: ``cast_row``): one launch per histogram
        setting, outlier k and row buffer (launch-wide), in one launch the usual case. ``later``: see
        ``launch_once`` (an ``amax_out`` is then the ``epoch_words``)."""
        groups: dict = {}
        for item in items:
            t = item[1]
            groups.setdefault((bool(t.hist), float(t.outlier_k), t.rows.data_ptr()), []).append(item)
        for (hist, k, _), group in groups.items():
            ts_ = [t for _, t, _, _ in group]
            self.launch([x for x, _, _, _ in group], [f for _, _, f, _ in group], [None] * len(group),
                        [t.center for t in ts_], k, [t.amax_history_max for t in ts_], hist, ts_[0].rows,
                        [int(t.index) for t in ts_], [bool(t.merge) for t in ts_],
                        aouts=[a for _, _, _, a in group], later=later)

    def defer(self, x: torch.Tensor, target) -> None:
        """See ``launch.defer``."""
        with self._lock:
            self._deferred.append((x.detach(), target, target.fmt, None))
            items = None
            if len(self._deferred) >= MAX_DEFERRED:
                items, self._deferred = self._deferred, []
        if items:
            self.launch_items(items)

    def take_deferred(self) -> list:
        if not self._deferred:
            return []
        with self._lock:
            items, self._deferred = self._deferred, []
        return items

    def flush_deferred(self) -> None:
        """Write every deferred row now, and merge the rows waiting for ``merge_later``."""
        items = self.take_deferred()
        if items:
            self.launch_items(items)
        self.merge_later()

    def cast_row(self, x: torch.Tensor, fmt, target) -> torch.Tensor:
        """See ``launch.cast_row``."""
        word = self.epoch_words()
        self.launch_items([(x, target, by_name(fmt).name, word)] + self.take_deferred(), later=True)
        return word

    def cast_rows(self, items: list) -> None:
        """See ``launch.cast_rows``."""
        todo = [(x, t, by_name(f).name, a) for x, f, t, a in items] + self.take_deferred()
        for lo in range(0, len(todo), MAX_TENSORS):
            self.launch_items(todo[lo: lo + MAX_TENSORS])
