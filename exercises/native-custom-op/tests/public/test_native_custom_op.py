"""Public tests of native-custom-op: what check() runs in the notebook.

A value worked out by hand, a gradient worked out by hand, and the fake kernel's output
shape. The hidden tests hold the op to float64 at odd shapes in three dtypes, run opcheck,
and compile it.
"""

import math

import torch


def test_forward_on_a_small_example(submission):
    """silu(0) = 0, silu(2) = 2 sigma(2): gate [0, 2] and up [5, 3] give [0, 6 sigma(2)]."""
    out = submission.call("swiglu", torch.tensor([0.0, 2.0], dtype=torch.float64),
                          torch.tensor([5.0, 3.0], dtype=torch.float64))
    sigma2 = 1 / (1 + math.exp(-2.0))
    submission.expect_close(out, torch.tensor([0.0, 6 * sigma2], dtype=torch.float64), dtype=torch.float64,
                            tol=1e-12, name="swiglu([0, 2], [5, 3])")


def test_gradient_on_a_small_example(submission):
    """At gate 0: d/dgate = up * sigma(0) = up / 2 and d/dup = silu(0) = 0. At gate 1 the
    derivative of silu, sigma(1) (1 + 1 - sigma(1)), has both its terms."""
    grads = submission.gradients("swiglu", torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
                                 torch.tensor([2.0, -4.0, 6.0], dtype=torch.float64),
                                 grad_output=torch.ones(3, dtype=torch.float64))
    assert isinstance(grads, list) and len(grads) == 2, "expected gradients for gate and up"
    s1 = 1 / (1 + math.exp(-1.0))
    submission.expect_close(grads[0], torch.tensor([1.0, -2.0, 6 * s1 * (2 - s1)], dtype=torch.float64),
                            dtype=torch.float64, tol=1e-12, name="d gate at gate 0, 0, 1")
    submission.expect_close(grads[1], torch.tensor([0.0, 0.0, s1], dtype=torch.float64), dtype=torch.float64,
                            tol=1e-12, name="d up at gate 0, 0, 1")


def test_fake_output_is_shaped_like_the_output(submission):
    [(shape, dtype, strides, fake)] = submission.fake_outputs("swiglu", torch.randn(4, 6), torch.randn(4, 6))
    assert fake, "under FakeTensorMode the op must return a fake tensor (the fake kernel's output)"
    assert (shape, dtype, strides) == ([4, 6], "float32", [6, 1]), \
        f"fake output: expected shape [4, 6], float32, strides [6, 1]; got {shape}, {dtype}, {strides}"
