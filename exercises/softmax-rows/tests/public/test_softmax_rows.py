"""Public tests of softmax-rows: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def expect_softmax(submission, x, name):
    """Shared by the hidden tests: softmax of x against float64 torch."""
    y = submission.call("softmax", x, poisoned(x.shape, x.dtype))
    submission.expect_close(y, torch.softmax(x.double(), dim=-1), dtype=x.dtype, name=name)


def test_small_rows(submission):
    """7 rows of 33: the block (64) is wider than the row, so the padding must not count."""
    expect_softmax(submission, check.randn(7, 33, seed=0), "softmax(7 x 33)")


def test_large_logits(submission):
    """Logits around 100 (e^100 overflows float32): the row maximum must be subtracted."""
    expect_softmax(submission, check.randn(5, 100, seed=1, scale=30.0) + 100.0, "softmax(large logits)")
