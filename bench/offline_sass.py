"""Offline sm_90a build of the quantize-transpose kernels (plain and with statistics) or, with ``--standalone``, of
the standalone statistics kernel (``agent/triton_stats.py``), or with ``--consumers`` of the consumer kernels
(``trainer/kernels/swiglu.py``, ``residual.py``, ``rope.py``) and RMSNorm's (``rmsnorm.py``), no GPU needed: registers,
spill stack, shared memory, and the SASS instruction count of the longest loop (the statistics' tile loop) per kernel.

Needs a Triton whose backend can compile for sm_90a on this machine (its bundled ptxas and cuobjdump), e.g. the
Triton 3.6 wheel the GPU machines run, unpacked apart from the project's own::

    pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 triton==3.6.0 -d W
    pip install --no-deps --target T W/triton*.whl
    PYTHONPATH=T:$PWD python bench/offline_sass.py [bfloat16|float32] [--hist] [--fmt e5m2] [--v 8] [--standalone]

With ``SASS_OUT=file`` the last kernel's SASS is written to that file; with ``SASS_OUT=dir`` (an existing directory)
every kernel's, one file each.

``--launch-check`` runs every launcher of a kernel with a statistics row, in bf16 and fp32, with and without the
histogram, and says whether each kernel it runs would launch. The histogram's tables are static shared memory on top
of Triton's dynamic shared memory, and Triton opts a kernel into more than the default 48 KiB only when its own part
is above 48 KiB. A kernel whose own part lies within a table's size under 48 KiB fails its launch with "invalid
argument" (an fp32 SwiGLU backward did on an H200, bench/RESULTS.md). Exit status 1 when any would fail. The project's
own Triton (3.9 with torch 2.13) builds for sm_90a too: tests/trainer/test_launch_shared_memory.py runs this in CI.
``--launch-check --histogram-only`` leaves out the builds without the histogram (half the time; CI runs it).
``--launch-check --widths`` does the same for the launchers whose tiles follow the width (RMSNorm's rows, RoPE's and
the head merge's heads) at every width they take (ten minutes); ``--widths 4096,8192`` for RMSNorm at those widths.

The driver is replaced by a stand-in that reports an sm_90 device and a CPU torch device, and each launch becomes
``JITFunction.warmup`` (compile only). Counts are static: instructions in the loop body, not executed ones.
"""

from __future__ import annotations

import argparse
import collections
import os
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

ROOT = Path(__file__).resolve().parents[1]


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 128)

    def get_current_device(self):
        return 0

    def get_current_stream(self, *args):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _CompileOnly:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles it and keeps the compiled kernel in ``built``."""

    def __init__(self, fn, name: str, built: dict):
        self.fn, self.name, self.built = fn, name, built

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.built[self.name] = self.fn.warmup(*args, grid=grid, **kwargs)
        return launch


_BRANCH = re.compile(r"BRA\s+(?:!?U?P\d,\s*)?0x([0-9a-f]+)")


def _instructions(sass: str) -> tuple[list[str], dict[int, int]]:
    """The instructions of ``cuobjdump -sass`` output in order, and each address's position among them."""
    ins, at = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            at[int(m.group(1), 16)] = len(ins)
            ins.append(m.group(2).strip())
    return ins, at


def _branch_target(text: str, at: dict[int, int]) -> int | None:
    """The position a branch instruction jumps to (None: not a branch, or outside the code)."""
    m = _BRANCH.search(text)
    return at.get(int(m.group(1), 16)) if m else None


def _loop_spans(ins: list[str], at: dict[int, int], need: str) -> list[tuple[int, int]]:
    """(first, last) positions of every backward branch's body holding an instruction containing ``need``."""
    spans = []
    for i, text in enumerate(ins):
        start = _branch_target(text, at)
        if start is not None and start <= i and any(need in t for t in ins[start:i + 1]):
            spans.append((start, i))
    return spans


def loops(sass: str, need: str = "") -> list[tuple[int, collections.Counter]]:
    """Instruction count and opcode mix of every backward branch's body in ``cuobjdump -sass`` output that holds an
    instruction containing ``need`` (e.g. "LDG.E.128": the tile loops), in program order."""
    ins, at = _instructions(sass)
    return [(end - start + 1, collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                                 for t in ins[start:end + 1]))
            for start, end in _loop_spans(ins, at, need)]


def loop_branches(sass: str, need: str = "") -> list[tuple[int, int | None]]:
    """The branches inside the longest of ``loops``: (position, target position), both counted from the loop's first
    instruction (target None: outside the loop). A body of if/else blocks reads off them: a branch at i to j skips
    i+1..j-1, so a path's length is the loop's less the blocks it skips."""
    ins, at = _instructions(sass)
    spans = _loop_spans(ins, at, need)
    if not spans:
        return []
    start, end = max(spans, key=lambda s: s[1] - s[0])  # the first of the longest, as ``longest_loop``
    out = []
    for i in range(start, end + 1):
        if _BRANCH.search(ins[i]):
            j = _branch_target(ins[i], at)
            out.append((i - start, j - start if j is not None and start <= j <= end + 1 else None))
    return out


def longest_loop(sass: str, need: str = "") -> tuple[int, collections.Counter]:
    """The longest of ``loops``: (0, empty) when there is none."""
    return max(loops(sass, need), key=lambda f: f[0], default=(0, collections.Counter()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--hist", action="store_true", help="the statistics variant with the log2 histogram")
    p.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--v", type=int, help="the statistics' row length (quantize_transpose._STATS_V)")
    p.add_argument("--standalone", action="store_true", help="the standalone statistics kernel (a given scale)")
    p.add_argument("--consumers", action="store_true",
                   help="the consumer kernels (trainer/kernels/swiglu.py, residual.py), bf16, with and without rows")
    p.add_argument("--launch-check", action="store_true",
                   help="every kernel with a statistics row: would its shared memory launch? (exit 1 if not)")
    p.add_argument("--widths", nargs="?", const="all",
                   help="with --launch-check: the kernels whose tiles follow the tensor's width instead, at every "
                        "width they take (RMSNorm rows of 16..MAX_WIDTH, RoPE and head-merge heads of 16..512), or "
                        "RMSNorm only, at these comma-separated widths")
    p.add_argument("--histogram-only", action="store_true",
                   help="with --launch-check: only the builds with the histogram, whose tables are the static shared "
                        "memory that can fail a launch (without it a kernel's is the 1 KiB the system reserves)")
    args = p.parse_args(argv)
    driver.set_active(_Sm90())
    sys.path.insert(0, str(ROOT))
    qt = importlib.import_module("fp8mon.trainer.kernels.quantize_transpose")
    ts = importlib.import_module("fp8mon.agent.stats.launch")
    built: dict = {}
    if args.launch_check:
        hists = (True,) if args.histogram_only else (False, True)
        builds = _stats_builds(ts, hists) if args.widths is None else _width_builds(
            ts, None if args.widths == "all" else [int(w) for w in args.widths.split(",")], hists)
        return _launch_check(ts, builds)
    if args.consumers:
        return _consumers(ts, built)
    if args.standalone:
        standalone = importlib.import_module("fp8mon.agent.stats.kernels.standalone")
        standalone.stats_kernel = _CompileOnly(standalone.stats_kernel, "standalone", built)
        x = torch.zeros(1 << 22, dtype=getattr(torch, args.dtype))
        ts.partials(x, fmt=args.fmt, scale=4.0, center=(0.0, 1.0), hist=args.hist)
        return _report(built, f"standalone {args.dtype} {args.fmt}, scale given, hist={args.hist}", "LDG.E.128")
    qt._quantize_transpose_kernel = _CompileOnly(qt._quantize_transpose_kernel, "plain", built)
    qt._quantize_transpose_stats_kernel = _CompileOnly(qt._quantize_transpose_stats_kernel, "stats", built)
    qt.stats_programs = lambda tiles, device: min(tiles, 2 * 132)
    if args.v:
        qt._STATS_V = args.v
    x = torch.zeros(16384, 2048, dtype=getattr(torch, args.dtype))
    scale, accum = torch.tensor(4.0), torch.zeros(())
    qt.quantize_transpose(x, args.fmt, scale, accum)
    qt.quantize_transpose(x, args.fmt, scale, accum, stats=ts.Target.new(torch.device("cpu"), hist=args.hist))
    return _report(built, f"{args.dtype} {args.fmt}, delayed scaling, hist={args.hist}, V={qt._STATS_V}")


def _consumers(ts, built: dict) -> int:
    """Every variant of the consumer kernels: the SwiGLU forward without rows, with y's, with y's and h's, with y's
    through its words; its backward without and with dy's row, and with it through dy's words; the residual add (fp32 stream, bf16 branch) without and
    with the branch's row, and the branch gradient's cast with its row; RoPE on the qkv output (1.5B's heads) without
    and with its row, and with it through qkv's words, and its backward without and with its gradient's row; RMSNorm's
    (and its bf16 forward with a row); the weights' casts in one launch; the heads merged
    for the projection without and with its input's row."""
    sw = importlib.import_module("fp8mon.trainer.kernels.swiglu")
    res = importlib.import_module("fp8mon.trainer.kernels.residual")
    cpu = torch.device("cpu")
    y = torch.zeros(4096, 2 * 2048, dtype=torch.bfloat16)
    fwd, bwd, add = sw._swiglu_fwd_kernel, sw._swiglu_bwd_kernel, res._residual_add_kernel
    sw.WORDS = False  # the fp32 path first
    for name, rows in (("swiglu fwd", ()), ("swiglu fwd + y row", ("y",)), ("swiglu fwd + y, h rows", ("y", "h"))):
        sw._swiglu_fwd_kernel = _CompileOnly(fwd, name, built)
        sw.swiglu_forward(y, stats=ts.Target.new(cpu, fmt="e4m3", hist=False) if "y" in rows else None,
                          h_stats=ts.Target.new(cpu, fmt="e4m3", hist=False) if "h" in rows else None)
    sw.WORDS, words = True, sw._swiglu_fwd_words_kernel
    sw._swiglu_fwd_words_kernel = _CompileOnly(words, "swiglu fwd + y row (words)", built)
    sw.swiglu_forward(y, stats=ts.Target.new(cpu, fmt="e4m3", hist=False))
    sw._swiglu_fwd_words_kernel = _CompileOnly(words, "swiglu fwd + y, h rows (words)", built)
    sw.swiglu_forward(y, stats=ts.Target.new(cpu, fmt="e4m3", hist=False), h_stats=ts.Target.new(cpu, fmt="e4m3",
                                                                                                hist=False))
    sw.BWD_WORDS = False
    for name, row in (("swiglu bwd", False), ("swiglu bwd + dy row", True)):
        sw._swiglu_bwd_kernel = _CompileOnly(bwd, name, built)
        sw.swiglu_backward(y, torch.zeros(4096, 2048, dtype=torch.bfloat16),
                           stats=ts.Target.new(cpu, fmt="e5m2", hist=False) if row else None)
    sw.BWD_WORDS, sw._swiglu_bwd_words_kernel = True, _CompileOnly(sw._swiglu_bwd_words_kernel,
                                                                   "swiglu bwd + dy row (words)", built)
    sw.swiglu_backward(y, torch.zeros(4096, 2048, dtype=torch.bfloat16), stats=ts.Target.new(cpu, fmt="e5m2", hist=False))
    x, b = torch.zeros(4096, 2048), torch.zeros(4096, 2048, dtype=torch.bfloat16)
    for name, row in (("residual add", False), ("residual add + row", True)):
        res._residual_add_kernel = _CompileOnly(add, name, built)
        res.residual_add_forward(x, b, stats=ts.Target.new(cpu, fmt="e4m3", hist=False) if row else None)
    res._branch_grad_kernel = _CompileOnly(res._branch_grad_kernel, "residual grad cast + row", built)
    res.branch_grad(x, torch.bfloat16, ts.Target.new(cpu, fmt="e5m2", hist=False))
    rope = importlib.import_module("fp8mon.trainer.kernels.rope")
    rfwd, rbwd = rope._rope_fwd_kernel, rope._rope_bwd_kernel
    qkv, trig = torch.zeros(2, 2048, 3 * 2048, dtype=torch.bfloat16), torch.zeros(2048, 64)
    for name, row in (("rope fwd", False), ("rope fwd + row", True)):
        rope._rope_fwd_kernel = _CompileOnly(rfwd, name, built)
        rope.rope_qkv_forward(qkv, trig, trig, 16, stats=ts.Target.new(cpu, fmt="e4m3", hist=False) if row else None)
    d = torch.zeros(2, 16, 2048, 128, dtype=torch.bfloat16)
    for name, row in (("rope bwd", False), ("rope bwd + row", True)):
        rope._rope_bwd_kernel = _CompileOnly(rbwd, name, built)
        rope.rope_qkv_backward(d, d, d, trig, trig, torch.bfloat16,
                               stats=ts.Target.new(cpu, fmt="e5m2", hist=False) if row else None)
    norm = importlib.import_module("fp8mon.trainer.kernels.rmsnorm")
    nfwd, nbwd = norm._rms_norm_fwd_kernel, norm._rms_norm_bwd_kernel
    for d_model in (768, 2048):
        x, w = torch.zeros(4096, d_model), torch.zeros(d_model)
        for name, row, hist in (("rmsnorm fwd", False, False), ("rmsnorm fwd + row", True, False),
                                ("rmsnorm fwd + row + hist", True, True)):
            norm._rms_norm_fwd_kernel = _CompileOnly(nfwd, f"{name} (fp32, {d_model})", built)
            norm.rms_norm_forward(x, w, 1e-6, stats=ts.Target.new(cpu, fmt="e4m3", hist=hist) if row else None)
        norm._rms_norm_fwd_kernel = _CompileOnly(nfwd, f"rmsnorm fwd + row (bf16, {d_model})", built)
        norm.rms_norm_forward(x.bfloat16(), w, 1e-6, stats=ts.Target.new(cpu, fmt="e4m3", hist=False))
        norm._rms_norm_bwd_kernel = _CompileOnly(nbwd, f"rmsnorm bwd (fp32, {d_model})", built)
        norm.rms_norm_backward(x, x, w, torch.zeros(4096))
    wc = importlib.import_module("fp8mon.trainer.kernels.weight_casts")
    wc._casts_kernel = _CompileOnly(wc._casts_kernel, "weight casts + rows, one launch (fp32 to bf16)", built)
    wc.casts_with_rows([torch.zeros(3072, 768)], torch.bfloat16, [ts.Target.new(cpu, fmt="e4m3", hist=False)])
    heads = importlib.import_module("fp8mon.trainer.kernels.heads")
    hk = heads._merge_heads_kernel
    for hd in (64, 128):
        y = torch.zeros(2, 16, 1024, hd, dtype=torch.bfloat16)
        for name, row in (("heads", False), ("heads + row", True)):
            heads._merge_heads_kernel = _CompileOnly(hk, f"{name} (head size {hd})", built)
            heads.merge_heads_forward(y, stats=ts.Target.new(cpu, fmt="e4m3", hist=False) if row else None)
    return _report(built, "consumer kernels, bf16, rows without the histogram (but where named)", "LDG")


DEFAULT_SMEM = 48 * 1024  # a launch's shared memory without opting in
OPTIN_SMEM = 227 * 1024  # the most an H100's or H200's block may opt in to (shared_memory_per_block_optin)
# The 1 KiB that sm_90 reserves for the system in a block that uses shared memory: cuobjdump counts it in SHARED, but
# it is not the kernel's. (On an H200 a kernel with SHARED 1024 and 49152 bytes of Triton's launched; one with 9216,
# the histogram's 8 KiB table more, did not: bench/RESULTS.md.)
RESERVED_SMEM = 1024


def launch_verdict(static: int, dynamic: int) -> str:
    """Whether a kernel with ``static`` bytes of shared memory by cuobjdump and ``dynamic`` of Triton's launches:
    Triton's driver (``load_binary``) opts in only when the dynamic part is above 48 KiB, and then to the opt-in
    limit; below it the kernel's own static part and the dynamic one share the default 48 KiB."""
    if dynamic > DEFAULT_SMEM:
        return "ok" if static + dynamic <= OPTIN_SMEM else "FAILS: over the opt-in limit"
    if max(static - RESERVED_SMEM, 0) + dynamic <= DEFAULT_SMEM:
        return "ok"
    return "FAILS: over 48 KiB, and Triton does not opt in"


def _cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump flag`` of a compiled kernel's cubin (Triton's bundled cuobjdump)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([cuobjdump, flag, cubin], capture_output=True, text=True).stdout


_STATS_MODULES = ("fp8mon.agent.stats.kernels.standalone", "fp8mon.agent.stats.kernels.merge",
                  "fp8mon.trainer.kernels.quantize", "fp8mon.trainer.kernels.quantize_transpose",
                  "fp8mon.trainer.kernels.swiglu", "fp8mon.trainer.kernels.residual", "fp8mon.trainer.kernels.rope",
                  "fp8mon.trainer.kernels.rmsnorm", "fp8mon.trainer.kernels.heads", "fp8mon.trainer.kernels.weight_casts")


def _targets(ts, hists: tuple = (False, True)):
    """(label, dtype, hist, tgt) for bf16 and fp32, each with and without the histogram (``hists``); ``tgt(fmt)``
    makes a CPU target."""
    cpu = torch.device("cpu")
    for dt in (torch.bfloat16, torch.float32):
        for hist in hists:
            def tgt(fmt="e4m3", hist=hist):
                return ts.Target.new(cpu, fmt=fmt, hist=hist)

            yield f"{str(dt).removeprefix('torch.')}, hist={hist}", dt, hist, tgt


def _norm_build(norm, rows: int, width: int, dt: torch.dtype, tgt):
    """RMSNorm's forward with a row over ``rows`` rows ``width`` wide."""
    return lambda: norm.rms_norm_forward(torch.zeros(rows, width, dtype=dt), torch.zeros(width), 1e-6, stats=tgt())


def _head_builds(b: int, nh: int, t: int, hd: int, dt: torch.dtype, tgt) -> tuple:
    """RoPE's forward and backward with a row over b x nh heads of t positions of size hd, and the head merge's."""
    rope, heads = (importlib.import_module(f"fp8mon.trainer.kernels.{m}") for m in ("rope", "heads"))
    trig = torch.zeros(t, hd // 2)

    def rope_bwd():
        d = torch.zeros(b, nh, t, hd, dtype=dt)
        rope.rope_qkv_backward(d, d, d, trig, trig, dt, stats=tgt("e5m2"))

    return (lambda: rope.rope_qkv_forward(torch.zeros(b, t, 3 * nh * hd, dtype=dt), trig, trig, nh, stats=tgt()),
            rope_bwd, lambda: heads.merge_heads_forward(torch.zeros(b, nh, t, hd, dtype=dt), stats=tgt()))


def _stats_builds(ts, hists: tuple = (False, True)) -> list:
    """(name, build) for every launcher that runs a kernel with a statistics row, in each dtype it takes, with the
    histogram and without (``hists``); ``build()`` calls the launcher once."""
    sw, res, norm, q, qt, wc = (importlib.import_module(f"fp8mon.trainer.kernels.{m}") for m in (
        "swiglu", "residual", "rmsnorm", "quantize", "quantize_transpose", "weight_casts"))
    out = []
    for at, dt, hist, tgt in _targets(ts, hists):
        def plain_swiglu(y, tgt):
            words, sw.WORDS = sw.WORDS, False
            try:
                sw.swiglu_forward(y, stats=tgt(), h_stats=tgt())
            finally:
                sw.WORDS = words

        y, dh = torch.zeros(4096, 2 * 2048, dtype=dt), torch.zeros(4096, 2048, dtype=dt)
        x, b = torch.zeros(4096, 2048), torch.zeros(4096, 2048, dtype=dt)
        rope_fwd, rope_bwd, _ = _head_builds(2, 16, 2048, 128, dt, tgt)
        out += [
            (f"standalone ({at})",
             lambda x=torch.zeros(1 << 22, dtype=dt), hist=hist: ts.partials(x, fmt="e4m3", scale=4.0, hist=hist)),
            (f"cast, current scaling ({at})", lambda x=y, tgt=tgt: q.quantize(x, "e4m3", stats=tgt())),
            (f"cast and transpose, delayed scaling ({at})", lambda x=y, tgt=tgt: qt.quantize_transpose(
                x, "e4m3", torch.tensor(4.0), torch.zeros(()), stats=tgt())),
            (f"swiglu fwd + y, h rows ({at})", lambda y=y, tgt=tgt: plain_swiglu(y, tgt)),
            (f"swiglu fwd + y row, words where bf16 ({at})",
             lambda y=y, tgt=tgt: sw.swiglu_forward(y, stats=tgt())),
            (f"swiglu bwd + dy row ({at})",
             lambda y=y, dh=dh, tgt=tgt: sw.swiglu_backward(y, dh, stats=tgt("e5m2"))),
            (f"residual add + row ({at})", lambda x=x, b=b, tgt=tgt: res.residual_add_forward(x, b, stats=tgt())),
            (f"residual grad cast + row ({at})", lambda x=x, dt=dt, tgt=tgt: res.branch_grad(x, dt, tgt("e5m2"))),
            (f"rope fwd + row ({at})", rope_fwd),
            (f"rope bwd + row ({at})", rope_bwd),
            (f"heads + row ({at})", _head_builds(2, 16, 1024, 64, dt, tgt)[2]),
            (f"casts + rows, one launch, to {'fp32' if dt == torch.bfloat16 else 'bf16'} ({at})",
             lambda x=x.to(dt), dt=dt, tgt=tgt: wc.casts_with_rows(
                 [x], torch.float32 if dt == torch.bfloat16 else torch.bfloat16, [tgt()])),
        ]
        out += [(f"rmsnorm fwd + row, {d_model} ({at})", _norm_build(norm, 4096, d_model, dt, tgt))
                for d_model in (768, 2048)]
    return out


def _width_builds(ts, norm_widths: list[int] | None = None, hists: tuple = (False, True)) -> list:
    """(name, build) for the launchers with a row whose tiles, and so their shared memory, follow the tensor's width:
    RMSNorm (a tile holds whole rows of the next power of two of the width) at every power of two it takes, RoPE and
    the head merge at every power-of-two head size from 16 to 512, in each dtype, with the histogram and without
    (``hists``); with ``norm_widths``, RMSNorm at those widths only. (RoPE and the head merge do not pipeline their
    tile loops: in Triton 3.6 their dynamic shared memory stayed at 768 B or less up to heads of 512,
    bench/RESULTS.md.)"""
    norm = importlib.import_module("fp8mon.trainer.kernels.rmsnorm")
    out = []
    for at, dt, _, tgt in _targets(ts, hists):
        widths = norm_widths or [1 << e for e in range(4, norm.MAX_WIDTH.bit_length())]
        out += [(f"rmsnorm fwd + row, {width} ({at})", _norm_build(norm, 64, width, dt, tgt)) for width in widths]
        for hd in () if norm_widths else (16, 32, 64, 128, 256, 512):
            fwd, bwd, merge = _head_builds(1, 2, 256, hd, dt, tgt)
            out += [(f"rope fwd + row, head {hd} ({at})", fwd), (f"rope bwd + row, head {hd} ({at})", bwd),
                    (f"heads + row, head {hd} ({at})", merge)]
    return out


def _launch_check(ts, builds: list) -> int:
    """Builds every launcher of ``builds`` (``_stats_builds``, ``_width_builds``) with each of its modules' kernels
    compiled only, and reports the shared memory of every kernel it ran."""
    print(f"# triton {triton.__version__}, sm_90a: shared memory of the kernels that launchers with a row run")
    kernels = {}
    for name in _STATS_MODULES:
        module = importlib.import_module(name)
        kernels.update({(module, attr): fn for attr, fn in vars(module).items()  # launched ones (not the helpers)
                        if isinstance(fn, triton.runtime.jit.JITFunction) and attr.endswith("_kernel")})
    failing = 0
    for name, build in builds:
        built: dict = {}
        for (module, attr), fn in kernels.items():
            setattr(module, attr, _CompileOnly(fn, attr, built))
        try:
            build()
        finally:
            for (module, attr), fn in kernels.items():
                setattr(module, attr, fn)
        for attr, compiled in built.items():
            static = int(re.search(r"SHARED:(\d+)", _cuobjdump(compiled, "--dump-resource-usage")).group(1))
            dynamic = compiled.metadata.shared
            verdict = launch_verdict(static, dynamic)
            failing += verdict != "ok"
            print(f"{name}: {attr}: static {static} + dynamic {dynamic} B: {verdict}")
    print(f"{failing} would fail to launch")
    return 1 if failing else 0


def _report(built: dict, what: str, need: str = "") -> int:
    print(f"# triton {triton.__version__}, sm_90a, {what}")
    for name, kernel in built.items():
        usage, sass = _cuobjdump(kernel, "--dump-resource-usage"), _cuobjdump(kernel, "-sass")
        out = os.environ.get("SASS_OUT")
        if out and Path(out).is_dir():
            (Path(out) / f"{re.sub(r'[^a-z0-9]+', '_', name)}.sass").write_text(sass)
        elif out:
            Path(out).write_text(sass)
        n, mix = longest_loop(sass, need)
        total = len(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+\S", sass, re.M))
        regs = " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+", usage))
        regs += f" +{kernel.metadata.shared} B dynamic"
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(8))
        print(f"{name}: {regs}, {total} instructions; longest loop {n} (LDL {mix['LDL']}, STL {mix['STL']}, "
              f"SHFL {mix['SHFL']}, BAR {mix['BAR']}): {top}")
        if need:  # the standalone kernel holds one tile loop per dtype path (bf16 words, fp16, fp32, ...)
            print(f"  loops holding {need}, in program order: " + ", ".join(str(f[0]) for f in loops(sass, need)))
            print("  branches in the longest loop (at -> to): " + ", ".join(
                f"{i} -> {'out' if j is None else j}" for i, j in loop_branches(sass, need)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
