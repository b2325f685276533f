"""Public tests of serve-paged-decode: what check() runs in the notebook.

Expected values gather each sequence's positions through its block table in plain torch
and compute softmax attention in float64.
"""

import math

import torch

from labkit.grade.harness import poisoned


def problem(lengths, block_size, n_heads, n_kv_heads, head_dim, seed, *, dtype=torch.float32, spare_blocks=3,
            padding=-1, q_scale=1.0, nan_unused=False):
    """Queries, a pool whose blocks are dealt to the sequences in a shuffled order, block tables
    (unused entries hold ``padding``) and lengths (int32)."""
    gen = torch.Generator().manual_seed(seed)
    used_blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(used_blocks) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(used_blocks) + 1), padding, dtype=torch.int32)
    for b, count in enumerate(used_blocks):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    k_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    q = q_scale * torch.randn(len(lengths), n_heads, head_dim, generator=gen)
    if nan_unused:
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for b, n in enumerate(lengths):
            for t in range(n):
                used[tables[b, t // block_size], t % block_size] = True
        k_pool[~used] = math.nan
        v_pool[~used] = math.nan
    return q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), tables, torch.tensor(lengths, dtype=torch.int32)


def expected(q, k_pool, v_pool, tables, lengths):
    """Attention of each query over its sequence's positions, gathered through the table: float64 [B, Hq, d]."""
    batch, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(batch, n_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        t = torch.arange(int(lengths[b]))
        blocks = tables[b, t // block_size].long()
        for h in range(n_heads):
            kv = h // (n_heads // n_kv_heads)
            keys = k_pool[blocks, t % block_size, kv].double()
            values = v_pool[blocks, t % block_size, kv].double()
            scores = keys @ q[b, h].double() / math.sqrt(head_dim)
            out[b, h] = scores.softmax(0) @ values
    return out


def expect_attention(submission, q, k_pool, v_pool, tables, lengths, name, dtype=torch.float32):
    out = submission.call("paged_decode", q, k_pool, v_pool, tables, lengths, poisoned(q.shape, q.dtype))
    submission.expect_close(out, expected(q, k_pool, v_pool, tables, lengths), dtype=dtype, name=name)


def test_blocks_as_large_as_the_tile(submission):
    """Blocks of 16 positions (one per tile), lengths 16, 40 and 33, shuffled in the pool."""
    q, k, v, tables, lengths = problem([16, 40, 33], 16, 2, 2, 16, seed=1)
    expect_attention(submission, q, k, v, tables, lengths, "blocks of 16")


def test_several_blocks_per_tile(submission):
    """Blocks of 4: a 16-position tile reads from four blocks that lie anywhere in the pool."""
    q, k, v, tables, lengths = problem([37, 50], 4, 2, 2, 16, seed=2)
    expect_attention(submission, q, k, v, tables, lengths, "blocks of 4")


def test_sequences_read_their_own_tables(submission):
    """Four sequences of the same length whose blocks differ: each must use its own row of the table."""
    q, k, v, tables, lengths = problem([24, 24, 24, 24], 8, 2, 1, 16, seed=3)
    expect_attention(submission, q, k, v, tables, lengths, "four tables")
