"""Public tests of rmsnorm-kernel: what check() runs in the notebook.

They check fixed inputs against answers worked out in advance (stored below, float64) and
two properties every correct RMSNorm has; the grader's hidden tests compare fresh random
inputs against a float64 reference."""

import torch

from labkit import check

# Three rows of five (the block is 8: three lanes of every row are masked), a weight, and an
# upstream gradient; eps = 1e-6. The last row is constant, so its normalised value is 1.
X = [[3.0, 4.0, 0.0, -1.0, 2.0], [0.5, -0.25, 1.0, 2.0, -3.0], [10.0, 10.0, 10.0, 10.0, 10.0]]
W = [0.5, 1.0, 1.5, 2.0, -1.0]
DY = [[1.0, -1.0, 0.5, 0.0, 2.0], [0.25, 0.5, -1.0, 1.0, 1.0], [-2.0, 1.0, 0.0, 1.0, 0.5]]
Y = [[0.6123723846647645, 1.6329930257727054, 0.0, -0.8164965128863527, -0.8164965128863527],
     [0.14776350533116842, -0.14776350533116842, 0.8865810319870104, 2.3642160852986946, 1.7731620639740209],
     [0.49999999749999996, 0.9999999949999999, 1.4999999924999998, 1.9999999899999998, -0.9999999949999999]]
DX = [[0.4694854506827657, -0.054433159828273014, 0.30618619233238226, -0.08845377415372584, -0.639588964578901],
      [-0.03839266194432907, 0.35166421796729347, -1.111129861206837, 0.7330103842096942, 0.08259246633480599],
      [-0.12999999904999998, 0.06999999995, -0.029999999549999996, 0.16999999945, -0.07999999929999999]]
DW = [-0.7013734680048866, -0.7068747834382897, -0.5910540213246737, 2.182108037649347, 0.3598309592986845]
# Rows whose mean square (1e-5 and below) is comparable to eps = 1e-5, weight 1.
TINY_X = [[1e-3, -2e-3, 2e-3], [0.0, 3e-3, -4e-3]]
TINY_Y = [[0.2773500981126146, -0.5547001962252291, 0.5547001962252291], [0.0, 0.7006490497453708, -0.9341987329938277]]


def tensor(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def forward(submission, x, w, eps=1e-6):
    y, rstd = submission.call("rms_norm_forward", x, w, eps)
    return y, rstd


def test_forward_fixed_rows(submission):
    """Three rows of 5 (a block of 8): y = w * x / sqrt(mean(x^2) + eps), the mean over the 5 real values."""
    y, rstd = forward(submission, tensor(X), tensor(W))
    submission.expect_close(y, tensor(Y, torch.float64), dtype=torch.float32, name="y")
    assert rstd.shape == (3,) and rstd.dtype == torch.float32, (
        f"rstd must be float32 of shape (3,), got {rstd.dtype} {tuple(rstd.shape)}")


def test_eps_inside_the_root(submission):
    """Rows of values near 1e-3 with eps = 1e-5: eps belongs under the square root, 1/sqrt(mean + eps)."""
    y, _ = forward(submission, tensor(TINY_X), torch.ones(3), eps=1e-5)
    submission.expect_close(y, tensor(TINY_Y, torch.float64), dtype=torch.float32, name="y of tiny rows")


def test_backward_fixed_rows(submission):
    """The same three rows: dx (both terms of the gradient) and dw (summed over all three rows)."""
    x, w = tensor(X), tensor(W)
    _, rstd = forward(submission, x, w)
    dx, dw = submission.call("rms_norm_backward", tensor(DY), x, w, rstd)
    submission.expect_close(dx, tensor(DX, torch.float64), dtype=torch.float32, name="dx")
    submission.expect_close(dw, tensor(DW, torch.float64), dtype=torch.float32, name="dw")


def test_unit_mean_square(submission):
    """With a weight of ones, every output row has mean square 1 (to within eps)."""
    x = check.randn(9, 77, seed=3, scale=5.0)
    y, _ = forward(submission, x, torch.ones(77))
    mean_square = y.double().pow(2).mean(-1)
    worst = (mean_square - 1).abs().max().item()
    assert worst < 1e-4, f"mean(y^2) per row should be 1; the worst row is off by {worst:.3g}: {mean_square.tolist()}"


def test_gradient_is_orthogonal_to_x(submission):
    """y(c x) = y(x) for any c > 0, so sum(x * dx) = 0 in every row: the gradient has no part along x."""
    x, w = check.randn(9, 77, seed=4, scale=2.0), 1 + 0.3 * check.randn(77, seed=5)
    _, rstd = forward(submission, x, w)
    dx, _ = submission.call("rms_norm_backward", check.randn(9, 77, seed=6), x, w, rstd)
    along_x = (x.double() * dx.double()).sum(-1) / (x.double().norm(dim=-1) * dx.double().norm(dim=-1))
    worst = along_x.abs().max().item()
    assert worst < 1e-5, (f"dx must be orthogonal to x row by row (the gradient through rstd cancels the part "
                          f"along x); the worst row has cos(x, dx) = {worst:.3g}")
