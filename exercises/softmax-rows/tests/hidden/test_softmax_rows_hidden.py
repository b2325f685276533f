"""Hidden tests of softmax-rows: wide rows, dtypes, strides, -inf entries, speed."""

import torch

from labkit import check
from labkit.grade.harness import Randn, public_module, require_gpu

expect_softmax = public_module(__file__, "test_softmax_rows.py").expect_softmax


def test_wide_rows(submission):
    """3 rows of 1500 (a 2048-wide block) and 4 rows of 1."""
    expect_softmax(submission, check.randn(3, 1500, seed=10), "softmax(3 x 1500)")
    expect_softmax(submission, check.randn(4, 1, seed=11), "softmax(4 x 1)")


def test_half_precision(submission):
    """float16 and bfloat16 inputs, computed in float32, stored in the input's dtype."""
    for seed, dtype in enumerate((torch.float16, torch.bfloat16)):
        expect_softmax(submission, check.randn(9, 200, dtype=dtype, seed=20 + seed), f"softmax({dtype})")


def test_strided_rows(submission):
    """The first 77 columns of a 6 x 100 matrix: rows are 100 apart, not 77."""
    expect_softmax(submission, check.randn(6, 100, seed=30)[:, :77], "softmax(x[:, :77])")


def test_minus_infinity_entries(submission):
    """Masked logits (-inf) get probability exactly 0; the rest still sum to one."""
    x = check.randn(8, 50, seed=40)
    x[:, ::3] = float("-inf")
    expect_softmax(submission, x, "softmax(with -inf)")


def test_allocates_its_output(submission):
    """Without out, softmax returns a new tensor of x's shape and dtype."""
    x = check.randn(5, 60, seed=50)
    y = submission.call("softmax", x)
    submission.expect_close(y, torch.softmax(x.double(), -1), dtype=torch.float32, name="softmax(x)")


def test_bandwidth(submission, credit):
    """On a GPU: full points at 80% of the measured copy bandwidth, pro rata below."""
    require_gpu()
    rows, cols = 16384, 8192  # 512 MiB of float32: read once, written once
    sets = [[Randn((rows, cols), seed=s)] for s in range(2)]
    result = submission.measure("softmax", lambda x: torch.softmax(x, -1), sets, bytes_moved=2 * 4 * rows * cols)
    credit.award(result.fraction / 0.8, str(result))
