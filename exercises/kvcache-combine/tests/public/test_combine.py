"""Public tests of kvcache-combine: what check() runs in the notebook."""

import torch

from labkit.grade.harness import poisoned


def inputs(rows, splits, d, *, lse_scale=3.0, lse_shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o_parts = torch.randn(rows, splits, d, generator=gen)
    lses = torch.randn(rows, splits, generator=gen) * lse_scale + lse_shift
    return o_parts, lses


def expected(o_parts, lses):
    """The exact merge, in float64: sum_s exp(lse_s) o_s / sum_s exp(lse_s)."""
    lse = lses.double()
    w = torch.exp(lse - lse.max(dim=1, keepdim=True).values)
    return (w[:, :, None] * o_parts.double()).sum(1) / w.sum(1, keepdim=True)


def expect_combine(submission, o_parts, lses, name):
    out = submission.call("combine_splits", o_parts, lses, poisoned((o_parts.shape[0], o_parts.shape[2])))
    submission.expect_close(out, expected(o_parts, lses), dtype=torch.float32, name=name)


def test_equal_weights_give_the_mean(submission):
    """Every split with the same log-sum-exp: the result is the plain mean of the splits."""
    o_parts, _ = inputs(4, 4, 32, seed=1)
    expect_combine(submission, o_parts, torch.full((4, 4), 0.7), "4 equal splits")


def test_splits_are_weighted_by_their_lse(submission):
    """Random log-sum-exps: each split counts in proportion to exp(lse_s)."""
    o_parts, lses = inputs(6, 4, 32, seed=2)
    expect_combine(submission, o_parts, lses, "6 rows of 4 weighted splits")


def test_large_lse_does_not_overflow(submission):
    """Log-sum-exps near 1000: exp(lse) overflows float32 unless the maximum is taken out first."""
    o_parts, lses = inputs(3, 4, 16, lse_shift=1000.0, seed=3)
    expect_combine(submission, o_parts, lses, "lse near 1000")
