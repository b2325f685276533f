"""Hidden tests of kvcache-split-decode: ragged lengths, empty splits, GQA, odd head sizes,
unreadable slots, large scores, fp16 caches."""

import math

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_split.py")


def test_lengths_that_end_inside_a_tile(submission):
    """Lengths 37, 50 and 3 with splits of 16: the last tile of each sequence is partial."""
    q, k, v = pub.problem(3, 2, 2, 16, 64, seed=11)
    pub.expect_partials(submission, q, k, v, torch.tensor([37, 50, 3]), 16, "lengths 37, 50, 3")


def test_splits_past_the_end_are_empty(submission):
    """A 5-position sequence in a 64-slot cache cut into 4 splits: splits 1-3 see nothing,
    so each reports lse = -inf (and a zero output), and weighs nothing in a merge."""
    q, k, v = pub.problem(2, 2, 2, 8, 64, seed=12)
    pub.expect_partials(submission, q, k, v, torch.tensor([5, 64]), 16, "a short and a full sequence")


def test_grouped_query_heads(submission):
    """6 query heads over 2 KV heads: heads 0-2 read KV head 0, heads 3-5 KV head 1."""
    q, k, v = pub.problem(2, 6, 2, 16, 48, seed=13)
    pub.expect_partials(submission, q, k, v, torch.tensor([48, 30]), 16, "GQA 6 over 2")


def test_head_sizes_that_are_not_powers_of_two(submission):
    """Head sizes 24 and 40: the head-dimension block is wider than the head, and masked."""
    for seed, d in ((14, 24), (15, 40)):
        q, k, v = pub.problem(1, 2, 1, d, 32, seed=seed)
        pub.expect_partials(submission, q, k, v, torch.tensor([29]), 16, f"head size {d}")


def test_slots_past_the_length_are_never_read(submission):
    """Every slot past each sequence's length holds NaN: a kernel that loads them unmasked,
    or lets them into the sums, returns NaN."""
    q, k, v = pub.problem(2, 2, 2, 16, 64, seed=16)
    lengths = torch.tensor([21, 40])
    for i, n in enumerate(lengths.tolist()):
        k[i, :, n:], v[i, :, n:] = math.nan, math.nan
    pub.expect_partials(submission, q, k, v, lengths, 16, "NaN past the lengths")


def test_large_scores_do_not_overflow(submission):
    """Queries 100x larger: scores in the hundreds, whose exponentials overflow float32 unless
    the running maximum is subtracted, and whose splits differ by far more than one tile."""
    q, k, v = pub.problem(1, 2, 2, 16, 64, seed=17, q_scale=100.0)
    pub.expect_partials(submission, q, k, v, torch.tensor([64]), 32, "scores in the hundreds")


def test_float16_cache(submission):
    """q and the cache in float16, partial results in float32."""
    q, k, v = pub.problem(2, 4, 2, 32, 48, seed=18, dtype=torch.float16)
    pub.expect_partials(submission, q, k, v, torch.tensor([48, 17]), 16, "float16")
