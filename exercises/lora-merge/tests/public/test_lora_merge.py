"""Public tests of lora-merge: what check() runs in the notebook.

They use a small example worked out by hand and properties that any correct answer has
(no function here computes the answer: it would be the solution). The hidden tests hold
the functions to peft on fresh weights.
"""

import torch

from labkit import check


def test_forward_on_a_small_example(submission):
    """x = [1, 2], W = I, A = [[1, 1], [1, -1]], B = diag(1, 2), alpha = 4, r = 2: y = [7, -2]."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    w = torch.eye(2, dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    out = submission.call("lora_forward", x, w, a, b, 4.0, 2)
    # x W^T = [1, 2]; x A^T = [3, -1]; (x A^T) B^T = [3, -2]; s = 4 / 2 = 2, so [6, -4]
    submission.expect_close(out, torch.tensor([[7.0, -2.0]], dtype=torch.float64), dtype=torch.float64,
                            tol=1e-12, name="lora_forward on the small example")


def test_zero_b_is_the_base_layer(submission):
    """With B = 0 (how LoRA starts) the layer is exactly the base layer, bias included."""
    x, w = check.randn(5, 3, 19, seed=1), check.randn(11, 19, seed=2)
    a, bias = check.randn(4, 19, seed=3), check.randn(11, seed=4)
    out = submission.call("lora_forward", x, w, a, torch.zeros(11, 4), 8.0, 4, bias)
    submission.expect_close(out, (x.double() @ w.double().T + bias.double()), dtype=torch.float32,
                            name="lora_forward with B = 0")


def test_merge_then_unmerge_round_trip(submission):
    """The merged weight gives the two-path forward's outputs; unmerging gives W back."""
    x, w = check.randn(7, 23, seed=5), check.randn(13, 23, seed=6)
    a, b = check.randn(5, 23, seed=7), check.randn(13, 5, seed=8)
    merged = submission.call("merge", w, a, b, 10.0, 5)
    forward = submission.call("lora_forward", x, w, a, b, 10.0, 5)
    assert isinstance(merged, torch.Tensor) and merged.shape == w.shape, \
        f"merge must return a tensor shaped like the weight {tuple(w.shape)}, got {getattr(merged, 'shape', merged)}"
    assert check.rel_error(merged, w) > 1e-3, "merge returned the base weight unchanged: it must add s B A"
    submission.expect_close(forward, x.double() @ merged.double().T, dtype=torch.float32,
                            name="lora_forward against x @ merge(...)^T")
    back = submission.call("unmerge", merged, a, b, 10.0, 5)
    submission.expect_close(back, w.double(), dtype=torch.float32, name="unmerge(merge(W))")
