"""Public tests of kvcache-decode: what check() runs in the notebook.

They compare with values stored here for small fixed layers and prompts, worked out once
by recomputing causal attention from scratch in float64 (rotary embedding at absolute
positions). The recomputation itself is not here: it would be most of the solution. The
hidden tests hold it and check larger cases.
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


def empty_cache(batch, n_kv_heads, max_len, head_dim):
    """A preallocated cache, NaN everywhere: a slot read before it is written shows up."""
    return poisoned((batch, n_kv_heads, max_len, head_dim)), poisoned((batch, n_kv_heads, max_len, head_dim))


def weights_args(w):
    return w["wq"], w["wk"], w["wv"], w["wo"], w["n_heads"], w["n_kv_heads"]


def f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_prefill_matches_causal_attention(submission):
    """A prompt of 4 tokens, 2 heads of 4: prefill's output is causal attention."""
    w, x = layer(8, 2, 2, 4, seed=1), tokens(1, 4, 8, seed=2)
    out = submission.call("prefill", x, *weights_args(w), *empty_cache(1, 2, 8, 4))
    want = f64([[-0.640221294969, 0.139289200984, -1.834051514405, -1.209442314338, -0.695047967704,
                 -0.653825006114, -1.26917972656, -0.187915275985],
                [-0.028201756931, 0.107660444044, -1.308533308401, -0.75430799035, -0.47169136639,
                 -0.322941634689, -0.504327686781, -0.418250549433],
                [0.665702576742, 0.071802250867, -1.067491951867, -0.547651229821, -0.508830853431,
                 0.078791047518, -0.061273042797, -0.382250910846],
                [1.226251981718, -0.033728700582, -1.068169329429, -0.506633361865, -0.617995733492,
                 0.478178387564, 0.108366833062, -0.178694537363]]).reshape(1, 4, 8)
    submission.expect_close(out, want, dtype=torch.float32, name="prefill output")


def test_prefill_fills_the_cache(submission):
    """After prefill, slots 0..T-1 hold each position's rotated key and its value."""
    w, x = layer(8, 2, 1, 4, seed=3), tokens(1, 3, 8, seed=4)
    _, (*_, cache_k, cache_v) = submission.call_with_args("prefill", x, *weights_args(w), *empty_cache(1, 1, 6, 4))
    k = f64([[0.798271962165, 0.330097116033, 1.106875749335, 0.572249263144],
             [1.103081960016, -0.454754009106, -1.136167400785, -0.583342877684],
             [-1.127610660383, 1.356952684643, -2.4947715429, 0.955131288026]]).reshape(1, 1, 3, 4)
    v = f64([[0.087112181467, 1.58876067855, 0.493324356387, 0.723864854673],
             [-0.430800790994, 1.079739830797, 0.599140189056, 0.026586762326],
             [-0.037583152787, -0.995785624684, 2.944142119068, -0.495162961731]]).reshape(1, 1, 3, 4)
    submission.expect_close(cache_k[:, :, :3], k, dtype=torch.float32, name="cache_k[:, :, :3] (rotated keys)")
    submission.expect_close(cache_v[:, :, :3], v, dtype=torch.float32, name="cache_v[:, :, :3]")


def test_one_decode_step_matches_recomputation(submission):
    """3 tokens prefilled, a 4th decoded: its output is the last row of attention over all 4."""
    w, x = layer(8, 2, 2, 4, seed=5), tokens(1, 4, 8, seed=6)
    prompt = x[:, :3]
    _, (*_, cache_k, cache_v) = submission.call_with_args("prefill", prompt, *weights_args(w), *empty_cache(1, 2, 8, 4))
    out = submission.call("decode_step", x[:, 3], *weights_args(w), cache_k, cache_v, torch.tensor([3]))
    want = f64([[-0.235679153192, -0.091356407961, -0.528190940976, -0.315191108453, 0.340253417865,
                 0.275462458351, -0.279262887717, 0.053523122714]])
    submission.expect_close(out, want, dtype=torch.float32, name="decode output at position 3")
