"""Hidden tests of attention-fa2-forward: lengths, head sizes, dtypes, scores, scales."""

import torch

from labkit.grade.harness import public_module

_public = public_module(__file__, "test_fa2_forward.py")
expected, expect_attention = _public.expected, _public.expect_attention


def test_ragged_lengths_full(submission):
    """N = 1, 17 and 100 without a mask: the last key tile sticks out past the end."""
    for seed, n in enumerate((1, 17, 100)):
        expect_attention(submission, 2, n, 16, causal=False, seed=10 + seed)


def test_ragged_lengths_causal(submission):
    """N = 1, 33 and 130, causal: diagonal tiles masked, partial last Q tile."""
    for seed, n in enumerate((1, 33, 130)):
        expect_attention(submission, 1, n, 16, causal=True, seed=20 + seed)


def test_first_key_tile_of_a_causal_row(submission):
    """N = 20, causal: row 0 sees key 0 only, rows 16-19 see one key of the second tile."""
    expect_attention(submission, 1, 20, 32, causal=True, seed=30)


def test_head_size_64_and_bf16(submission):
    """d = 64 in float16 and bfloat16, both masks."""
    for seed, (dtype, causal) in enumerate([(torch.float16, True), (torch.bfloat16, False), (torch.bfloat16, True)]):
        expect_attention(submission, 1, 50, 64, causal=causal, dtype=dtype, seed=40 + seed)


def test_large_scores_do_not_overflow(submission):
    """Queries scaled by 30: scores in the hundreds; exp of them overflows without the max."""
    expect_attention(submission, 1, 40, 32, causal=False, q_scale=30.0, seed=50)
    expect_attention(submission, 1, 40, 32, causal=True, q_scale=30.0, seed=51)


def test_custom_scale(submission):
    """scale = 0.5 and 0.02 instead of 1/sqrt(d)."""
    for seed, scale in enumerate((0.5, 0.02)):
        expect_attention(submission, 2, 37, 16, causal=seed == 1, scale=scale, seed=60 + seed)
