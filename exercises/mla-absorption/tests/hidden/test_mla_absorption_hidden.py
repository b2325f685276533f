"""Hidden tests of mla-absorption: the whole absorbed layer against the naive one (decompress
every cached token into per-head keys and values, then attend), on fresh inputs with odd
sizes, ragged lengths, NaN past them, and bf16."""

import torch

from labkit.grade.harness import public_module

rand = public_module(__file__, "test_mla_absorption.py").rand


def naive_attention(q_nope, q_rope, cache, lengths, w_uk, w_uv, scale):
    """Each head's output [B, H, v_dim] from decompressed keys and values, float64."""
    latent = w_uk.shape[2]
    out = []
    for b, n in enumerate(lengths.tolist()):
        c, k_pe = cache[b, :n, :latent].double(), cache[b, :n, latent:].double()
        k = torch.cat([torch.einsum("hdr,nr->hnd", w_uk.double(), c), k_pe.expand(w_uk.shape[0], -1, -1)], dim=-1)
        v = torch.einsum("hvr,nr->hnv", w_uv.double(), c)
        q = torch.cat([q_nope[b], q_rope[b]], dim=-1).double()
        weights = (torch.einsum("hd,hnd->hn", q, k) * scale).softmax(-1)
        out.append(torch.einsum("hn,hnv->hv", weights, v))
    return torch.stack(out)


def layer_inputs(batch, heads, capacity, latent, rope, nope, v_dim, hidden, lengths, seed, dtype=torch.float64):
    x = {"q_nope": rand(batch, heads, nope, seed=seed, dtype=dtype),
         "q_rope": rand(batch, heads, rope, seed=seed + 1, dtype=dtype),
         "cache": rand(batch, capacity, latent + rope, seed=seed + 2, dtype=dtype),
         "w_uk": (rand(heads, nope, latent, seed=seed + 3) * latent**-0.5).to(dtype),
         "w_uv": (rand(heads, v_dim, latent, seed=seed + 4) * latent**-0.5).to(dtype),
         "w_o": rand(hidden, heads * v_dim, seed=seed + 5, dtype=dtype),
         "lengths": torch.tensor(lengths)}
    for b, n in enumerate(lengths):
        x["cache"][b, n:] = float("nan")
    return x


def test_absorbed_layer_matches_the_naive_layer(submission):
    """B=3, 5 heads, capacity 37, latent 24, rope 8, nope 12, v_dim 10, lengths (37, 1, 20): the
    given mla_decode_layer with your three functions against decompress-then-attend, float64."""
    x = layer_inputs(3, 5, 37, 24, 8, 12, 10, 20, [37, 1, 20], seed=20)
    scale = (12 + 8) ** -0.5
    folded = submission.call("fold_output", x["w_uv"], x["w_o"])
    out = submission.call("mla_decode_layer", x["q_nope"], x["q_rope"], x["cache"], x["lengths"], x["w_uk"], folded,
                          scale)
    per_head = naive_attention(x["q_nope"], x["q_rope"], x["cache"], x["lengths"], x["w_uk"], x["w_uv"], scale)
    want = per_head.reshape(3, -1) @ x["w_o"].T
    submission.expect_close(out, want, dtype=torch.float64, name="absorbed layer against the naive layer")


def test_ragged_batch_odd_sizes_float32(submission):
    """latent_attention alone in float32: 4 sequences of lengths (29, 3, 17, 1), 7 heads, latent 40, rope 6."""
    x = layer_inputs(4, 7, 29, 40, 6, 8, 8, 4, [29, 3, 17, 1], seed=30, dtype=torch.float32)
    scale = 0.27
    q_latent = torch.einsum("bhd,hdr->bhr", x["q_nope"].double(), x["w_uk"].double())
    out = submission.call("latent_attention", q_latent.float(), x["q_rope"], x["cache"], x["lengths"], scale)
    # The attention-weighted latent is what W_UV turns into each head's output: compare through an identity W_UV.
    eye = torch.eye(40, dtype=torch.float64).expand(7, 40, 40)
    want = naive_attention(x["q_nope"], x["q_rope"], x["cache"], x["lengths"], x["w_uk"], eye, scale)
    submission.expect_close(out, want, dtype=torch.float32, name="latent_attention, float32, ragged")


def test_bf16_inputs(submission):
    """The whole layer on bf16 tensors: a bf16 result within bf16's tolerance."""
    x = layer_inputs(2, 4, 21, 16, 8, 8, 8, 12, [21, 9], seed=40, dtype=torch.bfloat16)
    scale = 16**-0.5
    folded = submission.call("fold_output", x["w_uv"], x["w_o"])
    out = submission.call("mla_decode_layer", x["q_nope"], x["q_rope"], x["cache"], x["lengths"], x["w_uk"], folded,
                          scale)
    want = naive_attention(x["q_nope"], x["q_rope"], x["cache"], x["lengths"], x["w_uk"], x["w_uv"], scale)
    submission.expect_close(out, want.reshape(2, -1) @ x["w_o"].double().T, dtype=torch.bfloat16,
                            name="bf16 layer against the naive layer")


def test_folded_projection_on_fresh_shapes(submission):
    """3 heads, v_dim 7, latent 11, hidden 13: the folded weights themselves, head by head."""
    w_uv, w_o = rand(3, 7, 11, seed=50), rand(13, 21, seed=51)
    folded = submission.call("fold_output", w_uv, w_o)
    want = torch.cat([w_o[:, 7 * h:7 * (h + 1)] @ w_uv[h] for h in range(3)], dim=1)
    submission.expect_close(folded, want, dtype=torch.float64, name="fold_output")
