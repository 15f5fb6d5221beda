"""The host side of the warp-specialized GEMM's stream-K schedule (``fp8_gemm_ws``'s "sk" configs): how many tail
CTAs split the last wave's tiles with their heads, where each head's K range ends, and a host model of the whole
schedule (``sk_plan``) that the tests compare with the kernel's."""

from __future__ import annotations

from .quantize import cdiv

# The cost model, in K blocks of one CTA, from per-CTA GPU timer stamps: handing one partial over (its fp32 stores,
# the release, the next item's start) costs its tail several K blocks, and its head about as many after the flag is
# raised (seeing it, loading and adding the partial; more when all heads merge at once).
SK_HANDOVER_BLOCKS = 7  # a tail's cost per partial it hands over
SK_FINISH_BLOCKS = 7  # a head's wait and merge
SK_MIN_GAIN = 0.9  # split only where the model's span is at most this share of the unsplit one


def _sk_x(stream: int, k_tiles: int, tails: int) -> int:
    """The head's K blocks x. Where ``tails`` divides the stream tiles, each tail takes the rest of k = stream / tails
    whole tiles and x balances a head (x blocks) against a tail (k (k_tiles - x + SK_HANDOVER_BLOCKS)); otherwise
    all stream blocks are shared equally between heads and tails."""
    if stream % tails == 0:
        k = stream // tails
        x = round(k * (k_tiles + SK_HANDOVER_BLOCKS) / (k + 1))
    else:
        x = cdiv(stream * k_tiles, stream + tails)
    return max(1, min(k_tiles - 1, x)) if k_tiles > 1 else k_tiles


def _sk_span(stream: int, k_tiles: int, tails: int) -> float:
    """The model's time (K blocks) of the stream tiles split over ``tails`` tails (0: unsplit)."""
    if tails == 0:
        return float(k_tiles)
    x = _sk_x(stream, k_tiles, tails)
    per_tail = stream * (k_tiles - x) / tails
    pieces = -(-stream // tails) + (stream % tails != 0)  # tiles a tail's range meets
    return max(x, per_tail + pieces * SK_HANDOVER_BLOCKS) + SK_FINISH_BLOCKS


def sk_params(tiles: int, k_tiles: int, num_sms: int, tails: int | None = None):
    """(grid, dp_tiles, x, tails, sk_base, sk_rem) of a stream-K launch (the schedule in the comment above
    ``fp8_gemm_ws._sk_lo``): whole waves of num_sms tiles data-parallel; the T other tiles either whole or split
    between T heads (K blocks [0, x)) and Q tails (the rest, ``_sk_x``). Q is, of 0 and the counts that give each
    tail k <= 6 whole tiles' rests (T = k Q, T + Q <= num_sms), the one with the shortest ``_sk_span``, if that is
    at most SK_MIN_GAIN of the unsplit span. One tail per head gains most; with more tails per head the heads'
    merges all come at once and the gain shrinks; tails whose ranges cross tile boundaries were slower than unsplit
    tiles. ``tails`` overrides the choice (at most num_sms - T; tests)."""
    grid = max(1, num_sms)
    dp_tiles = (tiles // grid) * grid
    stream = tiles - dp_tiles
    if tails is None:
        tails = 0
        for q in (stream // k for k in range(1, 7) if stream % k == 0 and stream + stream // k <= grid):
            if _sk_span(stream, k_tiles, q) < min(_sk_span(stream, k_tiles, tails), SK_MIN_GAIN * k_tiles):
                tails = q
    tails = max(0, min(tails, grid - stream))
    if dp_tiles == 0:
        grid = max(1, stream + tails)
    if stream == 0 or tails == 0:
        return grid, dp_tiles, k_tiles, 0, 0, 0
    x = _sk_x(stream, k_tiles, tails)
    sk_base, sk_rem = divmod(stream * (k_tiles - x), tails)
    return grid, dp_tiles, x, tails, sk_base, sk_rem


def sk_plan(tiles: int, k_tiles: int, num_sms: int, tails: int | None = None):
    """Host model of the kernel's stream-K schedule (same arithmetic as ``fp8_gemm_ws._sk_items`` / ``_sk_item`` /
    ``_consumer_sk``): per CTA, its work items as (tile, k0, k1, role, detail) with role "whole", "partial" (detail:
    the workspace slot it stores and flags) or "finish" (detail: the (tail CTA, slot) pairs whose partials it adds,
    in that order, before it stores)."""
    grid, dp_tiles, x, n_tail, base, rem = sk_params(tiles, k_tiles, num_sms, tails)
    stream = tiles - dp_tiles
    L = k_tiles - x

    def lo_(q):
        return q * base + min(q, rem)

    plan = []
    for pid in range(grid):
        items = [(pid + i * grid, 0, k_tiles, "whole", ()) for i in range(dp_tiles // grid)]
        if pid < n_tail:
            lo, hi = lo_(pid), lo_(pid + 1)
            for t in (range(lo // L, (hi - 1) // L + 1) if hi > lo else ()):
                items.append((dp_tiles + t, x + max(lo, t * L) - t * L, x + min(hi, t * L + L) - t * L, "partial",
                              pid + t))
        elif pid - n_tail < stream:
            h = pid - n_tail
            waits = tuple((q, q + h) for q in range(n_tail) if lo_(q) < h * L + L and lo_(q + 1) > h * L)
            items.append((dp_tiles + h, 0, x, "finish" if L else "whole", waits))
        plan.append(items)
    return plan
