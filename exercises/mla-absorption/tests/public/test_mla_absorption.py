"""Public tests of mla-absorption: what check() runs in the notebook.

They check properties the answer must have (an identity, a one-token cache, a cache
truncated at its lengths) and values stored here for one fixed input, never against a
function that computes attention: a public reference would be the solution, ready to paste.
The hidden tests have their own reference, the naive decompress-then-attend layer.
"""

import torch


def rand(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_absorbed_query_scores_like_the_decompressed_key(submission):
    """For a latent c, every head: absorbed query . c == query . (W_UK[h] c), the decompressed key."""
    q_nope, w_uk, c = rand(2, 5, 6, seed=1), rand(5, 6, 8, seed=2), rand(8, seed=3)
    q_latent = submission.call("absorb_query", q_nope, w_uk)
    assert isinstance(q_latent, torch.Tensor) and q_latent.shape == (2, 5, 8), \
        f"absorb_query must return [batch, heads, latent] = (2, 5, 8), got {getattr(q_latent, 'shape', q_latent)}"
    k_nope = torch.einsum("hdr,r->hd", w_uk, c)  # each head's key decompressed from c
    submission.expect_close((q_latent * c).sum(-1), (q_nope * k_nope).sum(-1), dtype=torch.float64,
                            name="q_latent . c against q_nope . (W_UK c)")


# One sequence, 2 heads, 3 cached rows of latent 2 and rope 2, scale 0.3.
Q_LATENT = torch.tensor([[[1.0, -2.0], [0.5, 1.5]]], dtype=torch.float64)
Q_ROPE = torch.tensor([[[0.25, 1.0], [-1.0, 0.5]]], dtype=torch.float64)
CACHE = torch.tensor([[[1.0, 0.0, 2.0, -1.0], [0.0, 1.0, 0.5, 0.5], [-1.0, 2.0, -0.5, 1.0]]], dtype=torch.float64)


def test_latent_attention_on_a_small_cache(submission):
    """Three rows, then the first two only: the weighted sums of the latents, stored values."""
    # Head 0 over 3 rows: scores (1 - 0.5, -2 + 0.625, -5 + 0.875) x 0.3 = (0.15, -0.4125, -1.2375),
    # softmax (0.5496, 0.3132, 0.1372), so o = 0.5496 (1, 0) + 0.3132 (0, 1) + 0.1372 (-1, 2).
    # The other values were worked out the same way, in float64.
    want3 = torch.tensor([[[0.4123708805220222, 0.5876291194779777], [-0.4749277483265337, 1.4749277483265337]]],
                         dtype=torch.float64)
    want2 = torch.tensor([[[0.6370307944803831, 0.36296920551961676], [0.27388501873922083, 0.7261149812607791]]],
                         dtype=torch.float64)
    for length, want in ((3, want3), (2, want2)):
        out = submission.call("latent_attention", Q_LATENT, Q_ROPE, CACHE, torch.tensor([length]), 0.3)
        submission.expect_close(out, want, dtype=torch.float64, name=f"latent_attention over {length} rows")


def test_one_cached_token_returns_its_latent(submission):
    """With one valid row, every head's weights are (1): the output is that row's latent."""
    batch, heads, latent, rope = 3, 4, 6, 4
    cache = rand(batch, 5, latent + rope, seed=4)
    out = submission.call("latent_attention", rand(batch, heads, latent, seed=5), rand(batch, heads, rope, seed=6),
                          cache, torch.ones(batch, dtype=torch.int64), 0.4)
    submission.expect_close(out, cache[:, :1, :latent].expand(batch, heads, latent), dtype=torch.float64,
                            name="latent_attention with lengths all 1")


def test_positions_past_length_are_ignored(submission):
    """Rows at and past lengths[b] hold NaN (an unwritten cache): each sequence's output must
    equal the one over its own rows alone."""
    batch, heads, capacity, latent, rope = 3, 2, 9, 6, 4
    lengths = torch.tensor([9, 4, 1])
    q_latent, q_rope = rand(batch, heads, latent, seed=7), rand(batch, heads, rope, seed=8)
    cache = rand(batch, capacity, latent + rope, seed=9)
    for b, n in enumerate(lengths.tolist()):
        cache[b, n:] = float("nan")
    out = submission.call("latent_attention", q_latent, q_rope, cache, lengths, 0.35)
    submission.expect_close(out[2], cache[2, :1, :latent].expand(heads, latent), dtype=torch.float64,
                            name="sequence 2 (length 1): its one latent, for every head")
    for b, n in enumerate(lengths.tolist()):
        alone = submission.call("latent_attention", q_latent[b:b + 1], q_rope[b:b + 1], cache[b:b + 1, :n].clone(),
                                torch.tensor([n]), 0.35)
        submission.expect_close(out[b:b + 1], alone, dtype=torch.float64,
                                name=f"sequence {b} (length {n} of {capacity}) against its {n} rows alone")


def test_folded_output_projection_matches_the_unfolded_one(submission):
    """o_latent @ fold_output(W_UV, W_O)^T == W_O [W_UV[0] o_latent[0]; W_UV[1] o_latent[1]; ...]."""
    heads, v_dim, latent, hidden, batch = 3, 4, 5, 7, 2
    w_uv, w_o, o_latent = rand(heads, v_dim, latent, seed=10), rand(hidden, heads * v_dim, seed=11), \
        rand(batch, heads, latent, seed=12)
    folded = submission.call("fold_output", w_uv, w_o)
    assert isinstance(folded, torch.Tensor) and folded.shape == (hidden, heads * latent), \
        f"fold_output must return [hidden, heads * latent] = ({hidden}, {heads * latent}), " \
        f"got {getattr(folded, 'shape', folded)}"
    per_head_outputs = torch.einsum("hvr,bhr->bhv", w_uv, o_latent).reshape(batch, heads * v_dim)
    submission.expect_close(o_latent.reshape(batch, -1) @ folded.T, per_head_outputs @ w_o.T, dtype=torch.float64,
                            name="layer output through the folded W_O")
