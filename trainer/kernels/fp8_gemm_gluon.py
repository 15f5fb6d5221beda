"""FP8 GEMM with precise accumulation whose fp32 promotion overlaps the tensor cores (Gluon, Hopper only).

``C = (A @ Bᵀ) * scale_a * scale_b (+ bias)``, A (M, K) and B (N, K) fp8, both K-major, the same contract as
``fp8_gemm.fp8_gemm`` (whose impl ``"gluon"`` this is).

Why: on sm90 the wgmma accumulator of FP8 products keeps fewer mantissa bits than fp32, so precise
accumulation promotes the partial sums into an fp32 accumulator every BK (= 128) products. Triton's
``tl.dot(..., max_num_imprecise_acc=BK)`` lowers that as: wgmma into a zeroed temporary, *wait for the whole
wgmma chain*, add the temporary into the accumulator; the tensor cores idle during every add (~20% of the
time). Here the kernel is written in Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``),
which exposes the asynchronous wgmma: block k+1's wgmma is issued into a second temporary register set before
block k's temporary is added into the fp32 accumulator (``warpgroup_mma_wait(num_outstanding=1)``), so the adds
run on the CUDA cores while the tensor cores work (the DeepGEMM/CUTLASS promotion, with in-warpgroup
double buffering instead of two ping-pong warpgroups). Three fp32 register sets (accumulator + two
temporaries) of BM x BN / (32 * num_warps) values each: 128 x 128 tiles with 8 warps (192 registers).

Structure: persistent (one program per SM, or ``CTAS_PER_SM`` per SM), grouped tile order, one flattened
stream of (tile, K block) items so that the TMA loads of the next tile are issued during the current one's
K loop; STAGES-deep shared-memory ring filled by TMA, one mbarrier per stage; the last K block's
promotion and the epilogue (scale, bias, cast, TMA store) of a tile overlap the first wgmma of the next.
Split-K (SPLIT_K > 1): each work item is (tile, K slice); the unscaled fp32 partial goes to a
(SPLIT_K, M, N) workspace reduced by ``fp8_gemm._splitk_reduce_kernel``. K blocks past K (and rows/columns
past M/N) are zero-filled by TMA, so every item runs the same number of K blocks.

Promotion interval: every BK = 128 products (each K block's four k=32 wgmmas accumulate in the tensor
core's accumulator, from zero, then the block's sum is added in fp32), as ``max_num_imprecise_acc=128``.

Limits: CUDA sm90 only, Triton with Gluon's Hopper API (3.5+); **does not run under TRITON_INTERPRET**
(the interpreter has no Gluon), so the CPU / interpreter path of ``fp8_gemm`` keeps the Triton kernels, and
``fp8_gemm`` never picks this one there. No statistics epilogue: ``fp8_gemm`` routes calls with ``stats`` to
its Triton TMA kernel. Needs the TMA alignment of ``fp8_gemm._tma_ok``.

Status (2026-11-21): compiled offline with Triton 3.6 for sm_90a and assembled with ptxas: 229-248 registers,
no spills, no "wgmma serialized" warning (two traps fixed for that: the loop body is unrolled by two so the
temporaries keep their registers, and the two drain waits differ so LLVM does not merge them). Not yet
verified on a GPU: its first H200 run hung (the prologue loaded STAGES-1 blocks while the steady state refills
from block STAGES on, so block STAGES-1 was never loaded; fixed since, unrun). Hence opt-in in
``impl="auto"`` (``FP8MON_GEMM_GLUON=1``) and no speed figure here.

Reference: ``fp8_gemm.fp8_gemm_ref`` (``torch._scaled_mm``); tests in tests/trainer/test_gemm_gluon.py.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    AVAILABLE = True
except Exception:  # pragma: no cover - Triton without Gluon's Hopper API
    AVAILABLE = False

# (BM, BN, BK, STAGES, num_warps, CTAS_PER_SM); BM*BN/(32*num_warps) <= 64 keeps 3 register sets in budget
CONFIGS = [
    (128, 128, 128, 4, 8, 1),
    (128, 128, 128, 5, 8, 1),
    (64, 128, 128, 3, 4, 2),  # two programs per SM (2 x 88 KB of shared memory)
]
GROUP_M = 8


def supported(a: torch.Tensor) -> bool:
    """True where this kernel can run: CUDA sm90 and Gluon importable."""
    return AVAILABLE and a.is_cuda and torch.cuda.get_device_capability(a.device)[0] == 9


if AVAILABLE:
    @gluon.jit
    def _tile_of(item, num_pid_m, num_pid_n, num_tiles, per, GROUP: gl.constexpr):
        """Work item -> (row offset tile, column tile, first K block); grouped order as fp8_gemm._tile_ids."""
        tile = item % num_tiles
        group = GROUP * num_pid_n
        first_m = (tile // group) * GROUP
        size_m = gl.minimum(num_pid_m - first_m, GROUP)
        pid_m = first_m + ((tile % group) % size_m)
        pid_n = (tile % group) // size_m
        return pid_m, pid_n, (item // num_tiles) * per

    @gluon.jit
    def _issue_load(a_desc, b_desc, a_smem, b_smem, ready, i, pid, nprog, num_pid_m, num_pid_n, num_tiles, per,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    GROUP: gl.constexpr):
        """TMA loads of this program's flattened K-block ``i`` into stage i % STAGES."""
        item = pid + (i // per) * nprog
        pid_m, pid_n, k0 = _tile_of(item, num_pid_m, num_pid_n, num_tiles, per, GROUP)
        kk = (k0 + i % per) * BK
        s = i % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk], bar, a_smem.index(s))
        tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kk], bar, b_smem.index(s))

    @gluon.jit
    def _epilogue(acc, item, c_desc, c_smem, ws_ptr, scale, bias_ptr, M, N, num_pid_m, num_pid_n, num_tiles, per,
                  HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  GROUP: gl.constexpr, layout: gl.constexpr):
        pid_m, pid_n, k0 = _tile_of(item, num_pid_m, num_pid_n, num_tiles, per, GROUP)
        if SPLIT_K == 1:
            acc = acc * scale
            if HAS_BIAS:
                cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
                acc = acc + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
            tma.store_wait(pendings=0)  # the previous tile's store has left c_smem ...
            gl.thread_barrier()  # ... as every thread now knows (the wait is the issuing thread's)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * BM, pid_n * BN], c_smem)
        else:  # unscaled fp32 partial into the (SPLIT_K, M, N) workspace
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            ptrs = (ws_ptr + (item // num_tiles).to(gl.int64) * M * N + rows[:, None].to(gl.int64) * N
                    + cols[None, :])
            gl.store(ptrs, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))

    @gluon.jit
    def _step(acc, tok, spare, c, a_desc, b_desc, a_smem, b_smem, ready, c_desc, c_smem, ws_ptr, scale, bias_ptr, M, N,
              pid, nprog, num_pid_m, num_pid_n, num_tiles, per, total, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
              layout: gl.constexpr):
        """K block ``c`` (c >= 1) of the flattened stream: issue its wgmma into ``spare`` (a free register set,
        zero-initialised by use_acc=False: the tensor-core accumulation spans BK products), wait for block c-1
        (``tok``), add it into the fp32 accumulator while block c runs, run the tile's epilogue if block c-1
        closed a tile, refill the stage block c-1 used. Returns (acc, block c in flight, block c-1's set)."""
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        nxt = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), spare, use_acc=False, is_async=True)
        prev = warpgroup_mma_wait(num_outstanding=1, deps=(tok, ))
        if c % per == 0:  # block c-1 closed a tile: promote, store it, start the next tile's accumulator
            _epilogue(acc + prev, pid + (c // per - 1) * nprog, c_desc, c_smem, ws_ptr, scale, bias_ptr, M, N,
                      num_pid_m, num_pid_n, num_tiles, per, HAS_BIAS, SPLIT_K, BM, BN, GROUP, layout)
            acc = gl.zeros((BM, BN), gl.float32, layout)
        else:
            acc = acc + prev  # fp32 promotion, overlapping block c's wgmma
        # stage (c-1) % STAGES is free in this warpgroup; every warp must be done with it before the refill
        gl.thread_barrier()
        if c - 1 + STAGES < total:
            _issue_load(a_desc, b_desc, a_smem, b_smem, ready, c - 1 + STAGES, pid, nprog, num_pid_m, num_pid_n,
                        num_tiles, per, BM, BN, BK, STAGES, GROUP)
        return acc, nxt, prev

    @gluon.jit
    def _fp8_gemm_gluon_kernel(a_desc, b_desc, c_desc, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                               HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                               GROUP: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        WM: gl.constexpr = BM // 16 if BM // 16 < num_warps else num_warps
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, num_warps // WM],
                                                         instr_shape=[16, BN // (num_warps // WM), 32])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_tiles = num_pid_m * num_pid_n
        per = gl.cdiv(gl.cdiv(K, BK), SPLIT_K)
        my_items = gl.cdiv(num_tiles * SPLIT_K - pid, nprog)
        total = my_items * per
        scale = gl.load(sa_ptr) * gl.load(sb_ptr)

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for si in gl.static_range(STAGES):
            mbarrier.init(ready.index(si), count=1)

        for i in gl.static_range(STAGES):  # blocks 0..STAGES-1; step c refills block c-1's stage with c-1+STAGES
            if i < total:
                _issue_load(a_desc, b_desc, a_smem, b_smem, ready, i, pid, nprog, num_pid_m, num_pid_n, num_tiles,
                            per, BM, BN, BK, STAGES, GROUP)

        acc = gl.zeros((BM, BN), gl.float32, layout)
        # Two temporaries T0/T1 alternate: the loop body is unrolled by two so that each register set keeps its
        # role (a loop-carried swap would copy in-flight wgmma registers, and ptxas then serializes every wgmma).
        mbarrier.wait(ready.index(0), 0)
        tok = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), gl.zeros((BM, BN), gl.float32, layout),
                            use_acc=False, is_async=True)  # T1, in flight
        spare = gl.zeros((BM, BN), gl.float32, layout)  # T0, free
        for c in range(1, total - 1, 2):
            acc, t0, t1 = _step(acc, tok, spare, c, a_desc, b_desc, a_smem, b_smem, ready, c_desc, c_smem, ws_ptr,
                                scale, bias_ptr, M, N, pid, nprog, num_pid_m, num_pid_n, num_tiles, per, total,
                                HAS_BIAS, SPLIT_K, BM, BN, BK, STAGES, GROUP, layout)
            acc, tok, spare = _step(acc, t0, t1, c + 1, a_desc, b_desc, a_smem, b_smem, ready, c_desc, c_smem,
                                    ws_ptr, scale, bias_ptr, M, N, pid, nprog, num_pid_m, num_pid_n, num_tiles, per,
                                    total, HAS_BIAS, SPLIT_K, BM, BN, BK, STAGES, GROUP, layout)
        if total % 2 == 0:  # one block left: issue it, then drain (no value leaves this branch)
            acc, t0, t1 = _step(acc, tok, spare, total - 1, a_desc, b_desc, a_smem, b_smem, ready, c_desc, c_smem,
                                ws_ptr, scale, bias_ptr, M, N, pid, nprog, num_pid_m, num_pid_n, num_tiles, per,
                                total, HAS_BIAS, SPLIT_K, BM, BN, BK, STAGES, GROUP, layout)
            # (t1 rides along only so that this wait differs from the other branch's: LLVM would merge the two
            # tails and copy the in-flight t0 into tok's registers, and ptxas then serializes every wgmma)
            last, t1 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1))
            _epilogue(acc + last, pid + (my_items - 1) * nprog, c_desc, c_smem, ws_ptr, scale, bias_ptr, M, N,
                      num_pid_m, num_pid_n, num_tiles, per, HAS_BIAS, SPLIT_K, BM, BN, GROUP, layout)
        else:
            last = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
            _epilogue(acc + last, pid + (my_items - 1) * nprog, c_desc, c_smem, ws_ptr, scale, bias_ptr, M, N,
                      num_pid_m, num_pid_n, num_tiles, per, HAS_BIAS, SPLIT_K, BM, BN, GROUP, layout)
        tma.store_wait(pendings=0)
        for si in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(si))


_GL_DTYPE = {}


def _gl_dtype(dt: torch.dtype):
    if not _GL_DTYPE:
        _GL_DTYPE.update({torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                          torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32})
    return _GL_DTYPE[dt]


def launch(a, b, c, ws, scale_a, scale_b, bias, split_k: int, num_sms: int, config=CONFIGS[0]) -> None:
    """Runs the kernel: C (or, with split_k > 1, the fp32 workspace ws) from a (M, K) and b (N, K)."""
    BM, BN, BK, stages, warps, per_sm = config
    M, K = a.shape
    N = b.shape[0]
    a_desc = GluonDescriptor(a, [M, K], [K, 1], [BM, BK],
                             gl.NVMMASharedLayout.get_default_for([BM, BK], _gl_dtype(a.dtype)))
    b_desc = GluonDescriptor(b, [N, K], [K, 1], [BN, BK],
                             gl.NVMMASharedLayout.get_default_for([BN, BK], _gl_dtype(b.dtype)))
    c_desc = GluonDescriptor(c, [M, N], [N, 1], [BM, BN],
                             gl.NVMMASharedLayout.get_default_for([BM, BN], _gl_dtype(c.dtype)))
    items = triton.cdiv(M, BM) * triton.cdiv(N, BN) * split_k
    grid = (min(items, per_sm * num_sms),)
    _fp8_gemm_gluon_kernel[grid](a_desc, b_desc, c_desc, c if ws is None else ws, scale_a, scale_b,
                                 scale_a if bias is None else bias, M, N, K, HAS_BIAS=bias is not None,
                                 SPLIT_K=split_k, STAGES=stages, GROUP=GROUP_M, num_warps=warps)


_BEST: dict = {}


def _tune_key(a, b, c, bias, split_k):
    return (a.shape, b.shape, a.dtype, b.dtype, c.dtype, bias is not None, split_k, a.device)


def run(a, b, c, ws, scale_a, scale_b, bias, split_k: int, num_sms: int, config=None) -> None:
    """``launch`` with ``config``, or with the fastest of ``CONFIGS`` for this shape (timed on the first call of
    each shape/dtype/flag combination, like Triton's autotuner: that call synchronizes)."""
    if config is None:
        key = _tune_key(a, b, c, bias, split_k)
        config = _BEST.get(key)
        if config is None:
            times = {}
            for cfg in CONFIGS:
                fn = functools.partial(launch, a, b, c, ws, scale_a, scale_b, bias, split_k, num_sms, cfg)
                try:
                    fn()
                except Exception as exc:  # e.g. out of shared memory on a smaller GPU
                    warnings.warn(f"fp8_gemm_gluon: config {cfg} failed ({type(exc).__name__}: {exc})")
                    continue
                times[cfg] = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
            if not times:
                raise RuntimeError("fp8_gemm_gluon: no config runs")
            config = _BEST[key] = min(times, key=times.get)
    launch(a, b, c, ws, scale_a, scale_b, bias, split_k, num_sms, config)
