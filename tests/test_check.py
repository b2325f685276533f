import math

import pytest
import torch
from labkit import check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rounding_to_dtype_passes_its_tolerance(dtype):
    ref = check.randn(37, 129, dtype=torch.float64, seed=3)
    out = ref.to(dtype)
    report = check.assert_close(out, ref)
    assert report.passed and report.rel_error <= check.tolerance(dtype)


def test_rel_error_is_the_norm_ratio():
    ref = torch.tensor([3.0, 4.0])
    out = torch.tensor([3.0, 4.5])
    assert check.rel_error(out, ref) == pytest.approx(0.5 / 5.0)


def test_nan_never_passes_and_is_explained():
    ref = check.randn(5, 7, seed=1)
    out = ref.clone()
    out[2, 3] = float("nan")
    assert check.rel_error(out, ref) == math.inf
    with pytest.raises(check.CheckFailed, match="1 NaN and 0 inf of 35 elements"):
        check.assert_close(out, ref)


def test_failure_names_worst_element():
    ref = check.randn(4, 6, seed=2)
    out = ref.clone()
    out[1, 4] += 10.0
    with pytest.raises(check.CheckFailed) as info:
        check.assert_close(out, ref, name="softmax")
    message = str(info.value)
    assert "softmax: FAILED" in message
    assert "(1, 4)" in message.splitlines()[3]  # first row after the header


def test_shape_mismatch_and_non_tensor():
    ref = check.randn(3, 4)
    with pytest.raises(check.CheckFailed, match=r"expected shape \(3, 4\), got \(4, 3\)"):
        check.assert_close(ref.T.contiguous(), ref)
    with pytest.raises(check.CheckFailed, match="expected a tensor, got list"):
        check.assert_close([1, 2], ref)
    with pytest.raises(ValueError, match="out has shape"):
        check.rel_error(ref[:2], ref)


def test_zero_reference():
    z = torch.zeros(3)
    assert check.rel_error(z, z) == 0.0
    assert check.rel_error(z + 1, z) == math.inf


def test_randn_reproducible_fresh_and_validated():
    a = check.randn(8, 8, seed=5)
    assert torch.equal(a, check.randn(8, 8, seed=5))
    assert not torch.equal(a, check.randn(8, 8, seed=6))
    assert (a != 0).all()
    assert check.randn(4, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shape must be positive ints"):
        check.randn(0, 3)


def test_poison_marks_unwritten_elements():
    buf = check.empty_poisoned((2, 3), torch.float32, "cpu")
    assert torch.isnan(buf).all()
    ints = check.poison(torch.zeros(4, dtype=torch.int32))
    assert (ints == torch.iinfo(torch.int32).max).all()
    half_written = buf.clone()
    half_written[0] = 1.0
    with pytest.raises(check.CheckFailed, match="never written"):
        check.assert_close(half_written, torch.ones(2, 3))


def test_tolerance_unknown_dtype():
    with pytest.raises(ValueError, match="no tolerance defined for int32"):
        check.tolerance(torch.int32)
