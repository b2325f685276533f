"""Hidden tests of kvcache-combine: odd sizes, empty splits, one split, underflow, real attention."""

import math

import torch

from labkit.grade.harness import poisoned


def expect_merge(submission, o_parts, lses, name):
    """The merge's weights are a softmax over the splits' log-sum-exps (float64 here)."""
    weights = torch.softmax(lses.double(), dim=1)
    want = torch.einsum("rs,rsd->rd", weights, o_parts.double())
    out = submission.call("combine_splits", o_parts, lses, poisoned((o_parts.shape[0], o_parts.shape[2])))
    submission.expect_close(out, want, dtype=torch.float32, name=name)


def random_splits(shape, seed, lse_shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    rows, splits, d = shape
    return torch.randn(shape, generator=gen), 3 * torch.randn(rows, splits, generator=gen) + lse_shift


def test_odd_numbers_of_splits_and_head_sizes(submission):
    """5 splits and head size 24, 3 splits and head size 40: neither a power of two."""
    for seed, shape in enumerate(((7, 5, 24), (3, 3, 40))):
        expect_merge(submission, *random_splits(shape, 10 + seed), f"shape {shape}")


def test_empty_splits_have_no_weight(submission):
    """Splits past a sequence's end report lse = -inf (and a zero output): weight zero."""
    o_parts, lses = random_splits((4, 6, 32), 20)
    lses[:, 4:] = -math.inf
    lses[0, 1:] = -math.inf  # one row with a single live split
    o_parts[lses == -math.inf] = 0.0
    expect_merge(submission, o_parts, lses, "trailing empty splits")


def test_one_split_is_returned_as_is(submission):
    """With a single split there is nothing to merge: the output is that split's."""
    expect_merge(submission, *random_splits((5, 1, 32), 30), "one split")


def test_very_negative_lse_does_not_underflow(submission):
    """Log-sum-exps near -1000: exp(lse) is 0 in float32 for every split unless shifted."""
    expect_merge(submission, *random_splits((3, 4, 16), 40, lse_shift=-1000.0), "lse near -1000")


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
