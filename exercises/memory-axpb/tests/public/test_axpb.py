"""Public tests of memory-axpb: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def expect_axpb(submission, n, a, b, dtype=torch.float32, seed=0):
    """Shared by the hidden tests: axpb on n fresh random numbers against float64."""
    x = check.randn(n, dtype=dtype, seed=seed)
    out = submission.call("axpb", x, a, b, poisoned(x.shape, dtype))
    submission.expect_close(out, a * x.double() + b, dtype=dtype, name=f"axpb(x, {a}, {b}), n={n}")


def test_whole_blocks(submission):
    """n = 1024, a multiple of the block: every program is full."""
    expect_axpb(submission, 1024, 2.5, -1.0)


def test_tail_is_masked(submission):
    """n = 1000: the last program's block sticks out past the end and must be masked."""
    expect_axpb(submission, 1000, 2.5, -1.0, seed=1)
