"""Public tests of softmax-online: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def expect_online_softmax(submission, x, block, name):
    """Shared by the hidden tests: online_softmax(x, block) against float64 torch."""
    y = submission.call("online_softmax", x, block, poisoned(x.shape, x.dtype))
    submission.expect_close(y, torch.softmax(x.double(), dim=-1), dtype=x.dtype, name=name)


def test_several_blocks_per_row(submission):
    """Rows of 300 in blocks of 64: five blocks, the last one partly masked."""
    expect_online_softmax(submission, check.randn(4, 300, seed=0), 64, "online_softmax(4 x 300, block 64)")


def test_large_logits(submission):
    """Logits of magnitude ~100 in blocks of 32: needs the running maximum, rescaled."""
    x = check.randn(3, 200, seed=1, scale=40.0)
    expect_online_softmax(submission, x, 32, "online_softmax(large logits, block 32)")
