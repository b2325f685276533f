"""Hidden tests of kvcache-combine: odd sizes, empty splits, one split, underflow, real attention."""

import math

import torch

from labkit.grade.harness import poisoned


def inputs(rows, splits, d, *, lse_scale=3.0, lse_shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o_parts = torch.randn(rows, splits, d, generator=gen)
    lses = torch.randn(rows, splits, generator=gen) * lse_scale + lse_shift
    return o_parts, lses


def expected(o_parts, lses):
    lse = lses.double()
    w = torch.exp(lse - lse.max(dim=1, keepdim=True).values)
    return (w[:, :, None] * o_parts.double()).sum(1) / w.sum(1, keepdim=True)


def expect_combine(submission, o_parts, lses, name):
    out = submission.call("combine_splits", o_parts, lses, poisoned((o_parts.shape[0], o_parts.shape[2])))
    submission.expect_close(out, expected(o_parts, lses), dtype=torch.float32, name=name)


def test_odd_numbers_of_splits_and_head_sizes(submission):
    """5 splits and head size 24, 3 splits and head size 40: neither a power of two."""
    for seed, (rows, splits, d) in enumerate(((7, 5, 24), (3, 3, 40))):
        o_parts, lses = inputs(rows, splits, d, seed=10 + seed)
        expect_combine(submission, o_parts, lses, f"{rows} rows, {splits} splits, d={d}")


def test_empty_splits_have_no_weight(submission):
    """Splits past a sequence's end report lse = -inf (and a zero output): weight zero."""
    o_parts, lses = inputs(4, 6, 32, seed=20)
    lses[:, 4:] = -math.inf
    lses[0, 1:] = -math.inf  # one row with a single live split
    o_parts[lses == -math.inf] = 0.0
    expect_combine(submission, o_parts, lses, "trailing empty splits")


def test_one_split_is_returned_as_is(submission):
    """With a single split there is nothing to merge: the output is that split's."""
    o_parts, lses = inputs(5, 1, 32, seed=30)
    expect_combine(submission, o_parts, lses, "one split")


def test_very_negative_lse_does_not_underflow(submission):
    """Log-sum-exps near -1000: exp(lse) is 0 in float32 for every split unless shifted."""
    o_parts, lses = inputs(3, 4, 16, lse_shift=-1000.0, seed=40)
    expect_combine(submission, o_parts, lses, "lse near -1000")


def test_merges_real_split_attention_exactly(submission):
    """Partial results of real attention over 4 splits of 50 keys merge into full attention."""
    gen = torch.Generator().manual_seed(50)
    q = torch.randn(2, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 200, 32, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(2, 200, 32, generator=gen, dtype=torch.float64)
    scores = torch.einsum("rd,rnd->rn", q, k) / math.sqrt(32)
    full = torch.einsum("rn,rnd->rd", scores.softmax(-1), v)
    chunks = scores.view(2, 4, 50)
    lses = torch.logsumexp(chunks, -1)
    o_parts = torch.einsum("rsn,rsnd->rsd", torch.exp(chunks - lses[..., None]), v.view(2, 4, 50, 32))
    out = submission.call("combine_splits", o_parts.float(), lses.float(), poisoned((2, 32)))
    submission.expect_close(out, full, dtype=torch.float32, name="merged split attention")
