"""Hidden tests of memory-axpb: other lengths, dtypes, scalars, allocation, and speed."""

import torch

from labkit import check
from labkit.grade.harness import Randn, public_module, require_gpu


expect_axpb = public_module(__file__, "test_axpb.py").expect_axpb


def test_shorter_than_one_block(submission):
    """n = 1 and n = 37: a single program, mostly masked off."""
    for seed, n in enumerate((1, 37)):
        expect_axpb(submission, n, -0.75, 0.5, seed=10 + seed)


def test_odd_lengths(submission):
    """n = 255, 257 and 3001: one short of, one past, and far from a block boundary."""
    for seed, n in enumerate((255, 257, 3001)):
        expect_axpb(submission, n, 1.5, 2.0, seed=20 + seed)


def test_half_precision(submission):
    """float16 and bfloat16 inputs, computed in float32, stored in the input's dtype."""
    for seed, dtype in enumerate((torch.float16, torch.bfloat16)):
        expect_axpb(submission, 777, 3.0, -2.0, dtype=dtype, seed=30 + seed)


def test_scalars_are_not_swapped(submission):
    """a = 0 (y = b everywhere) and b = 0 (y = a x): catches a and b in the wrong places."""
    expect_axpb(submission, 300, 0.0, 3.0, seed=40)
    expect_axpb(submission, 300, -1.5, 0.0, seed=41)


def test_allocates_its_output(submission):
    """Without out, axpb returns a new tensor of x's shape and dtype."""
    x = check.randn(513, seed=50)
    y = submission.call("axpb", x, 2.0, 1.0)
    submission.expect_close(y, 2.0 * x.double() + 1.0, dtype=torch.float32, name="axpb(x, 2, 1)")


def test_bandwidth(submission, credit):
    """On a GPU: full points at 80% of the measured copy bandwidth, pro rata below."""
    require_gpu()
    n = 2**28  # 1 GiB of float32 in, 1 GiB out: far beyond the L2
    sets = [[Randn((n,), seed=s), 2.5, -1.0] for s in range(2)]
    result = submission.measure("axpb", lambda x, a, b: a * x + b, sets, bytes_moved=2 * 4 * n)
    credit.award(result.fraction / 0.8, str(result))
