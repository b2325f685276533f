"""Public tests of rope-kernel: what check() runs in the notebook.

The expected rotation is HF's formula in float64 torch, ``x * cos + rotate_half(x) * sin``
(a kernel exercise may show its reference: the same torch operators in a submission are
forbidden), and three properties every rotary embedding has."""

import torch

from labkit import check


def angles(tokens, head_dim, base=10_000.0, first_position=0):
    """cos, sin of [tokens, head_dim // 2], float32: pair i of position m turns by m * base**(-2i/d)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    theta = torch.arange(first_position, first_position + tokens, dtype=torch.float64)[:, None] * inv_freq
    return theta.cos().float(), theta.sin().float()


def rotate_half_reference(x, cos, sin):
    """HF's apply_rotary_pos_emb on [T, H, D] in float64: pairs (x[i], x[i + D/2]) turn by angle i."""
    x = x.double()
    c = torch.cat([cos, cos], -1).double()[:, None, :]  # the same angle for both halves, every head
    s = torch.cat([sin, sin], -1).double()[:, None, :]
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * c + rotate_half * s


def test_fixed_rotation(submission):
    """3 tokens x 2 heads x head_dim 4 (base 100): y = x * cos + rotate_half(x) * sin, HF's convention."""
    x = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4) / 8 - 1
    cos, sin = angles(3, 4, base=100.0)
    y = submission.call("rope_forward", x, cos, sin)
    submission.expect_close(y, rotate_half_reference(x, cos, sin), dtype=torch.float32, name="y")


def test_position_zero_is_the_identity(submission):
    """One token at position 0: every angle is 0, so y = x."""
    x = check.randn(1, 3, 8, seed=1)
    cos, sin = angles(1, 8)
    submission.expect_close(submission.call("rope_forward", x, cos, sin), x.double(), dtype=torch.float32,
                            name="y at position 0")


def test_each_head_keeps_its_length(submission):
    """A rotation moves no length: every head vector of y has its x's norm."""
    x = check.randn(5, 3, 16, seed=2, scale=2.0)
    cos, sin = angles(5, 16)
    y = submission.call("rope_forward", x, cos, sin)
    submission.expect_close(y.norm(dim=-1), x.double().norm(dim=-1), dtype=torch.float32, name="|y| per head")


def test_scores_depend_on_relative_position_only(submission):
    """One q and one k vector at every position: after RoPE, q_m . k_n depends on m - n only."""
    tokens, d = 6, 16
    q = check.randn(1, 1, d, seed=3).expand(tokens, 1, d).contiguous()
    k = check.randn(1, 1, d, seed=4).expand(tokens, 1, d).contiguous()
    cos, sin = angles(tokens, d)
    qr = submission.call("rope_forward", q, cos, sin)[:, 0].double()
    kr = submission.call("rope_forward", k, cos, sin)[:, 0].double()
    scores = qr @ kr.T
    shifted = (scores[1:, 1:] - scores[:-1, :-1]).abs().max().item()
    assert shifted < 1e-4 * scores.abs().max().item(), (
        f"q_m . k_n must equal q_(m+1) . k_(n+1); they differ by up to {shifted:.3g}")


def test_backward_undoes_the_forward(submission):
    """A rotation's inverse is its transpose: rope_backward(rope_forward(x)) = x."""
    x = check.randn(7, 2, 8, seed=5)
    cos, sin = angles(7, 8)
    back = submission.call("rope_backward", submission.call("rope_forward", x, cos, sin), cos, sin)
    submission.expect_close(back, x.double(), dtype=torch.float32, name="rope_backward(rope_forward(x))")
