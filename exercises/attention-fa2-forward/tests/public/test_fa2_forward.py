"""Public tests of attention-fa2-forward: what check() runs in the notebook."""

import torch

from labkit import check
from labkit.grade.harness import poisoned


def expected(q, k, v, causal, scale):
    """The definition in float64: softmax(scale * q k^T, keys after the query masked) v."""
    s = scale * (q.double() @ k.double().transpose(1, 2))
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def expect_attention(submission, bh, n, d, *, causal, dtype=torch.float16, scale=None, q_scale=1.0, seed=0):
    q = check.randn(bh, n, d, dtype=dtype, seed=seed, scale=q_scale)
    k, v = (check.randn(bh, n, d, dtype=dtype, seed=seed + i) for i in (1, 2))
    out = submission.call("flash_forward", q, k, v, causal, scale, poisoned(q.shape, dtype))
    s = d ** -0.5 if scale is None else scale
    submission.expect_close(out, expected(q, k, v, causal, s), dtype=dtype,
                            name=f"flash_forward(bh={bh}, N={n}, d={d}, causal={causal})")


def test_full_attention_whole_tiles(submission):
    """N = 64, a multiple of both blocks, no mask: every tile is full and visible."""
    expect_attention(submission, 2, 64, 32, causal=False, seed=1)


def test_causal_odd_length(submission):
    """N = 45, causal: the diagonal tiles are masked, the tiles above them skipped."""
    expect_attention(submission, 2, 45, 32, causal=True, seed=2)
