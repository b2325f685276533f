import pytest
import torch
from labkit import validate


def test_accepts_a_good_tensor():
    x = torch.ones(2, 3)
    assert validate.check_tensor(x, "x", ndim=2, dtypes=[torch.float32], device="cpu", contiguous=True) is x


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        ([1, 2], {}, TypeError, "x must be a torch.Tensor, got list"),
        (torch.ones(2), {"ndim": 2}, ValueError, r"x must have 2 dimensions, got shape \(2,\)"),
        (torch.ones(2, 2), {"ndim": (1, 3)}, ValueError, "must have 1 or 3 dimensions"),
        (torch.ones(2, dtype=torch.int32), {"dtypes": [torch.float32, torch.bfloat16]}, TypeError,
         r"dtype in \(float32, bfloat16\), got int32"),
        (torch.ones(2), {"device": "cuda"}, ValueError, "x must be on cuda, got a tensor on cpu"),
        (torch.ones(3, 4).T, {"contiguous": True}, ValueError, r"must be contiguous .* strides \(1, 4\)"),
        (torch.ones(0, 3), {}, ValueError, r"must not be empty, got shape \(0, 3\)"),
    ],
)
def test_rejects_with_a_clear_error(value, kwargs, error, message):
    with pytest.raises(error, match=message):
        validate.check_tensor(value, "x", **kwargs)


def test_same_shape_device_and_ints():
    with pytest.raises(ValueError, match=r"same shape, got a \(2,\), b \(3,\)"):
        validate.check_same_shape(a=torch.ones(2), b=torch.ones(3))
    validate.check_same_device(a=torch.ones(1), b=torch.ones(1))
    with pytest.raises(TypeError, match="block must be an int, got float"):
        validate.check_positive_int(2.0, "block")
    with pytest.raises(TypeError):
        validate.check_positive_int(True, "block")
    with pytest.raises(ValueError, match="must be positive, got 0"):
        validate.check_positive_int(0, "block")
    with pytest.raises(ValueError, match="power of two"):
        validate.check_power_of_two(48, "BLOCK")
    assert validate.check_power_of_two(64, "BLOCK") == 64
    with pytest.raises(ValueError, match=r"one of \('a', 'b'\)"):
        validate.check_choice("c", "variant", ["a", "b"])
