"""trainer/kernels/fp8_gemm_ws.py (warp-specialized precise-accumulation FP8 GEMM, Gluon) against an fp64 product.

On the CPU only the import and ``supported`` are checked (Gluon has no interpreter). On an sm90 GPU: every config
over tile-multiple and edge shapes (M, N not tile multiples, K % 128 != 0), bias, bf16 / fp32 output, e5m2 x e4m3
and e4m3 x e4m3, split-K into the workspace, and a long-K same-sign product where fast accumulation is visibly worse
(every config: "pipe" ones run their K loop unrolled by two, so odd / even K block counts, one block, and an empty
last K slice are all covered by CASES). Configs with the "tma" epilogue also run its pointer fallback (unaligned C
rows) and the clipped TMA stores at the edges. Tolerance: the relative error against the fp64 product of the same
fp8 operands is at most 1.5x that of ``torch._scaled_mm(use_fast_accum=False)`` (operands zero-padded to multiples
of 16 where it needs that), plus the output rounding for bf16.
"""

from __future__ import annotations

import pytest
import torch

from fp8mon.trainer.kernels import fp8_gemm_ws as W
from fp8mon.trainer.kernels import stream_k as SK

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and W.AVAILABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU and Triton's Gluon")


def test_import_and_declines_cpu_tensors():
    assert isinstance(W.AVAILABLE, bool)
    assert W.CONFIGS and all(len(c) == 4 or (len(c) in (5, 6, 7) and c[4] in ("ptr", "tma")) for c in W.CONFIGS)
    assert all(c[5] == "pipe" and c[1] == 128 for c in W.CONFIGS if len(c) == 6)  # pipelined consumer: BN = 128
    # stream-K: pointer epilogue, BN = 128
    assert all(c[6] == "sk" and c[4] == "ptr" and c[1] == 128 and c[5] in ("plain", "pipe")
               for c in W.CONFIGS if len(c) == 7)
    assert len(set(W.CONFIGS)) == len(W.CONFIGS)
    assert not W.supported(torch.empty(2, 2))
    assert not W.supported(torch.empty(2, 2, dtype=E4))


@pytest.mark.skipif(not W.AVAILABLE, reason="needs Triton's Gluon")
def test_epilogue_choice(monkeypatch):
    """The TMA epilogue's buffers: one per 128-column chain where the shared memory has room, else one; pointer
    stores for split-K, unaligned C rows and configs without "tma"."""
    monkeypatch.setattr(W, "_smem_limit", lambda device: 232448)
    bf, f32 = torch.empty(256, 256, dtype=torch.bfloat16), torch.empty(256, 256)
    assert W._epilogue((128, 256, 128, 3, "tma"), bf, 1) == 2
    assert W._epilogue((128, 256, 128, 3, "tma"), f32, 1) == 1
    assert W._epilogue((128, 256, 128, 4, "tma"), bf, 1) == 1
    assert W._epilogue((128, 256, 128, 4, "tma"), f32, 1) == 0
    assert W._epilogue((128, 128, 128, 5, "tma"), f32, 1) == 1
    assert W._epilogue((128, 256, 128, 3, "tma"), f32, 2) == 0
    assert W._epilogue((128, 256, 128, 3, "tma"), torch.empty(256, 100, dtype=torch.bfloat16), 1) == 0
    assert W._epilogue((128, 256, 128, 3), bf, 1) == 0
    assert W._epilogue((128, 128, 128, 5, "tma", "pipe"), f32, 1) == 1
    assert W._epilogue((128, 128, 128, 6, "ptr", "pipe"), bf, 1) == 0
    assert W._pipe((128, 128, 128, 6, "ptr", "pipe")) and not W._pipe((128, 128, 128, 5, "tma"))


def _operands(M, N, K, da, db, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 4).to(da).cuda()
    b = (torch.randn(N, K, generator=g) * 4).to(db).cuda()
    return a, b


def _rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def _pad16(x):
    r, k = x.shape
    out = torch.zeros(-(-r // 16) * 16, -(-k // 16) * 16, dtype=x.dtype, device=x.device)
    out[:r, :k] = x
    return out


def _scaled_mm_f32(a, b, fast: bool):
    """Unscaled fp32 A @ B^T through cuBLAS (zero padding changes no sum)."""
    one = torch.tensor(1.0, device=a.device)
    c = torch._scaled_mm(_pad16(a), _pad16(b).t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                         use_fast_accum=fast)
    return c[:a.shape[0], :b.shape[0]]


def _num_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


CASES = [  # M, N, K, A dtype, B dtype, out dtype, bias dtype (None: no bias), split_k
    (256, 256, 512, E5, E4, torch.float32, None, 1),
    (1024, 768, 1024, E4, E4, torch.bfloat16, torch.bfloat16, 1),
    (1000, 520, 272, E5, E4, torch.bfloat16, torch.bfloat16, 1),
    (130, 200, 96, E5, E4, torch.float32, None, 1),
    (512, 384, 640, E5, E4, torch.bfloat16, torch.float32, 1),
    (4096, 2048, 384, E5, E4, torch.bfloat16, None, 1),  # more tiles than SMs: the ring runs across tiles
    (384, 512, 8192, E5, E4, torch.float32, None, 2),
    (300, 260, 4112, E5, E4, torch.float32, None, 4),  # 33 K blocks: slices of 9, 9, 9 and 6
    (768, 768, 16384, E4, E4, torch.float32, None, 4),
    (200, 100, 256, E5, E4, torch.bfloat16, torch.bfloat16, 1),  # 200-byte rows: no TMA store, pointer fallback
    (4100, 1032, 1152, E5, E4, torch.bfloat16, torch.bfloat16, 1),  # TMA store ring over many tiles, clipped edges
    (520, 260, 640, E5, E4, torch.float32, None, 4),  # 5 K blocks in slices of 2, 2, 1 and none (zero partial)
]


@needs_sm90
@pytest.mark.parametrize("config", W.CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-s{c[7]}")
def test_ws_vs_fp64(case, config):
    M, N, K, da, db, od, bias_dt, split_k = case
    if W._sched(config):  # stream-K configs: split_k == 1 only (the split cases still cover their shapes)
        split_k, od = 1, torch.float32
    a, b = _operands(M, N, K, da, db, seed=M + N + K)
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.9, device="cuda")
    bias = torch.randn(N, device="cuda").to(bias_dt) if bias_dt is not None else None
    exact = a.double() @ b.double().t()
    cublas = _rel(_scaled_mm_f32(a, b, fast=False), exact)
    if split_k == 1:
        c = torch.full((M, N), float("nan"), dtype=od, device="cuda")
        W.launch(a, b, c, None, sa, sb, bias, 1, _num_sms(), config)
        want = exact * (0.37 * 1.9) + (0 if bias is None else bias.double())
        assert bool(torch.isfinite(c).all())
        e = _rel(c, want)
        tol = 1.5 * cublas + (4e-3 if od == torch.bfloat16 else 1e-7)
    else:
        ws = torch.full((split_k, M, N), float("nan"), dtype=torch.float32, device="cuda")
        c = torch.empty((M, N), dtype=torch.float32, device="cuda")
        W.launch(a, b, c, ws, sa, sb, None, split_k, _num_sms(), config)
        assert bool(torch.isfinite(ws).all()), "every K slice writes its whole partial"
        e = _rel(ws.sum(0) * (sa * sb), exact * (0.37 * 1.9))
        tol = 1.5 * cublas + 1e-7
    assert e <= tol, (e, cublas)


@needs_sm90
@pytest.mark.parametrize("config", W.CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_ws_promotes_every_128(config):
    """Same-sign products over a long K: partial sums outgrow the tensor core accumulator's precision, so fast
    accumulation is visibly worse; the kernel must stay at _scaled_mm's precise level."""
    a, b = _operands(256, 256, 16384, E4, E4, seed=3)
    a = (a.float().abs() * 16).to(E4)
    b = b.float().abs().to(E4)
    one = torch.tensor(1.0, device="cuda")
    exact = a.double() @ b.double().t()
    c = torch.empty(256, 256, dtype=torch.float32, device="cuda")
    W.launch(a, b, c, None, one, one, None, 1, _num_sms(), config)
    e = _rel(c, exact)
    precise = _rel(_scaled_mm_f32(a, b, fast=False), exact)
    fast = _rel(_scaled_mm_f32(a, b, fast=True), exact)
    assert e <= 1.5 * precise + 1e-7, (e, precise, fast)
    assert e < fast, (e, precise, fast)


@needs_sm90
def test_ws_run_tunes_and_reuses():
    a, b = _operands(512, 512, 1024, E5, E4, seed=11)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    exact = a.double() @ b.double().t()
    for _ in range(2):  # the second call takes the remembered config
        c = torch.empty(512, 512, dtype=torch.bfloat16, device="cuda")
        W.run(a, b, c, None, sa, sb, None, 1, _num_sms())
        assert _rel(c, exact) <= 1.5 * _rel(_scaled_mm_f32(a, b, fast=False), exact) + 4e-3
    assert len([k for k in W._BEST if k[0] == (512, 1024)]) == 1


SK_PLANS = [  # tiles, k_tiles, grid (num_sms), tails (None: sk_params' choice)
    (5, 3, 2, None), (5, 33, 12, None), (5, 3, 7, None), (1, 1, 132, None), (3, 2, 132, None), (108, 128, 132, None),
    (192, 128, 132, None), (36, 128, 132, None), (96, 128, 132, None), (2048, 16, 132, None), (264, 7, 132, None),
    (7, 5, 3, None), (131, 1, 132, None), (10, 2, 7, None),
    # forced tail counts: tails' ranges cross tile boundaries, heads wait on several tails, some tails get nothing
    (5, 33, 12, 7), (36, 128, 132, 96), (108, 128, 132, 24), (10, 33, 7, 2), (3, 2, 132, 129), (5, 3, 7, 1),
]


@pytest.mark.skipif(not W.AVAILABLE, reason="needs Triton's Gluon")
@pytest.mark.parametrize("plan", SK_PLANS, ids=lambda p: "-".join(map(str, p)))
def test_sk_plan(plan):
    """The stream-K schedule (host model of the kernel's arithmetic): every K block of every tile exactly once;
    whole waves data-parallel; the other tiles either whole or split between heads and tails that each take the rests
    of k whole tiles (the 124M wgrads on 132 SMs: proj and fc1 one tail per head, fc2 three tiles per tail, qkv
    unsplit), so no CTA runs more of them than an unsplit tile's K blocks; the stream tiles' heads all run the same
    K blocks [0, x); each tile split over CTAs is finished by its head, which waits only on tails (CTAs that never
    wait: no wait cycle), in ascending K order, for partials in distinct workspace slots, and consumes every partial
    (its flag is reset). Forced tail counts (tests of the kernel's general ranges) keep the same invariants."""
    tiles, kt, nsm, forced = plan
    P = SK.sk_plan(tiles, kt, nsm, forced)
    grid, dp_tiles, x, tails_n, _, _ = SK.sk_params(tiles, kt, nsm, forced)
    stream = tiles - dp_tiles
    assert dp_tiles == (tiles // nsm) * nsm and len(P) == grid == (nsm if dp_tiles else stream + tails_n) <= nsm
    if forced is None:
        assert tails_n == 0 or (stream % tails_n == 0 and stream // tails_n <= 6)
        expected = {(36, 128, 132): 36, (192, 128, 132): 60, (96, 128, 132): 32, (108, 128, 132): 0}
        assert tails_n == expected.get((tiles, kt, nsm), tails_n)
    seen = {}
    for pid, items in enumerate(P):
        for (t, k0, k1, role, detail) in items:
            assert 0 <= k0 < k1 <= kt
            for k in range(k0, k1):
                assert (t, k) not in seen
                seen[(t, k)] = pid
    assert len(seen) == tiles * kt
    for pid, items in enumerate(P):
        assert [t for (t, *_) in items if t < dp_tiles] == list(range(pid, dp_tiles, grid))
        work = sum(k1 - k0 for (t, k0, k1, r, d) in items if t >= dp_tiles)
        if forced is None:  # a head's x blocks, a tail's k whole tiles' rests
            assert work <= (max(x, stream // tails_n * (kt - x)) if tails_n else kt) and (not tails_n or x < kt), work
        else:  # heads: x blocks; tails: an equal share of the rest
            assert work <= max(x, -(-stream * (kt - x) // max(tails_n, 1))), work
    slots, tails = set(), set()
    for pid, items in enumerate(P):
        for (t, k0, k1, role, detail) in items:
            if role == "partial":
                assert t >= dp_tiles and k0 >= x and detail not in slots and 0 <= detail < grid
                slots.add(detail)
                tails.add(pid)
    consumed = set()
    for pid, items in enumerate(P):
        for j, (t, k0, k1, role, detail) in enumerate(items):
            if t >= dp_tiles:
                assert role == "partial" or (k0, k1) == (0, x)  # heads run [0, x) in step
            if role == "finish":
                assert pid not in tails and j == len(items) - 1 and detail
                covered = k1
                for q, slot in detail:
                    part = [it for it in P[q] if it[0] == t]
                    assert q in tails and len(part) == 1 and part[0][4] == slot and part[0][1] == covered
                    covered = part[0][2]
                assert covered == kt
                consumed.update(slot for _, slot in detail)
            if role == "whole":
                assert (k0, k1) == (0, kt)
    assert consumed == slots  # every raised flag is consumed (and reset) by a head


SK_CONFIGS = [c for c in W.CONFIGS if W._sched(c)]
SK_CASES = [  # M, N, K, num_sms (None: all), out dtype, bias, tails (None: sk_params' choice)
    (640, 128, 384, 2, torch.float32, False, None),  # 5 tiles x 3 K blocks on 2 CTAs: 2 DP waves, 1 head, 1 tail
    (640, 128, 4112, 12, torch.bfloat16, True, None),  # 5 tiles x 33 K blocks on 12 CTAs: 5 heads, 5 tails
    (640, 128, 4112, 12, torch.bfloat16, True, 7),  # the same with 7 tails: ranges across tiles, 2 waits per head
    (640, 200, 4112, 7, torch.float32, False, None),  # 10 tiles (edge columns), 7 CTAs: a DP wave, 3 heads, 3 tails
    (2304, 768, 4096, None, torch.float32, False, None),  # 124M qkv wgrad at reduced K: 108 tiles, not split
    (2304, 768, 4096, None, torch.float32, False, 24),  # ... split over 24 tails (4-5 tiles each)
    (4096, 768, 2048, None, torch.float32, False, None),  # 124M fc1 wgrad at reduced K: DP wave, 60 heads, 60 tails
    (768, 768, 4096, None, torch.float32, False, None),  # 124M proj wgrad at reduced K: 36 heads, 36 tails
    (768, 768, 4096, None, torch.float32, False, 96),  # ... 96 tails: up to 4 partials per head
    (1000, 520, 272, None, torch.bfloat16, True, None),  # 3 K blocks (last one partial) over 40 tiles
]


@needs_sm90
@pytest.mark.parametrize("config", SK_CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("case", SK_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-g{c[3]}-t{c[6]}")
def test_sk_exact_and_deterministic(case, config):
    """Stream-K against fp64 (same tolerance as test_ws_vs_fp64), and two launches bitwise identical."""
    M, N, K, nsm, od, has_bias, tails = case
    a, b = _operands(M, N, K, E5, E4, seed=M + N + K + 1)
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.9, device="cuda")
    bias = torch.randn(N, device="cuda").to(torch.bfloat16) if has_bias else None
    exact = a.double() @ b.double().t()
    cublas = _rel(_scaled_mm_f32(a, b, fast=False), exact)
    outs = []
    for _ in range(2):
        c = torch.full((M, N), float("nan"), dtype=od, device="cuda")
        W.launch(a, b, c, None, sa, sb, bias, 1, nsm or _num_sms(), config, sk_tails=tails)
        outs.append(c)
    torch.cuda.synchronize()
    want = exact * (0.37 * 1.9) + (0 if bias is None else bias.double())
    assert bool(torch.isfinite(outs[0]).all())
    e = _rel(outs[0], want)
    assert e <= 1.5 * cublas + (4e-3 if od == torch.bfloat16 else 1e-7), (e, cublas)
    assert torch.equal(outs[0].view(torch.int16 if od == torch.bfloat16 else torch.int32),
                       outs[1].view(torch.int16 if od == torch.bfloat16 else torch.int32)), "not deterministic"
    flags = W._SK_BUFFERS[(a.device, torch.cuda.current_stream().cuda_stream)][1]
    assert not bool(flags.any()), "every flag a tail raised is reset by its head, for the next launch"
