"""Hidden tests of memory-transpose: thin shapes, strided inputs, dtypes, speed."""

import torch

from labkit import check
from labkit.grade.harness import Randn, poisoned, require_gpu


def _expect_transpose(submission, x, name):
    y = submission.call("transpose", x, poisoned((x.shape[1], x.shape[0]), x.dtype))
    submission.expect_close(y, x.double().T, dtype=x.dtype, name=name)


def test_single_row_and_single_column(submission):
    """1 x 70 and 70 x 1: one of the two masks does all the work."""
    _expect_transpose(submission, check.randn(1, 70, seed=10), "transpose(1 x 70)")
    _expect_transpose(submission, check.randn(70, 1, seed=11), "transpose(70 x 1)")


def test_tall_and_wide(submission):
    """33 x 97 and 97 x 33: M and N play different roles in the mask."""
    _expect_transpose(submission, check.randn(33, 97, seed=20), "transpose(33 x 97)")
    _expect_transpose(submission, check.randn(97, 33, seed=21), "transpose(97 x 33)")


def test_strided_input(submission):
    """Every other column of a 45 x 80 matrix: x.stride() is (80, 2), not (40, 1)."""
    base = check.randn(45, 80, seed=30)
    _expect_transpose(submission, base[:, ::2], "transpose(x[:, ::2])")


def test_transposed_input(submission):
    """x = base.t(): strides (1, 57), so transposing it must give back base."""
    base = check.randn(57, 33, seed=40)
    _expect_transpose(submission, base.t(), "transpose(base.t())")


def test_other_dtypes(submission):
    """bfloat16 and int32: a transpose moves bits, whatever they mean."""
    _expect_transpose(submission, check.randn(40, 19, dtype=torch.bfloat16, seed=50), "transpose(bf16)")
    ints = torch.randint(-1000, 1000, (23, 41), generator=torch.Generator().manual_seed(51), dtype=torch.int32)
    y = submission.call("transpose", ints, poisoned((41, 23), torch.int32))
    if not (isinstance(y, torch.Tensor) and y.shape == (41, 23) and torch.equal(y, ints.T)):
        raise AssertionError("transpose(int32 23 x 41): the result is not exactly x.T")


def test_allocates_its_output(submission):
    """Without out, transpose returns a new contiguous (N, M) tensor."""
    x = check.randn(21, 34, seed=60)
    y = submission.call("transpose", x)
    submission.expect_close(y, x.double().T, dtype=torch.float32, name="transpose(x)")


def test_bandwidth(submission, credit):
    """On a GPU: full points at 70% of the measured copy bandwidth, pro rata below."""
    require_gpu()
    m = n = 2**14  # 1 GiB of float32 each way
    sets = [[Randn((m, n), seed=s)] for s in range(2)]
    result = submission.measure("transpose", lambda x: x.t().contiguous(), sets, bytes_moved=2 * 4 * m * n)
    credit.award(result.fraction / 0.7, str(result))
