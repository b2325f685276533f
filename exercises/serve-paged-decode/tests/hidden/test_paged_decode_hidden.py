"""Hidden tests of serve-paged-decode: odd block sizes, blocks larger than the tile, NaN in
unused slots and -1 padding, GQA, odd head sizes, one-token sequences, large scores, float16."""

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_paged_decode.py")


def test_odd_block_sizes(submission):
    """Blocks of 5 and of 3: tiles straddle block boundaries at positions that vary from tile to tile."""
    for seed, block_size in ((11, 5), (12, 3)):
        q, k, v, tables, lengths = pub.problem([37, 22, 9], block_size, 2, 2, 16, seed=seed)
        pub.expect_attention(submission, q, k, v, tables, lengths, f"blocks of {block_size}")


def test_blocks_larger_than_the_tile(submission):
    """Blocks of 32 and 48: several tiles in one block, the last one partial."""
    for seed, block_size in ((13, 32), (14, 48)):
        q, k, v, tables, lengths = pub.problem([70, 33], block_size, 2, 2, 16, seed=seed)
        pub.expect_attention(submission, q, k, v, tables, lengths, f"blocks of {block_size}")


def test_unused_slots_are_never_read(submission):
    """NaN in every slot no sequence uses (the unfilled end of each last block, the spare
    blocks) and -1 in the table past each sequence's blocks."""
    q, k, v, tables, lengths = pub.problem([21, 42, 7], 8, 2, 2, 16, seed=15, nan_unused=True)
    pub.expect_attention(submission, q, k, v, tables, lengths, "NaN in unused slots")


def test_grouped_query_heads(submission):
    """6 query heads over 2 KV heads: heads 0-2 read KV head 0, heads 3-5 KV head 1."""
    q, k, v, tables, lengths = pub.problem([30, 17], 8, 6, 2, 16, seed=16)
    pub.expect_attention(submission, q, k, v, tables, lengths, "GQA 6 over 2")


def test_head_sizes_that_are_not_powers_of_two(submission):
    """Head sizes 24 and 40: the head-dimension block is wider than the head, and masked."""
    for seed, d in ((17, 24), (18, 40)):
        q, k, v, tables, lengths = pub.problem([29, 12], 8, 2, 1, d, seed=seed)
        pub.expect_attention(submission, q, k, v, tables, lengths, f"head size {d}")


def test_one_token_sequences(submission):
    """Sequences of a single position: the answer is that position's value."""
    q, k, v, tables, lengths = pub.problem([1, 1, 17], 4, 2, 2, 16, seed=19, nan_unused=True)
    pub.expect_attention(submission, q, k, v, tables, lengths, "one-token sequences")


def test_large_scores_do_not_overflow(submission):
    """Queries 100x larger: scores in the hundreds, whose exponentials overflow float32 unless
    the running maximum is subtracted."""
    q, k, v, tables, lengths = pub.problem([64, 40], 8, 2, 2, 16, seed=20, q_scale=100.0)
    pub.expect_attention(submission, q, k, v, tables, lengths, "scores in the hundreds")


def test_float16_pool(submission):
    """q and the pool in float16, the output in float16."""
    q, k, v, tables, lengths = pub.problem([48, 17], 8, 4, 2, 32, seed=21, dtype=torch.float16)
    pub.expect_attention(submission, q, k, v, tables, lengths, "float16", dtype=torch.float16)
