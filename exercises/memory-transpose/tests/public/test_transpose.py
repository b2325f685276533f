"""Public tests of memory-transpose: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def test_square_whole_tiles(submission):
    """64 x 64 float32: every tile lies inside the matrix."""
    x = check.randn(64, 64, seed=0)
    y = submission.call("transpose", x, poisoned((64, 64)))
    submission.expect_close(y, x.double().T, dtype=torch.float32, name="transpose(64 x 64)")


def test_ragged_rectangle(submission):
    """37 x 50: the tiles on the bottom and right edges hang off the matrix."""
    x = check.randn(37, 50, seed=1)
    y = submission.call("transpose", x, poisoned((50, 37)))
    submission.expect_close(y, x.double().T, dtype=torch.float32, name="transpose(37 x 50)")
