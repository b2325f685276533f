"""Public tests of positional-rope-scaling: what check() runs in the notebook.

They compare with values worked out by hand for fixed inputs (each comment says how) or
check properties, never with a function that computes the answer: that would be the
solution, ready to paste. The hidden tests hold the functions to Hugging Face's.
"""

import math

import torch


def test_alibi_slopes_eight_heads(submission):
    """8 heads, a power of two: the geometric sequence 2^(-8k/8) = 1/2, 1/4, ..., 1/256."""
    out = submission.call("alibi_slopes", 8)
    want = torch.tensor([2.0 ** -k for k in range(1, 9)], dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float32, tol=1e-6, name="alibi_slopes(8)")


def test_alibi_slopes_six_heads(submission):
    """6 heads: the 4 slopes of 4 heads (2^-2, 2^-4, 2^-6, 2^-8), then 2^-1 and 2^-3 from 8 heads' sequence."""
    out = submission.call("alibi_slopes", 6)
    want = torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3], dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float32, tol=1e-6, name="alibi_slopes(6)")


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones(submission):
    """Head 32, base 10,000, L = 256, factor 4: pairs 0 (r = 40.7 turns > 32) keeps its speed,
    pairs 7..15 (r < 1 turn) are divided by 4, and no pair moves outside [speed/4, speed]."""
    out = submission.call("yarn_inv_freq", 32, 10_000.0, 4.0, 256)
    speeds = 10_000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    assert isinstance(out, torch.Tensor) and out.shape == (16,), \
        f"expected 16 speeds (head_dim / 2), got {getattr(out, 'shape', type(out).__name__)}"
    submission.expect_close(out[:1], speeds[:1], dtype=torch.float32, tol=1e-6, name="pair 0 (kept)")
    submission.expect_close(out[7:], speeds[7:] / 4, dtype=torch.float32, tol=1e-6, name="pairs 7-15 (interpolated)")
    middle = out[1:7].double()
    assert bool(((middle < speeds[1:7]) & (middle > speeds[1:7] / 4)).all()), \
        f"pairs 1-6 lie on the ramp, strictly between speed/4 and speed; got ratios {(middle / speeds[1:7]).tolist()}"


def test_yarn_attention_factor(submission):
    """0.1 ln(s) + 1 on q and k: 1.0 at s = 1, 1 + 0.1 ln 4 = 1.13863 at s = 4."""
    for factor, want in ((1.0, 1.0), (4.0, 1 + 0.1 * math.log(4.0))):
        got = submission.call("yarn_attention_factor", factor)
        assert isinstance(got, float) and abs(got - want) < 1e-9, \
            f"yarn_attention_factor({factor}) should be {want:.6f}, got {got!r}"
