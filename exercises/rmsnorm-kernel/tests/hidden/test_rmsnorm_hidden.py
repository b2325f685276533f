"""Hidden tests of rmsnorm-kernel: fresh random rows against float64, at the public shapes
with other values and at new ones; half precision; many rows; wide rows."""

import torch

from labkit import check
from labkit.grade.harness import public_module

forward = public_module(__file__, "test_rmsnorm.py").forward


def reference(x, w, dy, eps):
    """y, dx, dw in float64 by autograd through the formula."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    dx, dw = torch.autograd.grad(y, (x64, w64), dy.double())
    return y.detach(), dx, dw


def expect_all(submission, x, w, dy, eps=1e-6, name=""):
    y, rstd = forward(submission, x, w, eps)
    dx, dw = submission.call("rms_norm_backward", dy, x, w, rstd)
    want_y, want_dx, want_dw = reference(x, w, dy, eps)
    submission.expect_close(y, want_y, dtype=x.dtype, name=f"y {name}")
    submission.expect_close(dx, want_dx, dtype=x.dtype, name=f"dx {name}")
    submission.expect_close(dw, want_dw, dtype=w.dtype, name=f"dw {name}")


def _case(rows, cols, seed, dtype=torch.float32, scale=1.0):
    x = check.randn(rows, cols, seed=seed, scale=scale).to(dtype)
    w = (1 + 0.3 * check.randn(cols, seed=seed + 1)).to(dtype)
    dy = check.randn(rows, cols, seed=seed + 2).to(dtype)
    return x, w, dy


def test_random_rows_at_the_public_shapes(submission):
    """3 x 5 and 9 x 77 again, with fresh values: y, dx and dw against float64."""
    for rows, cols, seed in ((3, 5, 100), (9, 77, 110)):
        expect_all(submission, *_case(rows, cols, seed, scale=2.0), name=f"{rows} x {cols}")


def test_odd_widths(submission):
    """Widths 3, 80 and 1000 (blocks of 4, 128 and 1024)."""
    for rows, cols, seed in ((4, 3, 120), (37, 80, 130), (5, 1000, 140)):
        expect_all(submission, *_case(rows, cols, seed), name=f"{rows} x {cols}")


def test_weight_gradient_sums_every_row(submission):
    """301 rows of 24: dw is the sum of all 301 rows' contributions."""
    expect_all(submission, *_case(301, 24, 150), name="301 rows")


def test_small_rows_need_eps_inside(submission):
    """Random rows near 1e-3 with eps = 1e-5: mean(x^2) and eps are of one size."""
    expect_all(submission, *_case(7, 33, 160, scale=3e-3), eps=1e-5, name="tiny rows")


def test_bfloat16(submission):
    """bf16 inputs, float32 statistics, results rounded once to bf16."""
    expect_all(submission, *_case(16, 2048, 170, dtype=torch.bfloat16, scale=4.0), name="bf16")


def test_float16_statistics_in_float32(submission):
    """float16 values near 300: their squares (9e4) overflow float16 (max 65504), not float32."""
    x, w, dy = _case(6, 96, 180, dtype=torch.float16, scale=50.0)
    expect_all(submission, x + 300.0, w, dy, name="fp16 near 300")
