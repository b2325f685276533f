"""What attention costs: FLOPs, and the bytes standard and flash attention move to and from HBM.

Counts per call, for (batch, heads, seq, head_dim) inputs of ``elem_bytes`` per element.
The FLOP counts are the convention FlashAttention's papers and benchmarks use, so our
TFLOP/s compare with theirs: two matmuls of ``2 N^2 d`` each per head in the forward
(the softmax's exponentials are not counted), half of that when causal, and 2.5x the
forward for the backward (four matmuls plus the recomputation of ``Q K^T``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, *,
                    causal: bool = False, backward: bool = False, seq_k: int | None = None) -> float:
    """Matmul FLOPs of one attention forward (or backward) call.

    ``seq`` queries against ``seq_k`` keys (default ``seq``). Causal counts the visible
    (query, key) pairs by the same convention as self-attention's half: with the mask
    aligned to the bottom right, ``seq * (seq_k - seq)`` pairs left of the diagonal
    block plus half of the ``seq x seq`` block.
    """
    seq_k = seq if seq_k is None else seq_k
    pairs = seq * (seq_k - seq) + seq * seq / 2 if causal else seq * seq_k
    flops = 4.0 * batch * heads * pairs * head_dim
    return flops * 2.5 if backward else flops


@dataclass(frozen=True)
class Traffic:
    """Bytes by what they carry; ``total`` is the sum."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def naive_traffic(batch: int, heads: int, seq: int, head_dim: int, *, elem_bytes: int = 2) -> Traffic:
    """Standard attention as three kernels: ``S = Q K^T``; ``P = softmax(S)``; ``O = P V``.

    Each kernel reads its inputs from HBM and writes its output there: S is written once
    and read once by the softmax, P is written once and read once by the second matmul.
    The (N, N) terms are what grows: 4 N^2 elements per head against 4 N d for Q, K, V, O.
    """
    bh, nd, nn = batch * heads, seq * head_dim, seq * seq
    return Traffic({
        "Q, K, V read": 3 * bh * nd * elem_bytes,
        "O written": bh * nd * elem_bytes,
        "S written, then read by softmax": 2 * bh * nn * elem_bytes,
        "P written, then read by P V": 2 * bh * nn * elem_bytes,
    })


def flash_traffic(batch: int, heads: int, seq: int, head_dim: int, *, block_m: int = 128,
                  causal: bool = False, elem_bytes: int = 2) -> Traffic:
    """FlashAttention-2's forward: each Q tile is read once, K and V once per Q tile.

    A program holds ``block_m`` query rows and streams every K/V tile it needs past them:
    all ``seq`` keys, or (causal) the keys up to its diagonal. These are the bytes the
    kernels ask for; K/V tiles that several programs want at once are often served from
    L2, so HBM sees at most this much.
    """
    bh, nd = batch * heads, seq * head_dim
    q_tiles = math.ceil(seq / block_m)
    if causal:
        keys_read = sum(min(seq, (i + 1) * block_m) for i in range(q_tiles))
    else:
        keys_read = q_tiles * seq
    return Traffic({
        "Q, K, V read": bh * (nd + 2 * keys_read * head_dim) * elem_bytes,
        "O written": bh * nd * elem_bytes,
        "logsumexp written": bh * seq * 4,
    })


def fa1_traffic(batch: int, heads: int, seq: int, head_dim: int, *, block: int = 64,
                elem_bytes: int = 2) -> Traffic:
    """The FA1-ordered kernel: K/V tiles outside, Q tiles inside, state kept in HBM.

    For each of the ``seq / block`` K/V tiles, every Q tile is read again, and its fp32
    output and its running max and sum are read and written back: the (N, N) matrix is
    gone, but the output crosses the bus ``2 * seq / block`` times.
    """
    bh, nd = batch * heads, seq * head_dim
    kv_tiles = math.ceil(seq / block)
    return Traffic({
        "Q, K, V read": bh * (kv_tiles * nd + 2 * nd) * elem_bytes,
        "O written": bh * nd * elem_bytes,
        "O, m, l read and written per K/V tile (fp32)": bh * kv_tiles * 2 * seq * (head_dim + 2) * 4,
    })


# What the kernels do with each (Q tile, K/V tile) pair; see :func:`tile_schedule`.
SKIPPED, MASKED, UNMASKED = 0, 1, 2


def tile_schedule(seq: int, block_m: int, block_n: int, *, causal: bool,
                  seq_k: int | None = None) -> list[list[int]]:
    """The FA2 forward's loop bounds, tile by tile: ``plan[i][j]`` for Q tile i, K/V tile j.

    ``seq`` queries against ``seq_k`` keys (default ``seq``). Mirrors
    :func:`labkit.attention.kernels.fa2_forward_kernel` (its ``_kv_stages``): causal
    programs run the unmasked loop over the whole key tiles their first query sees, the
    masked loop over the diagonal tiles, and never reach the tiles above it (the mask is
    aligned to the bottom right); otherwise every full tile is unmasked and only a ragged
    last tile is masked.
    """
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    seq_k = seq if seq_k is None else seq_k
    if causal and seq_k < seq:
        raise ValueError(f"causal needs at least as many keys as queries, got {seq_k} keys for {seq}")
    shift, full_tiles_end = seq_k - seq, (seq_k // block_n) * block_n
    plan = []
    for start_m in range(0, seq, block_m):
        if causal:
            mask_lo = min((start_m + shift + 1) // block_n * block_n, full_tiles_end)
            hi = min(start_m + block_m + shift, seq_k)
        else:
            mask_lo, hi = full_tiles_end, seq_k
        row = []
        for start_n in range(0, seq_k, block_n):
            row.append(UNMASKED if start_n < mask_lo else MASKED if start_n < hi else SKIPPED)
        plan.append(row)
    return plan
