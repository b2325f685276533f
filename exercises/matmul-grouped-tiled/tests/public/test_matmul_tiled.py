"""Public tests of matmul-grouped-tiled: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def expect_matmul(submission, a, b, name):
    """Run matmul(a, b) into a NaN-poisoned output and compare with float64."""
    c = submission.call("matmul", a, b, poisoned((a.shape[0], b.shape[1]), a.dtype))
    submission.expect_close(c, a.double() @ b.double(), dtype=a.dtype, name=name)


def test_square_whole_tiles(submission):
    """64 x 64 x 64 float32: every tile lies inside the matrices."""
    expect_matmul(submission, check.randn(64, 64, seed=0), check.randn(64, 64, seed=1), "matmul(64x64, 64x64)")


def test_ragged_shapes(submission):
    """37 x 50 times 50 x 29: tiles hang off the bottom, the right, and the end of K."""
    expect_matmul(submission, check.randn(37, 50, seed=2), check.randn(50, 29, seed=3), "matmul(37x50, 50x29)")
