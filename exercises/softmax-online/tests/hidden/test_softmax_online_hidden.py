"""Hidden tests of softmax-online: a late maximum, dtypes, strides, edge widths, speed."""

import torch

from labkit import check
from labkit.grade.harness import Randn, public_module, require_gpu

expect_online_softmax = public_module(__file__, "test_softmax_online.py").expect_online_softmax


def test_maximum_in_the_last_block(submission):
    """The row maximum sits in the last block: every earlier partial sum must be rescaled."""
    x = check.randn(5, 250, seed=10)
    x[:, -3] = 60.0 + torch.arange(5.0)
    expect_online_softmax(submission, x, 32, "online_softmax(late maximum)")


def test_row_shorter_than_a_block_and_exact_multiples(submission):
    """Widths 1, 20 (in one block of 64) and 256 (exactly four blocks of 64)."""
    for seed, n in enumerate((1, 20, 256)):
        expect_online_softmax(submission, check.randn(3, n, seed=20 + seed), 64, f"online_softmax(3 x {n})")


def test_half_precision(submission):
    """float16 and bfloat16, computed in float32, stored in the input's dtype."""
    for seed, dtype in enumerate((torch.float16, torch.bfloat16)):
        x = check.randn(4, 190, dtype=dtype, seed=30 + seed, scale=5.0)
        expect_online_softmax(submission, x, 64, f"online_softmax({dtype})")


def test_strided_rows(submission):
    """The first 150 columns of a 4 x 200 matrix: rows are 200 apart, not 150."""
    expect_online_softmax(submission, check.randn(4, 200, seed=40)[:, :150], 64, "online_softmax(x[:, :150])")


def test_minus_infinity_entries(submission):
    """Masked logits (-inf) scattered through the row get probability 0."""
    x = check.randn(4, 160, seed=50)
    x[:, 1::4] = float("-inf")
    expect_online_softmax(submission, x, 32, "online_softmax(with -inf)")


def test_bandwidth(submission, credit):
    """On a GPU: full points at 70% of the copy bandwidth (one read and one write of x)."""
    require_gpu()
    rows, cols = 4096, 65536  # 1 GiB of float32; each row (256 KiB) is read twice
    sets = [[Randn((rows, cols), seed=s), 4096] for s in range(2)]
    result = submission.measure("online_softmax", lambda x, block: torch.softmax(x, -1), sets,
                                bytes_moved=2 * 4 * rows * cols)
    credit.award(result.fraction / 0.7, str(result))
