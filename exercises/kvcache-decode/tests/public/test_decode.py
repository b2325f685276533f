"""Public tests of kvcache-decode: what check() runs in the notebook.

Every expected value is full recomputation in float64: causal attention over the whole
sequence so far, computed from scratch, with the rotary embedding at absolute positions.
"""

import math

import torch

from labkit.grade.harness import poisoned


def layer(d_model, n_heads, n_kv_heads, head_dim, seed):
    """One attention layer's weights, float32, scaled so that scores stay O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def weight(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    return {"wq": weight(n_heads * head_dim, d_model), "wk": weight(n_kv_heads * head_dim, d_model),
            "wv": weight(n_kv_heads * head_dim, d_model), "wo": weight(d_model, n_heads * head_dim),
            "n_heads": n_heads, "n_kv_heads": n_kv_heads}


def tokens(batch, length, d_model, seed):
    return torch.randn(batch, length, d_model, generator=torch.Generator().manual_seed(seed))


def rope(x, positions, base=10000.0):
    """x [..., T, d] (float64) rotated pair by pair: (x_i, x_{i+d/2}) by positions[t] * base^(-2i/d)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions.double()[:, None] * freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def keys_and_values(x, w):
    """The rotated keys and the values of every position of x [B, T, D]: [B, Hkv, T, d] each, float64."""
    b, t, _ = x.shape
    hkv = w["n_kv_heads"]
    k = (x.double() @ w["wk"].double().T).view(b, t, hkv, -1).transpose(1, 2)
    v = (x.double() @ w["wv"].double().T).view(b, t, hkv, -1).transpose(1, 2)
    return rope(k, torch.arange(t)), v


def recompute(x, w):
    """Causal attention over all of x [B, T, D] from scratch, in float64: [B, T, D]."""
    b, t, _ = x.shape
    hq, hkv = w["n_heads"], w["n_kv_heads"]
    q = rope((x.double() @ w["wq"].double().T).view(b, t, hq, -1).transpose(1, 2), torch.arange(t))
    k, v = keys_and_values(x, w)
    out = torch.empty(b, hq, t, q.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)  # query heads are grouped: the first hq/hkv share kv head 0, ...
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out.transpose(1, 2).reshape(b, t, -1) @ w["wo"].double().T


def empty_cache(batch, n_kv_heads, max_len, head_dim):
    """A preallocated cache, NaN everywhere: a slot read before it is written shows up."""
    return poisoned((batch, n_kv_heads, max_len, head_dim)), poisoned((batch, n_kv_heads, max_len, head_dim))


def cache_holding(x, w, max_len):
    """A cache whose first T slots hold the keys and values of x [B, T, D] (float32), NaN after."""
    k, v = keys_and_values(x, w)
    cache_k, cache_v = empty_cache(x.shape[0], w["n_kv_heads"], max_len, k.shape[-1])
    cache_k[:, :, :x.shape[1]], cache_v[:, :, :x.shape[1]] = k.float(), v.float()
    return cache_k, cache_v


def weights_args(w):
    return w["wq"], w["wk"], w["wv"], w["wo"], w["n_heads"], w["n_kv_heads"]


def decode(submission, x_new, w, cache_k, cache_v, lengths):
    """One decode step; returns its output and the cache as the step left it."""
    out, tensors = submission.call_with_args("decode_step", x_new, *weights_args(w), cache_k, cache_v, lengths)
    return out, tensors[-3], tensors[-2]  # the tensors in the order passed: ..., cache_k, cache_v, lengths


def test_prefill_matches_causal_attention(submission):
    """A prompt of 7 tokens, 2 sequences, 4 heads: prefill's output is causal attention."""
    w = layer(32, 4, 4, 8, seed=1)
    x = tokens(2, 7, 32, seed=2)
    out = submission.call("prefill", x, *weights_args(w), *empty_cache(2, 4, 16, 8))
    submission.expect_close(out, recompute(x, w), dtype=torch.float32, name="prefill output")


def test_prefill_fills_the_cache(submission):
    """After prefill, slots 0..T-1 hold each position's rotated key and its value."""
    w = layer(32, 4, 2, 8, seed=3)
    x = tokens(2, 5, 32, seed=4)
    _, (*_, cache_k, cache_v) = submission.call_with_args("prefill", x, *weights_args(w), *empty_cache(2, 2, 12, 8))
    k, v = keys_and_values(x, w)
    submission.expect_close(cache_k[:, :, :5], k, dtype=torch.float32, name="cache_k[:, :, :5] (rotated keys)")
    submission.expect_close(cache_v[:, :, :5], v, dtype=torch.float32, name="cache_v[:, :, :5]")


def test_one_decode_step_matches_recomputation(submission):
    """6 tokens cached, a 7th decoded: its output is the last row of attention over all 7."""
    w = layer(32, 4, 4, 8, seed=5)
    x = tokens(2, 7, 32, seed=6)
    cache_k, cache_v = cache_holding(x[:, :6], w, max_len=16)
    out, _, _ = decode(submission, x[:, 6], w, cache_k, cache_v, torch.tensor([6, 6]))
    submission.expect_close(out, recompute(x, w)[:, 6], dtype=torch.float32, name="decode output at position 6")
