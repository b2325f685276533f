"""Hidden tests of kvcache-decode: many steps, GQA and MQA, ragged batches, long prompts."""

import math

import torch

from labkit.grade.harness import poisoned, public_module

_public = public_module(__file__, "test_decode.py")
layer, tokens = _public.layer, _public.tokens  # the public file's weights and inputs

# The float64 recomputation lives here, not in the public tests: there it would be the solution.


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


def test_many_decode_steps_match_recomputation(submission):
    """3 prompt tokens, then 6 decode steps on the cache each step left: every output matches."""
    w = layer(24, 4, 2, 6, seed=11)
    x = tokens(2, 9, 24, seed=12)
    expected = recompute(x, w)
    cache_k, cache_v = cache_holding(x[:, :3], w, max_len=10)
    for t in range(3, 9):
        out, cache_k, cache_v = decode(submission, x[:, t], w, cache_k, cache_v, torch.tensor([t, t]))
        submission.expect_close(out, expected[:, t], dtype=torch.float32, name=f"decode output at position {t}")


def test_grouped_query_heads_read_their_own_kv_head(submission):
    """8 query heads over 2 KV heads: heads 0-3 read KV head 0 and heads 4-7 KV head 1."""
    w = layer(32, 8, 2, 4, seed=13)
    x = tokens(1, 6, 32, seed=14)
    out = submission.call("prefill", x[:, :5], *weights_args(w), *empty_cache(1, 2, 8, 4))
    submission.expect_close(out, recompute(x[:, :5], w), dtype=torch.float32, name="prefill output (GQA)")
    cache_k, cache_v = cache_holding(x[:, :5], w, max_len=8)
    out, _, _ = decode(submission, x[:, 5], w, cache_k, cache_v, torch.tensor([5]))
    submission.expect_close(out, recompute(x, w)[:, 5], dtype=torch.float32, name="decode output (GQA)")


def test_sequences_of_different_lengths(submission):
    """3 sequences with 2, 5 and 9 tokens cached; the slots past each length hold another
    request's stale keys and values, which must not be attended to."""
    w = layer(32, 4, 2, 8, seed=15)
    lengths = [2, 5, 9]
    seqs = [tokens(1, n + 1, 32, seed=20 + n) for n in lengths]
    gen = torch.Generator().manual_seed(16)
    cache_k = 4 * torch.randn(3, 2, 12, 8, generator=gen)  # stale, finite: left by earlier requests
    cache_v = 4 * torch.randn(3, 2, 12, 8, generator=gen)
    for i, (n, x) in enumerate(zip(lengths, seqs)):
        k, v = keys_and_values(x[:, :n], w)
        cache_k[i, :, :n], cache_v[i, :, :n] = k[0].float(), v[0].float()
    x_new = torch.cat([x[:, n] for n, x in zip(lengths, seqs)])
    out, _, _ = decode(submission, x_new, w, cache_k, cache_v, torch.tensor(lengths))
    for i, (n, x) in enumerate(zip(lengths, seqs)):
        submission.expect_close(out[i], recompute(x, w)[0, n], dtype=torch.float32,
                                name=f"sequence {i} (length {n})")


def test_decode_writes_the_new_key_and_value_at_its_position(submission):
    """Lengths 3 and 6: the new key (rotated at its own position) and value land in slots 3
    and 6, and no other slot changes."""
    w = layer(16, 2, 2, 8, seed=17)
    x = tokens(2, 7, 16, seed=18)
    fresh = tokens(1, 1, 16, seed=23)[0, 0]  # sequence 0's new token, unlike the one in its slot 3
    cache_k, cache_v = cache_holding(x[:, :6], w, max_len=9)
    _, new_k, new_v = decode(submission, torch.stack([fresh, x[1, 6]]), w, cache_k, cache_v,
                                 torch.tensor([3, 6]))
    k0, v0 = keys_and_values(torch.cat([x[0, :3], fresh[None]])[None], w)
    k1, v1 = keys_and_values(x[1:], w)
    want_k, want_v = cache_k.double(), cache_v.double()
    want_k[0, :, 3], want_v[0, :, 3] = k0[0, :, 3], v0[0, :, 3]
    want_k[1, :, 6], want_v[1, :, 6] = k1[0, :, 6], v1[0, :, 6]
    for name, got, want in (("cache_k", new_k, want_k), ("cache_v", new_v, want_v)):
        written = ~want.isnan()
        if not torch.equal(~got.isnan(), written):
            raise AssertionError(f"{name}: slots written or cleared that should not be: "
                                 f"{int((got.isnan() != want.isnan()).sum())} elements differ in NaN-ness")
        submission.expect_close(got[written], want[written], dtype=torch.float32, name=f"{name} after the step")


def test_multi_query_attention_at_odd_sizes(submission):
    """5 query heads sharing one KV head of size 6, a 1-token prompt, then two steps."""
    w = layer(30, 5, 1, 6, seed=19)
    x = tokens(1, 3, 30, seed=20)
    expected = recompute(x, w)
    out = submission.call("prefill", x[:, :1], *weights_args(w), *empty_cache(1, 1, 3, 6))
    submission.expect_close(out, expected[:, :1], dtype=torch.float32, name="prefill output (1 token)")
    cache_k, cache_v = cache_holding(x[:, :1], w, max_len=3)
    for t in (1, 2):
        out, cache_k, cache_v = decode(submission, x[:, t], w, cache_k, cache_v, torch.tensor([t]))
        submission.expect_close(out, expected[:, t], dtype=torch.float32, name=f"decode output at position {t}")


def test_long_prompt_positions(submission):
    """A 200-token prompt: prefill, then a step at position 200, where rotation angles are large."""
    w = layer(32, 2, 1, 16, seed=21)
    x = tokens(1, 201, 32, seed=22)
    expected = recompute(x, w)
    out, tensors = submission.call_with_args("prefill", x[:, :200], *weights_args(w), *empty_cache(1, 1, 256, 16))
    submission.expect_close(out, expected[:, :200], dtype=torch.float32, name="prefill output (200 tokens)")
    out, _, _ = decode(submission, x[:, 200], w, tensors[-2], tensors[-1], torch.tensor([200]))
    submission.expect_close(out, expected[:, 200], dtype=torch.float32, name="decode output at position 200")
