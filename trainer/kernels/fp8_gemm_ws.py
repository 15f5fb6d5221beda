"""Warp-specialized FP8 GEMM with precise accumulation for Hopper (sm_90a), in Gluon.

``C = (A @ Bᵀ) * scale_a * scale_b (+ bias)``, A (M, K) and B (N, K) fp8 (e4m3 / e5m2), both K-major; scales are
fp32 0-d device tensors read in the kernel; C bf16 or fp32. Same contract as ``fp8_gemm.fp8_gemm``.

Precise accumulation: every BK = 128 deep K block runs as one wgmma chain (four k=32 instructions) that starts
from zero in the tensor core's reduced-precision accumulator; its result is then added into an fp32 accumulator
(what ``max_num_imprecise_acc=128`` and cuBLAS' precise mode do).

Why this structure: Triton's ``max_num_imprecise_acc`` lowering waits for the chain and adds with both warpgroups
of the CTA in lockstep, so the tensor cores idle during every add. Here (the DeepGEMM / CUTLASS
sm90 "cooperative" layout, via ``gl.warp_specialize``):
  * a 1-warp producer partition (few registers) issues the TMA loads of A and B into a STAGES-deep ring with
    per-stage ``ready`` (TMA byte count) and ``empty`` mbarriers, running ahead across tile boundaries;
  * two consumer warpgroups (raised register budget) each own 64 rows of the 128-row tile: wait ``ready[s]``,
    issue their own wgmma chain on their half of the A stage and the whole B stage, wait for it, release the
    stage (``empty[s]`` counts one arrival per consumer) and add the partial into fp32. They never synchronise
    with each other inside the K loop, so one's adds run while the other's wgmma occupies the tensor cores.
    With BN = 256 a consumer runs its 64 x 256 as two 128-wide chains into one 64 x 128 temporary (registers).
Persistent (grid = min(items, SMs)), grouped tile order (GROUP_M rows of tiles sweep the columns). Each consumer
stores its 64 x BN half (scale, bias, cast in registers); rows / columns / K past the tensor are zero-filled by TMA.
Two epilogues (``CONFIGS``' optional 5th entry): "ptr", masked stores from registers; "tma", through per-consumer
shared-memory buffers and asynchronous TMA stores (clipped at the edges) that drain while the next tile's main loop
runs. With "ptr" every SM's consumers stall in the stores at the same time (all SMs finish their tiles together, so
the stores queue on the write bandwidth) while the tensor cores idle: costliest for short K (few K blocks per tile).
Split-K (split_k > 1): a work item is
(tile, K slice) and writes its unscaled fp32 partial into the (split_k, M, N) workspace ``ws``, which the caller
reduces.

Needs Triton with Gluon's Hopper API (written against Triton 3.6); ``AVAILABLE`` is False elsewhere. No
interpreter support (Gluon has none). TMA alignment: K % 16 == 0, 16-byte aligned bases (``fp8_gemm._tma_ok``).
Variants (every GPU test case of every config passes, tests/trainer/test_gemm_ws.py):
  * "pipe" configs (6th entry, BN = 128, ``_consumer_pipe``): each consumer keeps one wgmma chain in flight while
    it promotes the previous one (two 64 x 128 temporaries; with BN = 256 that would need 256 registers), so its
    adds no longer rely on the other consumer to cover them.
  * Stream-K configs (7th entry "sk", BN = 128, ``_consumer_sk``), for outputs whose tiles leave SMs idle in the
    last wave (124M wgrads: 36-192 tiles of 128 x 128 on 132 SMs): whole waves data-parallel, the other tiles
    split in K at the same block for all of them (heads run the first part in step, so their loads share L2), the
    rest of each given to a tail CTA where twice their number fits the SMs; partials handed over through fp32
    workspace slots and release / acquire flags, in a fixed order (deterministic). See the comment above ``_sk_lo``.
    Tuned like the other configs (``TUNED_CONFIGS``).
Speed: as fp8_gemm's auto pick it brings the precise backward GEMMs close to ``_scaled_mm(use_fast_accum=False)``.
A launch's Python host time exceeds the kernel on small shapes: eager calls there are host-bound.
Not expressible in Gluon 3.6: TMA multicast across a 2-CTA cluster (``async_copy_global_to_shared`` has no
multicast / CTA mask).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .quantize import cdiv
from .stream_k import sk_params
from .timing import fastest

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    AVAILABLE = hasattr(gl, "warp_specialize")
except Exception:  # pragma: no cover - Triton without Gluon's Hopper API
    AVAILABLE = False

# (BM, BN, BK, STAGES). Shared memory: STAGES * (BM + BN) * BK bytes. Register tensors need power-of-2 shapes, so
# no BN = 192. BN = 256: per consumer thread 128 accumulator + 64 temporary fp32 registers (see _consumer).
# Narrow tiles (BN 96 / 112 as 64 + 32 (+ 16) wgmma chains, to fill the SMs as cuBLAS' 96 / 112-wide tiles do) were
# exact but slower than 128-wide ones, A in registers or not.
#
# An optional 5th entry picks the epilogue: "ptr" (default; masked stores from registers) or "tma" (scale / bias /
# cast in registers, then shared memory and an asynchronous TMA store that drains while the next tile's main loop
# runs; the consumer waits for its previous store only before reusing that buffer). "tma" takes 64 x min(BN, 128)
# output-dtype buffers per consumer: one per 128-column chain when that fits the shared memory, else one (the
# second chain's store then waits for the first to be read out); split-K, unaligned C (N * itemsize % 16 != 0)
# or no room fall back to "ptr" (``_epilogue``).
CONFIGS = [
    (128, 256, 128, 4),
    (128, 128, 128, 6),
    (128, 256, 128, 3),
    (128, 128, 128, 4),
    (128, 256, 128, 3, "tma"),  # 144 KB ring + 64 KB bf16 (2 bufs) / 64 KB fp32 (1 buf)
    (128, 128, 128, 5, "tma"),  # 160 KB ring + 32 KB bf16 / 64 KB fp32
    (128, 128, 128, 4, "tma"),
    (128, 256, 128, 4, "tma"),  # 192 KB ring + 32 KB bf16 (1 buf); fp32 output: no room, "ptr"
    # "pipe" (6th entry): ``_consumer_pipe``, a chain of each consumer always in flight while it promotes
    (128, 128, 128, 6, "ptr", "pipe"),  # 192 KB ring
    (128, 128, 128, 5, "tma", "pipe"),  # 160 KB ring + 32 KB bf16 / 64 KB fp32
    (128, 128, 128, 4, "ptr", "pipe"),  # 128 KB ring
    # stream-K (7th entry "sk"): "ptr" epilogue only, split_k == 1 only (``_consumer_sk``, ``sk_plan``). BN = 128
    # only: with BN = 256 the fix-up (acc0 + acc1 + temporary + loaded partial) spills heavily.
    (128, 128, 128, 6, "ptr", "plain", "sk"),  # 192 KB ring
    (128, 128, 128, 6, "ptr", "pipe", "sk"),
]
GROUP_M = 8
# setmaxnreg budgets (multiples of 8); 3 warpgroups (consumer, consumer, producer padded to 4 warps) under a
# 168-register launch limit (168 * 384 threads <= 64K): 232 + 232 + 40 = 3 * 168.
MAXNREG = 168
CONSUMER_REGS = 232
PRODUCER_REGS = 40


def supported(a: torch.Tensor) -> bool:
    """True where this kernel can run: a CUDA tensor on an sm90 GPU, and Gluon's Hopper API importable."""
    return AVAILABLE and a.is_cuda and _sm90(a.device.index or 0)


@functools.cache
def _sm90(index: int) -> bool:  # asked on every precise GEMM call (fp8_gemm): once per device
    return torch.cuda.get_device_capability(index) == (9, 0)


if AVAILABLE:
    @gluon.jit
    def _tile_coords(tile, num_pid_m, num_pid_n, GROUP: gl.constexpr):
        """Tile index -> (tile row, tile column) in grouped order (GROUP rows of tiles sweep the columns)."""
        group = GROUP * num_pid_n
        first_m = (tile // group) * GROUP
        size_m = gl.minimum(num_pid_m - first_m, GROUP)
        pid_m = first_m + ((tile % group) % size_m)
        pid_n = (tile % group) // size_m
        return pid_m, pid_n

    @gluon.jit
    def _load_block(a_desc, b_desc, a_smem, b_smem, ready, empty, c, pid_m, pid_n, kb, STAGES: gl.constexpr):
        """TMA loads of K block kb of tile (pid_m, pid_n) into ring slot c % STAGES, once that slot is free."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        s = c % STAGES
        # a fresh mbarrier completes the (virtual) phase before phase 0: the first lap does not wait
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kb * BK], bar, a_smem.index(s))
        tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kb * BK], bar, b_smem.index(s))

    @gluon.jit
    def _work_item(item, num_pid_m, num_pid_n, num_tiles, per, k_tiles, GROUP: gl.constexpr):
        """Work item -> (tile row, tile column, K slice, first K block, K blocks); grouped tile order."""
        pid_m, pid_n = _tile_coords(item % num_tiles, num_pid_m, num_pid_n, GROUP)
        ks = item // num_tiles
        k0 = ks * per
        return pid_m, pid_n, ks, k0, gl.minimum(per, k_tiles - k0)

    @gluon.jit
    def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, pid, nprog, num_pid_m, num_pid_n, num_tiles,
                  num_items, per, k_tiles, STAGES: gl.constexpr, GROUP: gl.constexpr):
        c = 0
        for item in range(pid, num_items, nprog):
            pid_m, pid_n, ks, k0, nk = _work_item(item, num_pid_m, num_pid_n, num_tiles, per, k_tiles, GROUP)
            for kb in range(nk):
                _load_block(a_desc, b_desc, a_smem, b_smem, ready, empty, c, pid_m, pid_n, k0 + kb, STAGES)
                c += 1

    @gluon.jit
    def _store_tile(acc, c_ptr, ws_ptr, scale, bias_ptr, M, N, ks, row0, col0, HAS_BIAS: gl.constexpr,
                    SPLIT: gl.constexpr, layout: gl.constexpr):
        rows = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(gl.int64) * N + cols[None, :]
        if SPLIT:  # unscaled fp32 partial of K slice ks
            gl.store(ws_ptr + ks.to(gl.int64) * M * N + offs, acc, mask=mask)
        else:
            out = acc * scale
            if HAS_BIAS:
                out = out + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
            gl.store(c_ptr + offs, out.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _store_tile_tma(acc, c_desc, c_smem, buf, scale, bias_ptr, N, row0, col0, HAS_BIAS: gl.constexpr,
                        PENDING: gl.constexpr, layout: gl.constexpr):
        """Scale / bias / cast in registers, then buffer ``buf`` of ``c_smem`` and an asynchronous TMA store (TMA
        clips rows / columns past C). Waits only until at most PENDING of this warpgroup's stores are still reading
        shared memory, i.e. until the store that last used ``buf`` is done with it."""
        out = acc * scale
        if HAS_BIAS:
            cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
            out = out + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        out = out.to(c_desc.dtype)
        tma.store_wait(PENDING)
        dst = c_smem.index(buf)
        dst.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, col0], dst)

    @gluon.jit
    def _kloop_plain(a_smem, b_smem, ready, empty, acc0, acc1, part, c, nk, WG: gl.constexpr, STAGES: gl.constexpr):
        """The plain K loop (``_consumer``, ``_consumer_sk``): nk blocks from ring slot c on; per block a wgmma
        chain into the temporary ``part``, drained, then added in fp32 into acc0 (and, with BN = 256, a second
        128-wide chain into acc1). Returns (acc0, acc1, part, c past the last block); acc1 is unused for BN <= 128."""
        BM: gl.constexpr = a_smem.shape[1]
        BN: gl.constexpr = b_smem.shape[1]
        HALF: gl.constexpr = BM // 2
        SUB: gl.constexpr = 128 if BN > 128 else BN
        for kb in range(nk):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a = a_smem.index(s).slice(WG * HALF, HALF)
            b = b_smem.index(s).slice(0, SUB).permute((1, 0))
            tok = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
            part, a, b = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a, b))
            if BN > SUB:
                acc0 = acc0 + part  # fp32 promotion; the other consumer's wgmma keeps the tensor cores busy
                b = b_smem.index(s).slice(SUB, SUB).permute((1, 0))
                tok = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
                part, a, b = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a, b))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = acc1 + part
            else:
                mbarrier.arrive(empty.index(s), count=1)
                acc0 = acc0 + part
            c += 1
        return acc0, acc1, part, c

    @gluon.jit
    def _store_sub(acc, c_ptr, ws_ptr, c_smem, buf, scale, bias_ptr, M, N, ks, row0, col0, HAS_BIAS: gl.constexpr,
                   SPLIT: gl.constexpr, EPI_BUFS: gl.constexpr, layout: gl.constexpr):
        if EPI_BUFS > 0:
            _store_tile_tma(acc, c_ptr, c_smem, buf, scale, bias_ptr, N, row0, col0, HAS_BIAS, EPI_BUFS - 1, layout)
        else:
            _store_tile(acc, c_ptr, ws_ptr, scale, bias_ptr, M, N, ks, row0, col0, HAS_BIAS, SPLIT, layout)

    @gluon.jit
    def _consumer(a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, pid, nprog,
                  num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles, WG: gl.constexpr, HAS_BIAS: gl.constexpr,
                  SPLIT: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, EPI_BUFS: gl.constexpr):
        """Consumer warpgroup WG: rows [64 WG, 64 WG + 64) of every tile. With BN = 256 the columns run as two
        128-wide wgmma chains into one temporary (acc0/acc1 + temporary = 192 registers; two 256-wide sets would
        not fit)."""
        BM: gl.constexpr = a_smem.shape[1]
        BN: gl.constexpr = b_smem.shape[1]
        HALF: gl.constexpr = BM // 2
        SUB: gl.constexpr = 128 if BN > 128 else BN
        gl.static_assert(BN == SUB or BN == 2 * SUB, "BN: 64, 128 or 256")
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB, 32])
        scale = gl.load(sa_ptr) * gl.load(sb_ptr)
        # the wgmma temporary: loop-carried so that it keeps its registers (use_acc=False ignores its value)
        part = gl.zeros((HALF, SUB), gl.float32, layout)
        c = 0
        for item in range(pid, num_items, nprog):
            pid_m, pid_n, ks, k0, nk = _work_item(item, num_pid_m, num_pid_n, num_tiles, per, k_tiles, GROUP)
            acc0, acc1, part, c = _kloop_plain(a_smem, b_smem, ready, empty, gl.zeros((HALF, SUB), gl.float32, layout),
                                               gl.zeros((HALF, SUB), gl.float32, layout), part, c, nk, WG, STAGES)
            row0 = pid_m * BM + WG * HALF
            # with EPI_BUFS > 0, c_ptr is C's TMA descriptor, block (HALF, SUB)
            _store_sub(acc0, c_ptr, ws_ptr, c_smem, WG * EPI_BUFS, scale, bias_ptr, M, N, ks, row0, pid_n * BN,
                       HAS_BIAS, SPLIT, EPI_BUFS, layout)
            if BN > SUB:
                _store_sub(acc1, c_ptr, ws_ptr, c_smem, WG * EPI_BUFS + EPI_BUFS - 1, scale, bias_ptr, M, N, ks, row0,
                           pid_n * BN + SUB, HAS_BIAS, SPLIT, EPI_BUFS, layout)
        if EPI_BUFS > 0:
            tma.store_wait(0)  # the buffers must outlive the stores reading them

    @gluon.jit
    def _pipe_step(a_smem, b_smem, ready, empty, acc0, pending, into, s, c, WG: gl.constexpr, STAGES: gl.constexpr):
        """One step of the "pipe" K loop: issue the next K block's chain into the free temporary ``into``, then wait
        for the chain in flight (``pending``), release its stage and add it into acc0. Returns (acc0, the new chain
        in flight, the promoted temporary (now free), its ring slot, c)."""
        HALF: gl.constexpr = a_smem.shape[1] // 2
        sp = s
        c += 1
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        tok = warpgroup_mma(a_smem.index(s).slice(WG * HALF, HALF), b_smem.index(s).permute((1, 0)), into,
                            use_acc=False, is_async=True)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
        mbarrier.arrive(empty.index(sp), count=1)
        return acc0 + done, tok, done, s, c

    @gluon.jit
    def _kloop_pipe(a_smem, b_smem, ready, empty, acc0, t0, t1, c, nk, WG: gl.constexpr, STAGES: gl.constexpr):
        """The "pipe" K loop (``_consumer_pipe``, ``_consumer_sk``): nk blocks from ring slot c on, into acc0
        through the temporaries t0 / t1; K block 0 into t0, then pairs of ``_pipe_step`` (into t1, then t0): the
        loop is unrolled by two so that each temporary keeps its registers. Returns (acc0, t0, t1, c past the last
        block)."""
        BM: gl.constexpr = a_smem.shape[1]
        HALF: gl.constexpr = BM // 2
        if nk > 0:
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a = a_smem.index(s).slice(WG * HALF, HALF)
            tok0 = warpgroup_mma(a, b_smem.index(s).permute((1, 0)), t0, use_acc=False, is_async=True)
            for p in range((nk - 1) // 2):
                acc0, tk1, d0, s, c = _pipe_step(a_smem, b_smem, ready, empty, acc0, tok0, t1, s, c, WG, STAGES)
                acc0, tok0, t1, s, c = _pipe_step(a_smem, b_smem, ready, empty, acc0, tk1, d0, s, c, WG, STAGES)
            if nk % 2 == 0:
                acc0, tk1, t0, s, c = _pipe_step(a_smem, b_smem, ready, empty, acc0, tok0, t1, s, c, WG, STAGES)
                t1 = warpgroup_mma_wait(num_outstanding=0, deps=(tk1,))
                mbarrier.arrive(empty.index(s), count=1)
                acc0 = acc0 + t1
            else:
                t0 = warpgroup_mma_wait(num_outstanding=0, deps=(tok0,))
                mbarrier.arrive(empty.index(s), count=1)
                acc0 = acc0 + t0
            c += 1
        return acc0, t0, t1, c

    @gluon.jit
    def _consumer_pipe(a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, pid,
                       nprog, num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles, WG: gl.constexpr,
                       HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                       EPI_BUFS: gl.constexpr):
        """Pipelined consumer ("pipe" configs, BN = 128): a wgmma chain of its own always stays in flight while the
        warpgroup promotes the previous one (``warpgroup_mma_wait(num_outstanding=1)``), so the tensor cores never
        wait for this warpgroup's adds, whatever the other consumer does. One 64 x 128 chain per K block, into the
        temporaries t0 / t1 alternately; the K loop is unrolled by two so that each keeps its registers (64
        accumulator + 2 x 64 temporary registers). A stage is released (``empty``) as soon as its chain is
        complete. (A BN = 192 variant, a 64 x 128 and a 64 x 64 chain per K block, compiled but ptxas serialized
        its wgmmas, C7514: not kept.)"""
        BM: gl.constexpr = a_smem.shape[1]
        BN: gl.constexpr = b_smem.shape[1]
        HALF: gl.constexpr = BM // 2
        gl.static_assert(BN == 128, "pipelined consumer: BN = 128")
        lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        scale = gl.load(sa_ptr) * gl.load(sb_ptr)
        # the wgmma temporaries: loop-carried so that they keep their registers (use_acc=False ignores the value)
        t0 = gl.zeros((HALF, BN), gl.float32, lay)
        t1 = gl.zeros((HALF, BN), gl.float32, lay)
        c = 0
        for item in range(pid, num_items, nprog):
            pid_m, pid_n, ks, k0, nk = _work_item(item, num_pid_m, num_pid_n, num_tiles, per, k_tiles, GROUP)
            # (a last K slice can be empty: zero partial)
            acc0, t0, t1, c = _kloop_pipe(a_smem, b_smem, ready, empty, gl.zeros((HALF, BN), gl.float32, lay), t0,
                                          t1, c, nk, WG, STAGES)
            row0 = pid_m * BM + WG * HALF
            _store_sub(acc0, c_ptr, ws_ptr, c_smem, WG * EPI_BUFS, scale, bias_ptr, M, N, ks, row0, pid_n * BN,
                       HAS_BIAS, SPLIT, EPI_BUFS, lay)
        if EPI_BUFS > 0:
            tma.store_wait(0)  # the buffers must outlive the stores reading them

    # ---------------------------------------------------------------------------------------------------------
    # Stream-K, K-aligned ("sk" configs), for outputs whose tiles do not fill whole waves of G = SMs CTAs.
    # The first dp_tiles tiles (whole waves: tiles // G x G) run data-parallel: CTA pid takes tiles pid, pid + G, ...
    # The T = tiles - dp_tiles others ("stream tiles") are split in K at block x, shared by Q = sk_tails tail CTAs
    # (``stream_k.sk_params`` picks x and Q by a cost model: Q = 0, no split, or Q = T / k tails of k whole tiles'
    # rests):
    #   * head CTAs (pid in [Q, Q + T); head h = pid - Q) run K blocks [0, x) of stream tile h, all T in step over
    #     the same K blocks (so, like data-parallel tiles, they share their A / B loads in L2);
    #   * tail CTAs (pid < Q) share the blocks [x, k_tiles) of all stream tiles, L = k_tiles - x per tile, in
    #     tile-major order, cut into Q contiguous ranges of sk_base or sk_base + 1 blocks (the first sk_rem CTAs one
    #     more); tail q stores its fp32 partial of each stream tile t its range meets into workspace slot q + t
    #     (one slot per (q, t): ranges are contiguous and ascending, so q + t never repeats) and raises flags
    #     [2 (q + t) + WG];
    #   * the head of tile t, after its own blocks, waits for and adds the partials of the tails that meet t in
    #     ascending K order (a fixed order: deterministic), resets their flags, then stores the tile.
    # Only heads wait, and only on tails, which never wait and have the lower pids (launched first): no wait cycle,
    # and with grid <= SMs (one CTA per SM, all co-resident) no deadlock. (A first stream-K cut all stream blocks into
    # equal contiguous ranges: each CTA then read its own K position, the A / B working set was the whole of K, and
    # it ran slower than data-parallel even where that idles SMs.) ``sk_plan`` is the host model (tests).
    @gluon.jit
    def _sk_lo(q, sk_base, sk_rem):
        """First tail-work block of tail CTA q (its range: [_sk_lo(q), _sk_lo(q + 1)))."""
        return q * sk_base + gl.minimum(q, sk_rem)

    @gluon.jit
    def _sk_first_tail(w, sk_base, sk_rem):
        """The tail CTA whose range holds tail-work block w."""
        big = sk_rem * (sk_base + 1)
        if w < big:
            q = w // (sk_base + 1)
        else:
            q = sk_rem + (w - big) // gl.maximum(sk_base, 1)
        return q

    @gluon.jit
    def _sk_items(pid, nprog, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem):
        """(DP items, work items) of CTA pid: its DP tiles, then its head item or the stream tiles its tail range
        meets."""
        n_dp = dp_tiles // nprog
        L = gl.maximum(k_tiles - sk_x, 1)
        lo = _sk_lo(pid, sk_base, sk_rem)
        hi = _sk_lo(pid + 1, sk_base, sk_rem)
        if pid < sk_tails:
            n_sk = ((hi - 1) // L - lo // L + 1) * (hi > lo).to(gl.int32)
        else:
            n_sk = (pid - sk_tails < num_tiles - dp_tiles).to(gl.int32)
        return n_dp, n_dp + n_sk

    @gluon.jit
    def _sk_item(i, pid, nprog, n_dp, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem, num_pid_m,
                 num_pid_n, GROUP: gl.constexpr):
        """Work item i of CTA pid -> (tile row, tile column, K blocks [k0, k1) of the tile, aux): aux is the
        workspace slot of a tail's partial (k0 > 0), the stream-tile index h of a head (k0 == 0, k1 < k_tiles)."""
        n_tail = sk_tails
        L = gl.maximum(k_tiles - sk_x, 1)
        dp = (i < n_dp).to(gl.int32)  # branch-free: one role of three is 1
        tail = (1 - dp) * (pid < n_tail).to(gl.int32)
        head = 1 - dp - tail
        lo = _sk_lo(pid, sk_base, sk_rem)
        hi = _sk_lo(pid + 1, sk_base, sk_rem)
        t = lo // L + (i - n_dp)  # a tail's stream tile (meaningless for the other roles: masked)
        ts = t * L
        tile = dp * (pid + i * nprog) + tail * (dp_tiles + t) + head * (dp_tiles + pid - n_tail)
        k0 = tail * (sk_x + gl.maximum(lo, ts) - ts)
        k1 = dp * k_tiles + tail * (sk_x + gl.minimum(hi, ts + L) - ts) + head * sk_x
        aux = tail * (pid + t) + head * (pid - n_tail)
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP)
        return pid_m, pid_n, k0, k1, aux

    @gluon.jit
    def _producer_sk(a_desc, b_desc, a_smem, b_smem, ready, empty, pid, nprog, num_pid_m, num_pid_n, k_tiles,
                     dp_tiles, sk_x, sk_tails, sk_base, sk_rem, STAGES: gl.constexpr, GROUP: gl.constexpr):
        num_tiles = num_pid_m * num_pid_n
        n_dp, n_items = _sk_items(pid, nprog, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem)
        c = 0
        for i in range(n_items):
            pid_m, pid_n, k0, k1, aux = _sk_item(i, pid, nprog, n_dp, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails,
                                                 sk_base, sk_rem, num_pid_m, num_pid_n, GROUP)
            for kb in range(k0, k1):
                _load_block(a_desc, b_desc, a_smem, b_smem, ready, empty, c, pid_m, pid_n, kb, STAGES)
                c += 1

    @gluon.jit
    def _ws_ptrs(ws_ptr, slot, col0, WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
        """Pointers to consumer WG's 64 x SUB block at column col0 of workspace slot ``slot`` (BM x BN fp32,
        row-major), in the accumulator's register layout (computed from the runtime slot: not hoisted and kept
        live across the loop by the compiler)."""
        HALF: gl.constexpr = BM // 2
        SUB: gl.constexpr = 128 if BN > 128 else BN
        rows = slot * BM + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, SUB, layout=gl.SliceLayout(0, layout))
        return ws_ptr + (rows[:, None].to(gl.int64) * BN + cols[None, :])

    @gluon.jit
    def _consumer_sk(a_smem, b_smem, ready, empty, c_ptr, ws_ptr, flags_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, pid,
                     nprog, num_pid_m, num_pid_n, k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem, WG: gl.constexpr,
                     HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, PIPE: gl.constexpr):
        """Stream-K consumer warpgroup WG (rows [64 WG, 64 WG + 64) of each tile): the K loop of ``_consumer``
        (PIPE False; BN 128 or 256) or ``_consumer_pipe`` (PIPE; BN 128) over each work item's K blocks, then
        by the item's role: whole tile -> store; a tail's partial (k0 > 0) -> fp32 partial into its slot
        (this consumer's 64 rows), a warpgroup barrier, and one release increment of the slot's flag for WG; a
        head (k0 == 0, k1 < k_tiles) -> for each tail q meeting the tile (ascending): spin on an acquire load of
        flag (q + h, WG), add slot q + h's rows (the same register layout as the writer's, so each thread reads
        exactly what its counterpart wrote), then store."""
        BM: gl.constexpr = a_smem.shape[1]
        BN: gl.constexpr = b_smem.shape[1]
        HALF: gl.constexpr = BM // 2
        SUB: gl.constexpr = 128 if BN > 128 else BN
        gl.static_assert(BN == SUB or BN == 2 * SUB, "BN: 64, 128 or 256")
        gl.static_assert(not PIPE or BN == 128, "pipelined consumer: BN = 128")
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB, 32])
        scale = gl.load(sa_ptr) * gl.load(sb_ptr)
        if PIPE:
            t0 = gl.zeros((HALF, SUB), gl.float32, layout)
            t1 = gl.zeros((HALF, SUB), gl.float32, layout)
        else:
            part = gl.zeros((HALF, SUB), gl.float32, layout)
        num_tiles = num_pid_m * num_pid_n
        n_tail = sk_tails
        L = k_tiles - sk_x
        n_dp, n_items = _sk_items(pid, nprog, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem)
        c = 0
        for i in range(n_items):
            pid_m, pid_n, k0, k1, aux = _sk_item(i, pid, nprog, n_dp, num_tiles, k_tiles, dp_tiles, sk_x, sk_tails,
                                                 sk_base, sk_rem, num_pid_m, num_pid_n, GROUP)
            acc0 = gl.zeros((HALF, SUB), gl.float32, layout)
            if PIPE:
                acc0, t0, t1, c = _kloop_pipe(a_smem, b_smem, ready, empty, acc0, t0, t1, c, k1 - k0, WG, STAGES)
            else:
                acc0, acc1, part, c = _kloop_plain(a_smem, b_smem, ready, empty, acc0,
                                                   gl.zeros((HALF, SUB), gl.float32, layout), part, c, k1 - k0, WG,
                                                   STAGES)
            if k0 > 0:  # a tail's part of a stream tile: partial into its slot (aux), then the flag
                gl.store(_ws_ptrs(ws_ptr, aux, 0, WG, BM, BN, layout), acc0)
                if BN > SUB:
                    gl.store(_ws_ptrs(ws_ptr, aux, SUB, WG, BM, BN, layout), acc1)
                gl.thread_barrier()  # the warpgroup's partial stores precede thread 0's release
                gl.atomic_add(flags_ptr + 2 * aux + WG, 1, sem="release", scope="gpu")
            else:
                if k1 < k_tiles:  # head of stream tile h = aux: add the tails' partials in K order
                    q = _sk_first_tail(aux * L, sk_base, sk_rem)
                    while (q < n_tail) & (_sk_lo(q, sk_base, sk_rem) < aux * L + L):
                        f = gl.atomic_add(flags_ptr + 2 * (q + aux) + WG, 0, sem="acquire", scope="gpu")
                        while f == 0:
                            f = gl.atomic_add(flags_ptr + 2 * (q + aux) + WG, 0, sem="acquire", scope="gpu")
                        # back to zero for the next launch (the flags buffer is reused: ``_sk_buffers``)
                        gl.atomic_xchg(flags_ptr + 2 * (q + aux) + WG, 0, sem="relaxed", scope="gpu")
                        # into the temporary's registers (its value is dead here): no extra registers
                        if PIPE:
                            t1 = gl.load(_ws_ptrs(ws_ptr, q + aux, 0, WG, BM, BN, layout), cache_modifier=".cg")
                            acc0 = acc0 + t1
                        else:
                            part = gl.load(_ws_ptrs(ws_ptr, q + aux, 0, WG, BM, BN, layout), cache_modifier=".cg")
                            acc0 = acc0 + part
                            if BN > SUB:
                                part = gl.load(_ws_ptrs(ws_ptr, q + aux, SUB, WG, BM, BN, layout),
                                               cache_modifier=".cg")
                                acc1 = acc1 + part
                        q += 1
                row0 = pid_m * BM + WG * HALF
                _store_tile(acc0, c_ptr, ws_ptr, scale, bias_ptr, M, N, 0, row0, pid_n * BN, HAS_BIAS, False,
                            layout)
                if BN > SUB:
                    _store_tile(acc1, c_ptr, ws_ptr, scale, bias_ptr, M, N, 0, row0, pid_n * BN + SUB, HAS_BIAS,
                                False, layout)

    @gluon.jit
    def _fp8_gemm_ws_kernel(a_desc, b_desc, c_ptr, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, split_k,
                            dp_tiles, sk_x, sk_tails, sk_base, sk_rem, flags_ptr,
                            HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                            EPI_BUFS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            num_warps: gl.constexpr, PIPE: gl.constexpr = False, SK: gl.constexpr = False):
        """EPI_BUFS > 0: TMA epilogue with EPI_BUFS shared-memory buffers per consumer and ``c_ptr`` C's tensor
        descriptor (block BM // 2 x min(BN, 128)); EPI_BUFS == 0: masked pointer stores. PIPE: ``_consumer_pipe``
        (BN = 128), else ``_consumer`` (BN 64, 128 or 256). SK: stream-K (``_consumer_sk``; ws_ptr: nprog x BM x
        BN fp32 slots, flags_ptr: 2 nprog int32 zeros; dp_tiles / sk_x / sk_tails / sk_base / sk_rem as in the
        comment above ``_sk_lo``); else dp_tiles, sk_x, sk_tails, sk_base, sk_rem and flags_ptr are unused."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BM == 128 and num_warps == 4, "two 64-row consumer warpgroups")
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if EPI_BUFS > 0:
            c_smem = gl.allocate_shared_memory(c_ptr.dtype, [2 * EPI_BUFS] + c_ptr.block_type.shape, c_ptr.layout)
        else:
            c_smem = a_smem  # unused
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_tiles = num_pid_m * num_pid_n
        num_items = num_tiles * split_k
        k_tiles = gl.cdiv(K, BK)
        per = gl.cdiv(k_tiles, split_k)
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        if SK:
            gl.warp_specialize([
                (_consumer_sk, (a_smem, b_smem, ready, empty, c_ptr, ws_ptr, flags_ptr, sa_ptr, sb_ptr, bias_ptr, M,
                                N, pid, nprog, num_pid_m, num_pid_n, k_tiles, dp_tiles, sk_x, sk_tails, sk_base,
                                sk_rem, WG0, HAS_BIAS, STAGES, GROUP, PIPE)),
                (_consumer_sk, (a_smem, b_smem, ready, empty, c_ptr, ws_ptr, flags_ptr, sa_ptr, sb_ptr, bias_ptr, M,
                                N, pid, nprog, num_pid_m, num_pid_n, k_tiles, dp_tiles, sk_x, sk_tails, sk_base,
                                sk_rem, WG1, HAS_BIAS, STAGES, GROUP, PIPE)),
                (_producer_sk, (a_desc, b_desc, a_smem, b_smem, ready, empty, pid, nprog, num_pid_m, num_pid_n,
                                k_tiles, dp_tiles, sk_x, sk_tails, sk_base, sk_rem, STAGES, GROUP)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        elif PIPE:
            gl.warp_specialize([
                (_consumer_pipe, (a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr,
                                  bias_ptr, M, N, pid, nprog, num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles,
                                  WG0, HAS_BIAS, SPLIT, STAGES, GROUP, EPI_BUFS)),
                (_consumer_pipe, (a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr,
                                  bias_ptr, M, N, pid, nprog, num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles,
                                  WG1, HAS_BIAS, SPLIT, STAGES, GROUP, EPI_BUFS)),
                (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, pid, nprog, num_pid_m, num_pid_n, num_tiles,
                             num_items, per, k_tiles, STAGES, GROUP)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, pid,
                             nprog, num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles, WG0, HAS_BIAS, SPLIT,
                             STAGES, GROUP, EPI_BUFS)),
                (_consumer, (a_smem, b_smem, c_smem, ready, empty, c_ptr, ws_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, pid,
                             nprog, num_pid_m, num_pid_n, num_tiles, num_items, per, k_tiles, WG1, HAS_BIAS, SPLIT,
                             STAGES, GROUP, EPI_BUFS)),
                (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, pid, nprog, num_pid_m, num_pid_n, num_tiles,
                             num_items, per, k_tiles, STAGES, GROUP)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    _GL_DTYPE = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
    _GL_OUT_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32, torch.float16: gl.float16}


def _smem_limit(device) -> int:
    return _smem_limit_of(device.index or 0)


# Host time matters: a launch's Python (Triton's launcher, descriptors, layouts) costs several times _scaled_mm's,
# which on small GEMMs exceeds the kernel itself. What does not depend on the tensors' addresses is computed once.
@functools.cache
def _smem_limit_of(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 232448)


@functools.cache
def _smem_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPE.get(dtype) or _GL_OUT_DTYPE[dtype])


def _descriptor(t: torch.Tensor, block: tuple):
    """TMA descriptor of a row-major 2-D ``t`` with block ``block``."""
    rows, cols = t.shape
    return GluonDescriptor(t, [rows, cols], [cols, 1], list(block), _smem_layout(block, t.dtype))


_SK_BUFFERS: dict = {}


def _sk_buffers(device, grid: int, slot_elems: int):
    """Stream-K workspace (grid slots of slot_elems fp32) and flags (2 grid int32, zero between launches: the heads
    reset each flag they consume), kept per device and stream (launches on one stream run in order; two streams
    must not share them) and grown on demand."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    ws, flags = _SK_BUFFERS.get(key, (None, None))
    if ws is None or ws.numel() < grid * slot_elems or flags.numel() < 2 * grid:
        ws = torch.empty(grid * slot_elems, dtype=torch.float32, device=device)
        flags = torch.zeros(2 * grid, dtype=torch.int32, device=device)
        _SK_BUFFERS[key] = (ws, flags)
    return ws, flags


def _epilogue(config, c, split_k: int) -> int:
    """Shared-memory output buffers per consumer for ``config``'s epilogue on C ``c``: 0 = pointer stores."""
    BM, BN, BK, stages = config[:4]
    if len(config) < 5 or config[4] != "tma" or split_k > 1 or c.dtype not in _GL_OUT_DTYPE:
        return 0
    M, N = c.shape
    if c.stride(1) != 1 or c.stride(0) != N or (N * c.element_size()) % 16 or c.data_ptr() % 16:
        return 0
    sub = min(BN, 128)
    ring = stages * (BM + BN) * BK + 2 * stages * 8
    for bufs in (BN // sub, 1):
        if ring + 2 * bufs * (BM // 2) * sub * c.element_size() + 1024 <= _smem_limit(c.device):
            return bufs
    return 0


def launch(a, b, c, ws, scale_a, scale_b, bias, split_k: int, num_sms: int, config=CONFIGS[0],
           sk_tails: int | None = None) -> None:
    """Runs the kernel: C (split_k == 1) or the (split_k, M, N) fp32 workspace ``ws`` (split_k > 1, unscaled,
    no bias) from a (M, K) and b (N, K); ``config`` is one of ``CONFIGS``. Stream-K configs (``_sched``) need
    split_k == 1 and use a workspace (grid BM x BN fp32 slots) and flags kept per device and stream; ``sk_tails``
    overrides their tail count (``stream_k.sk_params``)."""
    BM, BN, BK, stages = config[:4]
    M, K = a.shape
    N = b.shape[0]
    a_desc = _descriptor(a, (BM, BK))
    b_desc = _descriptor(b, (BN, BK))
    tiles = cdiv(M, BM) * cdiv(N, BN)
    sched = _sched(config)
    if sched:
        if split_k != 1:
            raise ValueError(f"fp8_gemm_ws: stream-K config {config} needs split_k == 1")
        grid, dp_tiles, sk_x, sk_tails, sk_base, sk_rem = sk_params(tiles, cdiv(K, BK), num_sms, sk_tails)
        # grid partial slots (slot q + t of tail q's part of stream tile t), one flag per (slot, consumer)
        ws_arg, flags = _sk_buffers(c.device, grid, BM * BN)
        _fp8_gemm_ws_kernel[(grid,)](
            a_desc, b_desc, c, ws_arg, scale_a, scale_b, bias if bias is not None else scale_a, M, N, K, 1,
            dp_tiles, sk_x, sk_tails, sk_base, sk_rem, flags, HAS_BIAS=bias is not None, SPLIT=False, STAGES=stages,
            GROUP=GROUP_M, EPI_BUFS=0, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
            maxnreg=MAXNREG, PIPE=_pipe(config), SK=True)
        return
    items = tiles * split_k
    split = split_k > 1
    epi_bufs = _epilogue(config, c, split_k)
    c_arg = c
    if epi_bufs:
        c_arg = _descriptor(c, (BM // 2, min(BN, 128)))
    _fp8_gemm_ws_kernel[(min(items, num_sms),)](
        a_desc, b_desc, c_arg, ws if split else c, scale_a, scale_b, bias if bias is not None else scale_a, M, N, K,
        split_k, 0, 0, 0, 0, 0, _dummy_i32(c.device), HAS_BIAS=bias is not None and not split, SPLIT=split,
        STAGES=stages, GROUP=GROUP_M, EPI_BUFS=epi_bufs, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4, maxnreg=MAXNREG, PIPE=_pipe(config))


_DUMMY: dict = {}


def _dummy_i32(device):
    """A never-accessed int32 pointer argument (the flags of non-stream-K launches)."""
    t = _DUMMY.get(device)
    if t is None:
        t = _DUMMY[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def _sched(config) -> str:
    """"sk" for stream-K configs, else ""."""
    return config[6] if len(config) > 6 else ""


# The configs ``run`` times on a shape's first call: all of them. The stream-K ones split tiles only where that
# fits the SMs (``stream_k.sk_params``), else they run data-parallel like the others. Their heads wait on tails of the
# same grid (grid <= SMs); a kernel running beside them on another stream only delays the tails until it ends; a
# partition of the GPU smaller than the grid (MPS SM limits, green contexts) would never run them: not supported.
TUNED_CONFIGS = list(CONFIGS)


def _pipe(config) -> bool:
    return len(config) > 5 and config[5] == "pipe"


_BEST: dict = {}


def _tune_key(a, b, c, bias, split_k):
    return (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, c.dtype, bias is not None, split_k, a.device)


def run(a, b, c, ws, scale_a, scale_b, bias, split_k: int, num_sms: int, config=None) -> None:
    """``launch`` with ``config``, or with the fastest of ``TUNED_CONFIGS`` for this shape (timed on the first call of
    each shape / dtype / flag combination, like Triton's autotuner: that call synchronizes)."""
    if config is None:
        key = _tune_key(a, b, c, bias, split_k)
        config = _BEST.get(key)
        if config is None:
            fns = {}
            for cfg in TUNED_CONFIGS:
                if _sched(cfg) and split_k != 1:  # stream-K: split_k == 1 only
                    continue
                fn = functools.partial(launch, a, b, c, ws, scale_a, scale_b, bias, split_k, num_sms, cfg)
                try:
                    fn()
                except Exception as exc:  # e.g. out of shared memory on a smaller part
                    warnings.warn(f"fp8_gemm_ws: config {cfg} failed ({type(exc).__name__}: {exc})", stacklevel=2)
                    continue
                fns[cfg] = fn
            if not fns:
                raise RuntimeError("fp8_gemm_ws: no config runs")
            config = _BEST[key] = fastest(fns)
    launch(a, b, c, ws, scale_a, scale_b, bias, split_k, num_sms, config)
