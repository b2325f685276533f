"""Hidden tests of rope-kernel: fresh random inputs against float64 at more shapes, the
convention spelled out, a head_dim whose half is not a power of two, the adjoint identity
of the backward, many tokens and bf16."""

import torch

from labkit import check
from labkit.grade.harness import public_module

_public = public_module(__file__, "test_rope.py")
angles, rotate_half_reference = _public.angles, _public.rotate_half_reference


def expect_rope(submission, x, cos, sin, dtype=torch.float32, name=""):
    y = submission.call("rope_forward", x, cos, sin)
    submission.expect_close(y, rotate_half_reference(x, cos, sin), dtype=dtype, name=f"y {name}")


def test_random_against_float64(submission):
    """Random [T, H, D] at (7, 3, 8), (37, 4, 16) and (5, 2, 128, base 1e6 as Qwen3's)."""
    for (tokens, heads, d, base), seed in (((7, 3, 8, 1e4), 10), ((37, 4, 16, 1e4), 11), ((5, 2, 128, 1e6), 12)):
        x = check.randn(tokens, heads, d, seed=seed)
        expect_rope(submission, x, *angles(tokens, d, base, first_position=3), name=f"{tokens}x{heads}x{d}")


def test_rotate_half_pairs_not_neighbours(submission):
    """x = e_0 at position 1 (head_dim 8): rotate-half moves it into coordinate 4 (= 0 + d/2), not 1."""
    x = torch.zeros(2, 1, 8)
    x[1, 0, 0] = 1.0
    cos, sin = angles(2, 8)
    y = submission.call("rope_forward", x, cos, sin)[1, 0].double()
    assert abs(y[4].item() - sin[1, 0].item()) < 1e-5 and abs(y[1].item()) < 1e-5, (
        f"coordinate 0 pairs with coordinate 4 (x[i] with x[i + d/2], HF's rotate_half), so y should be "
        f"cos(1) at 0 and sin(1) = {sin[1, 0].item():.4f} at 4; got {[round(v, 4) for v in y.tolist()]} "
        f"(a sin at coordinate 1 is the interleaved layout, pairs (x[2i], x[2i+1]))")
    expect_rope(submission, check.randn(4, 2, 8, seed=13), *angles(4, 8), name="random, head_dim 8")


def test_head_dim_not_a_power_of_two(submission):
    """head_dim 24: a half of 12 values in a block of 16; the 4 padding lanes must load and store nothing."""
    x = check.randn(9, 3, 24, seed=20)
    expect_rope(submission, x, *angles(9, 24), name="head_dim 24")


def test_heads_share_their_token_angle(submission):
    """The same vector in all 5 heads of a token: every head turns by its token's angle, so all 5 agree."""
    x = check.randn(6, 1, 16, seed=30).expand(6, 5, 16).contiguous()
    cos, sin = angles(6, 16)
    y = submission.call("rope_forward", x, cos, sin).double()
    spread = (y - y[:, :1]).abs().max().item()
    assert spread < 1e-5, f"the heads of a token must rotate alike (the angle is the token's); they differ by {spread:.3g}"
    expect_rope(submission, x, cos, sin, name="5 equal heads")


def test_backward_is_the_transpose(submission):
    """<R x, g> = <x, R^T g> for random x and g: rope_backward is the forward's adjoint, its gradient."""
    tokens, heads, d = 11, 3, 32
    x, g = check.randn(tokens, heads, d, seed=40), check.randn(tokens, heads, d, seed=41)
    cos, sin = angles(tokens, d, first_position=5)
    lhs = (submission.call("rope_forward", x, cos, sin).double() * g.double()).sum().item()
    rhs = (x.double() * submission.call("rope_backward", g, cos, sin).double()).sum().item()
    assert abs(lhs - rhs) < 1e-4 * (abs(lhs) + 1), f"<R x, g> = {lhs:.6g} but <x, rope_backward(g)> = {rhs:.6g}"
    want = rotate_half_reference(g, cos, -sin)  # R^T: the rotation by minus the angles
    submission.expect_close(submission.call("rope_backward", g, cos, sin), want, dtype=torch.float32, name="dx")


def test_many_tokens(submission):
    """300 tokens x 3 heads: many programs, the last one ragged."""
    x = check.randn(300, 3, 16, seed=50)
    expect_rope(submission, x, *angles(300, 16), name="300 tokens")


def test_bfloat16(submission):
    """bf16 x (float32 angles): rotated in float32, rounded once to bf16."""
    x = check.randn(13, 4, 64, seed=60, scale=3.0).to(torch.bfloat16)
    expect_rope(submission, x, *angles(13, 64, 1e6), dtype=torch.bfloat16, name="bf16")
