"""labkit.attention: every kernel against float64 references and torch SDPA.

Shapes are small and odd (lengths 1, 17, 100, 130: not multiples of any block), so the
ragged-tile masks run; causal and not; GQA and MQA (fewer K/V heads); as many keys as
queries and not (cross-attention, and causal queries after a prefix of keys). Under the
interpreter each program runs in Python, so B * H stays <= 4 and lengths in the hundreds.

fp32 inputs are multiplied in TF32 on the GPU (10-bit mantissa), so their results are held
to ``attention.FP32_INPUT_TOLERANCE``; the interpreter multiplies them in full fp32.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from labkit import attention, backend, check
from labkit.attention import FlashAttentionFunction, check_inputs, cost, flash_attention, kernels
from labkit.attention import reference as ref

DEV = backend.device()
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _tol(dtype):
    """fp32 inputs go through TF32 matmuls on the GPU: labkit.attention's documented bound."""
    return attention.FP32_INPUT_TOLERANCE if dtype == F32 else check.tolerance(dtype)


def _lse_tol(dtype):
    """The logsumexp is fp32 throughout, but fp32 inputs reach it through TF32 scores."""
    return attention.FP32_INPUT_TOLERANCE if dtype == F32 else check.tolerance(F32)

# (batch, heads, kv_heads, seq, head_dim)
SHAPES = [
    (1, 1, 1, 1, 16),
    (1, 2, 2, 17, 32),
    (2, 2, 1, 100, 16),   # MQA
    (1, 4, 2, 130, 64),   # GQA, two query heads per K/V head
    (1, 2, 2, 64, 128),   # a multiple of every block: the unmasked stages alone
]


def _qkv(b, h, hkv, n, d, dtype, seed=0):
    return (check.randn(b, h, n, d, dtype=dtype, device=DEV, seed=seed + 1),
            check.randn(b, hkv, n, d, dtype=dtype, device=DEV, seed=seed + 2),
            check.randn(b, hkv, n, d, dtype=dtype, device=DEV, seed=seed + 3))


def _f64(*ts):
    return [t.detach().double() for t in ts]


def _id(shape):
    return "x".join(map(str, shape))


# ---- references ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (7, 5)])
def test_tiled_reference_matches_naive_in_float64(causal, blocks):
    q, k, v = _f64(*_qkv(2, 4, 2, 45, 16, torch.float32))
    o_ref, lse_ref = ref.naive_attention(q, k, v, causal=causal)
    o, lse = ref.tiled_attention(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1])
    check.assert_close(o, o_ref, name="tiled o")
    check.assert_close(lse, lse_ref, name="tiled lse")


@pytest.mark.parametrize("causal", [False, True])
def test_naive_reference_matches_sdpa(causal):
    q, k, v = _f64(*_qkv(1, 4, 2, 33, 16, torch.float32))
    o, _ = ref.naive_attention(q, k, v, causal=causal, scale=0.3)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    check.assert_close(o, sdpa, name="naive vs SDPA")


@pytest.mark.parametrize("n_q, n_k, causal", [(13, 40, False), (13, 40, True), (40, 13, False),
                                               (1, 29, False), (1, 29, True)])
def test_cross_attention_references_match_sdpa_lower_right(n_q, n_k, causal):
    """Unequal lengths: causal means SDPA's bottom-right-aligned mask, not is_causal's."""
    q = check.randn(1, 2, n_q, 16, dtype=torch.float64, device=DEV, seed=1)
    k, v = (check.randn(1, 2, n_k, 16, dtype=torch.float64, device=DEV, seed=s) for s in (2, 3))
    mask = causal_lower_right(n_q, n_k) if causal else None
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o, lse = ref.naive_attention(q, k, v, causal=causal)
    check.assert_close(o, sdpa, name="naive vs SDPA")
    o_tiled, lse_tiled = ref.tiled_attention(q, k, v, causal=causal, block_m=8, block_n=5)
    check.assert_close(o_tiled, o, name="tiled o")
    check.assert_close(lse_tiled, lse, name="tiled lse")


@pytest.mark.parametrize("causal", [False, True])
def test_backward_reference_matches_autograd(causal):
    q, k, v = [t.requires_grad_() for t in _f64(*_qkv(1, 4, 2, 29, 16, torch.float32))]
    do = check.randn(1, 4, 29, 16, dtype=torch.float64, seed=9, device=DEV)
    o, lse = ref.naive_attention(q, k, v, causal=causal)
    o.backward(do)
    grads = ref.attention_backward(*_f64(q, k, v, o, lse), do, causal=causal)
    for g, t, name in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        check.assert_close(g, t.grad, name=name)


# ---- forward kernels -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_forward_output_and_logsumexp(shape, causal, dtype):
    b, h, hkv, n, d = shape
    q, k, v = _qkv(*shape, dtype)
    o_ref, lse_ref = ref.naive_attention(*_f64(q, k, v), causal=causal)
    out = (check.empty_poisoned(q.shape, dtype, DEV),
           check.empty_poisoned((b, h, n), torch.float32, DEV))
    o, lse = kernels.forward(q, k, v, causal, 1 / math.sqrt(d), out=out)
    check.assert_close(o, o_ref, dtype=dtype, name="o")
    check.assert_close(lse, lse_ref, dtype=torch.float32, name="logsumexp")


# (batch, heads, kv_heads, n_queries, n_keys, head_dim): fewer and more keys than queries,
# a shift that is not a multiple of any block, GQA, one query (a decode step).
CROSS_SHAPES = [
    (1, 2, 1, 19, 58, 16),
    (2, 2, 2, 45, 13, 32),
    (1, 4, 2, 33, 100, 16),
    (1, 2, 2, 1, 37, 64),
]


def _cross_qkv(b, h, hkv, n_q, n_k, d, dtype, seed=0):
    return (check.randn(b, h, n_q, d, dtype=dtype, device=DEV, seed=seed + 1),
            check.randn(b, hkv, n_k, d, dtype=dtype, device=DEV, seed=seed + 2),
            check.randn(b, hkv, n_k, d, dtype=dtype, device=DEV, seed=seed + 3))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, causal", [(s, c) for s in CROSS_SHAPES for c in (False, True)
                                           if not (c and s[4] < s[3])],  # causal: n_keys >= n_queries
                         ids=lambda x: _id(x) if isinstance(x, tuple) else ("causal" if x else "full"))
def test_public_forward_and_backward_against_float64_autograd(shape, causal, dtype):
    """attention.forward / attention.backward, with n_keys != n_queries, on odd sizes."""
    b, h, hkv, n_q, n_k, d = shape
    q, k, v = _cross_qkv(*shape, dtype, seed=60)
    do = check.randn(b, h, n_q, d, dtype=dtype, device=DEV, seed=64)
    o, lse = attention.forward(q, k, v, causal)
    dq, dk, dv = attention.backward(do, q, k, v, o, lse, causal)
    q64, k64, v64 = [t.requires_grad_() for t in _f64(q, k, v)]
    mask = causal_lower_right(n_q, n_k) if causal else None
    o64 = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    o64.backward(do.double())
    _, lse64 = ref.naive_attention(*_f64(q, k, v), causal=causal)
    check.assert_close(o, o64, tol=_tol(dtype), name="o")
    check.assert_close(lse, lse64, tol=_lse_tol(dtype), name="logsumexp")
    for g, t, name in zip((dq, dk, dv), (q64, k64, v64), ("dq", "dk", "dv")):
        assert g.dtype == dtype and g.shape == t.shape
        check.assert_close(g, t.grad, tol=_tol(dtype), name=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_dimensional_inputs_are_one_head(causal):
    """(batch, seq, head_dim) inputs give the 4-D result with the head axis dropped."""
    q, k, v = _cross_qkv(2, 1, 1, 21, 30, 32, F16, seed=70)
    o4, lse4 = attention.forward(q, k, v, causal)
    o3, lse3 = attention.forward(q[:, 0], k[:, 0], v[:, 0], causal)
    assert torch.equal(o3, o4[:, 0]) and torch.equal(lse3, lse4[:, 0])
    do = check.randn(2, 1, 21, 32, dtype=F16, device=DEV, seed=74)
    grads4 = attention.backward(do, q, k, v, o4, lse4, causal)
    grads3 = attention.backward(do[:, 0], q[:, 0], k[:, 0], v[:, 0], o3, lse3, causal)
    for g3, g4 in zip(grads3, grads4):
        assert torch.equal(g3, g4[:, 0])


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_cs336_calling_convention(is_causal):
    """A third party's autograd-Function test, with nothing but our class in between.

    The layout and calls of Stanford CS336's FlashAttention-2 assignment tests: fp32
    (batch, n_queries, d) inputs, ``Function.apply(q, k, v, is_causal)`` with the scale
    left to its default, exactly one saved tensor of shape (batch, n_queries) holding
    the logsumexp, and gradients through ``.backward(do)``. Sizes shrunk and odd here.
    """
    batch, n, d = 2, 37, 16
    q, k, v = (check.randn(batch, n, d, dtype=F32, device=DEV, seed=s).requires_grad_() for s in (80, 81, 82))
    do = check.randn(batch, n, d, dtype=F32, device=DEV, seed=83)
    o = FlashAttentionFunction.apply(q, k, v, is_causal)
    saved = [t for t in o.grad_fn.saved_tensors if t.shape == (batch, n)]
    assert len(saved) == 1
    o.backward(do)

    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = q64 @ k64.transpose(-1, -2) / d**0.5
    if is_causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ v64
    o64.backward(do.double())
    torch.testing.assert_close(o, o64.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(saved[0], torch.logsumexp(s, dim=-1).float(), rtol=1e-2, atol=1e-2)
    check.assert_close(o, o64, tol=_tol(F32), name="o")
    for t, t64, name in zip((q, k, v), (q64, k64, v64), ("dq", "dk", "dv")):
        check.assert_close(t.grad, t64.grad, tol=_tol(F32), name=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 100, 32), (1, 1, 1, 33, 64)], ids=_id)
def test_forward_matches_sdpa(shape, causal):
    q, k, v = _qkv(*shape, BF16, seed=10)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                          enable_gqa=True)
    check.assert_close(flash_attention(q, k, v, causal=causal), sdpa, dtype=BF16, name="vs SDPA")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 37, 16), (1, 1, 1, 50, 64)], ids=_id)
def test_fa1_order_forward(shape, causal):
    q, k, v = _qkv(*shape, F16, seed=20)
    o_ref, lse_ref = ref.naive_attention(*_f64(q, k, v), causal=causal)
    o, lse = kernels.forward_fa1(q, k, v, causal, 1 / math.sqrt(shape[-1]))
    check.assert_close(o, o_ref, dtype=F16, name="FA1 o")
    check.assert_close(lse, lse_ref, dtype=torch.float32, name="FA1 logsumexp")


def test_custom_scale_and_large_scores():
    """A large scale makes scores of +-50: only a max-subtracted softmax survives that."""
    q, k, v = _qkv(1, 2, 2, 40, 16, F16, seed=30)
    for scale in (0.05, 4.0):
        o_ref, _ = ref.naive_attention(*_f64(q, k, v), causal=True, scale=scale)
        check.assert_close(flash_attention(q, k, v, causal=True, scale=scale), o_ref,
                           dtype=F16, name=f"scale={scale}")


# ---- backward --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=_id)
def test_backward_gradients(shape, causal, dtype):
    b, h, hkv, n, d = shape
    q, k, v = _qkv(*shape, dtype, seed=40)
    do = check.randn(b, h, n, d, dtype=dtype, device=DEV, seed=44)
    o, lse = kernels.forward(q, k, v, causal, 1 / math.sqrt(d))
    grads = tuple(check.empty_poisoned(t.shape, dtype, DEV) for t in (q, k, v))
    kernels.backward(q, k, v, o, lse, do, causal, 1 / math.sqrt(d), out=grads)
    q64, k64, v64 = [t.requires_grad_() for t in _f64(q, k, v)]
    ref.naive_attention(q64, k64, v64, causal=causal)[0].backward(do.double())
    for g, t, name in zip(grads, (q64, k64, v64), ("dq", "dk", "dv")):
        check.assert_close(g, t.grad, dtype=dtype, name=name)


def test_autograd_through_a_transposed_layout():
    """(batch, seq, heads, dim) tensors viewed as (batch, heads, seq, dim): no copy needed."""
    b, n, h, d = 1, 70, 2, 32
    base = [check.randn(b, n, h, d, dtype=BF16, device=DEV, seed=s) for s in (50, 51, 52)]
    q, k, v = [t.transpose(1, 2).requires_grad_() for t in base]
    assert not q.is_contiguous()
    o = flash_attention(q, k, v, causal=True)
    (o.float() * torch.linspace(-1, 1, d, device=DEV)).sum().backward()  # a dO with structure
    q64, k64, v64 = [t.requires_grad_() for t in _f64(q, k, v)]
    o64, _ = ref.naive_attention(q64, k64, v64, causal=True)
    (o64 * torch.linspace(-1, 1, d, dtype=torch.float64, device=DEV)).sum().backward()
    check.assert_close(o, o64, dtype=BF16, name="o")
    for t, t64, name in zip((q, k, v), (q64, k64, v64), ("dq", "dk", "dv")):
        check.assert_close(t.grad, t64.grad, dtype=BF16, name=name)


# ---- validation ------------------------------------------------------------------------


def _good():
    return _qkv(1, 2, 1, 8, 16, F16)


@pytest.mark.parametrize("make, error, match", [
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q[0, 0], k, v), ValueError, "q must have 3 or 4 dimensions"),
    (lambda q, k, v: (q[:, 0], k, v), ValueError, "all be 4-D .* or all 3-D"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "q must have dtype"),
    (lambda q, k, v: (q, k.bfloat16(), v), TypeError, "share a dtype"),
    (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, "same shape"),
    (lambda q, k, v: (q, k.expand(2, 1, 8, 16), v.expand(2, 1, 8, 16)), ValueError, "batch size and head_dim"),
    (lambda q, k, v: [t.repeat_interleave(2, dim=-1)[..., ::2] for t in (q, k, v)],
     ValueError, "last \\(head_dim\\) dimension contiguous"),
    (lambda q, k, v: (q.repeat(1, 1, 1, 3), k.repeat(1, 1, 1, 3), v.repeat(1, 1, 1, 3)),
     ValueError, "head_dim must be one of"),
    (lambda q, k, v: (q[:, :1], k.expand(1, 2, 8, 16).contiguous(), v.expand(1, 2, 8, 16).contiguous()),
     ValueError, "multiple of"),
])
def test_bad_tensors_are_refused(make, error, match):
    bad = make(*_good())
    for entry in (lambda: flash_attention(*bad), lambda: FlashAttentionFunction.apply(*bad),
                  lambda: attention.forward(*bad)):
        with pytest.raises(error, match=match):
            entry()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"scale": "0.1"}, TypeError, "scale must be a float"),
    ({"scale": 0.0}, ValueError, "positive finite"),
    ({"scale": float("nan")}, ValueError, "positive finite"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*_good(), **kwargs)


def test_causal_with_fewer_keys_than_queries_is_refused():
    q, k, v = _qkv(1, 2, 1, 9, 16, F16)
    with pytest.raises(ValueError, match="first 4 queries would see no key"):
        attention.forward(q, k[:, :, :5], v[:, :, :5], True)
    o, _ = attention.forward(q, k[:, :, :5], v[:, :, :5], False)  # not causal: fine
    assert o.shape == q.shape


def test_scale_defaults_to_one_over_sqrt_head_dim():
    q, k, v = _good()
    assert check_inputs(q, k, v, False, None) == pytest.approx(0.25)
    assert torch.equal(FlashAttentionFunction.apply(q, k, v, True),
                       flash_attention(q, k, v, causal=True, scale=0.25))


def _backward_args(three_d=False):
    q, k, v = _good()
    if three_d:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    o, lse = attention.forward(q, k, v)
    return {"do": torch.randn_like(o), "q": q, "k": k, "v": v, "o": o, "lse": lse}


@pytest.mark.parametrize("field, make, error, match", [
    ("do", lambda t: t[..., :1, :], ValueError, "do must have q's shape"),
    ("do", lambda t: t.float(), TypeError, "do must have dtype"),
    ("o", lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), ValueError, "o must have its last"),
    ("lse", lambda t: t.half(), TypeError, "lse must have dtype"),
    ("lse", lambda t: t[..., :-1], ValueError, "lse must have shape"),
    ("lse", lambda t: t.unsqueeze(-1), ValueError, "lse must have shape"),
    ("k", lambda t: t.float(), TypeError, "share a dtype"),
])
@pytest.mark.parametrize("three_d", [False, True], ids=["4d", "3d"])
def test_bad_backward_arguments_are_refused(field, make, error, match, three_d):
    args = _backward_args(three_d)
    args[field] = make(args[field])
    with pytest.raises(error, match=match):
        attention.backward(**args)


def _config_id(c) -> str:
    tile = "x".join(str(c.kwargs[k]) for k in kernels.BLOCKS)
    return f"{tile}-w{c.num_warps}-s{c.num_stages}" + ("-overlap" if c.kwargs["OVERLAP_QK"] else "")


@pytest.mark.parametrize("cfg", kernels.FWD_GPU_CONFIGS, ids=_config_id)
def test_each_forward_candidate_matches_float64(cfg):
    """Each launch the forward's autotuner may choose on the GPU, forced, in bf16 on this
    machine's device (the interpreter takes the tile and the loop order, not the warps and
    stages): the autotuner returns only its winner's output, so a wrong but slower candidate
    would otherwise go unseen. Causal with a shift (the first query tiles have no unmasked key tile,
    later ones one or several), not causal with a ragged tail, head_dim 64 and 128."""
    for n_q, n_k, causal, d in ((70, 330, True, 64), (200, 200, True, 128), (130, 257, False, 128)):
        q, k, v = _cross_qkv(1, 2, 1, n_q, n_k, d, BF16, seed=n_k + d)
        o, lse = kernels.forward(q, k, v, causal, d**-0.5, cfg=cfg)
        o64, lse64 = ref.naive_attention(*_f64(q, k, v), causal=causal)
        check.assert_close(o, o64, tol=_tol(BF16), name=f"o, {n_q}x{n_k} d={d} causal={causal}")
        check.assert_close(lse, lse64, tol=_lse_tol(BF16), name=f"lse, {n_q}x{n_k} d={d}")


@pytest.mark.gpu
def test_cpu_tensors_are_refused_on_a_gpu():
    q, k, v = [t.cpu() for t in _good()]
    with pytest.raises(ValueError, match="must be on cuda"):
        flash_attention(q, k, v)


# ---- costs -----------------------------------------------------------------------------


def test_flop_counts_follow_the_convention():
    full = cost.attention_flops(2, 3, 100, 64)
    assert full == 4 * 2 * 3 * 100**2 * 64
    assert cost.attention_flops(2, 3, 100, 64, causal=True) == full / 2
    assert cost.attention_flops(2, 3, 100, 64, backward=True) == 2.5 * full
    # 30 queries after 70 cached keys: 30 * 70 pairs left of the diagonal block, half of 30 x 30
    assert cost.attention_flops(1, 1, 30, 8, causal=True, seq_k=100) == 4 * 8 * (30 * 70 + 30 * 30 / 2)
    assert cost.attention_flops(1, 1, 30, 8, seq_k=100) == 4 * 8 * 30 * 100


def test_naive_traffic_grows_quadratically_and_flash_does_not_write_scores():
    small, big = (cost.naive_traffic(1, 1, n, 64).total for n in (1024, 8192))
    assert big / small > 40  # 8x the length: close to 64x the bytes once N >> d
    flash = cost.flash_traffic(1, 1, 8192, 64, block_m=128)
    assert not any("S " in part or "P " in part for part in flash.parts)
    # K and V are re-read once per Q tile: naive / flash is about 2 * block_m / d = 4 here.
    assert flash.total < cost.naive_traffic(1, 1, 8192, 64).total / 3
    causal = cost.flash_traffic(1, 1, 8192, 64, block_m=128, causal=True)
    assert causal.parts["Q, K, V read"] < 0.6 * flash.parts["Q, K, V read"]


def test_fa1_order_moves_the_output_once_per_kv_tile():
    fa1 = cost.fa1_traffic(1, 1, 4096, 64, block=64)
    fa2 = cost.flash_traffic(1, 1, 4096, 64, block_m=128)
    assert fa1.total > 3 * fa2.total


@pytest.mark.parametrize("seq, bm, bn", [(1000, 128, 64), (130, 32, 16), (64, 64, 64)])
def test_tile_schedule_visits_exactly_the_visible_tiles(seq, bm, bn):
    """A tile runs (masked or not) iff some query of it sees some key of it."""
    for causal in (False, True):
        plan = cost.tile_schedule(seq, bm, bn, causal=causal)
        for i, row in enumerate(plan):
            for j, kind in enumerate(row):
                q_last = min(seq, (i + 1) * bm) - 1
                visible = (j * bn <= q_last) if causal else True
                assert (kind != cost.SKIPPED) == visible
                fully_inside = (j + 1) * bn <= seq and (not causal or (j + 1) * bn - 1 <= i * bm)
                if kind == cost.UNMASKED:
                    assert fully_inside
    for seq_q, seq_k in [(70, 200), (130, 100)]:
        for causal in (False, True) if seq_k >= seq_q else (False,):
            plan = cost.tile_schedule(seq_q, 32, 16, causal=causal, seq_k=seq_k)
            assert len(plan) == math.ceil(seq_q / 32) and len(plan[0]) == math.ceil(seq_k / 16)
            for i, row in enumerate(plan):
                q_first, q_last = i * 32, min(seq_q, (i + 1) * 32) - 1
                for j, kind in enumerate(row):
                    k_first, k_last = j * 16, min(seq_k, (j + 1) * 16) - 1
                    # query m sees key n iff n <= m + seq_k - seq_q (causal)
                    shift = seq_k - seq_q if causal else seq_k
                    assert (kind != cost.SKIPPED) == (k_first <= q_last + shift)
                    if kind == cost.UNMASKED:
                        assert (j + 1) * 16 <= seq_k and k_last <= q_first + shift
    with pytest.raises(ValueError, match="at least as many keys"):
        cost.tile_schedule(100, 32, 16, causal=True, seq_k=50)
    causal_plan = cost.tile_schedule(4096, 128, 64, causal=True)
    run = sum(k != cost.SKIPPED for row in causal_plan for k in row)
    assert abs(run / (len(causal_plan) * len(causal_plan[0])) - 0.5) < 0.02
    with pytest.raises(ValueError, match="multiple of block_n"):
        cost.tile_schedule(100, 48, 32, causal=True)


def test_autotuning_searches_the_list_for_q_dtype():
    """fp32 operands get their own tiles; the tuned 16-bit search is left as it is."""
    sixteen_bit = kernels._configs([(64, 64, 4, 3)], kernels.BLOCKS)
    fp32 = kernels._configs([(16, 16, 4, 2)], kernels.BLOCKS)
    tuned = kernels._autotune(["N_Q"], sixteen_bit, fp32)(kernels.backward_preprocess_kernel)
    assert tuned.configs == sixteen_bit + fp32
    for dtype, expected in ((F32, fp32), (BF16, sixteen_bit), (F16, sixteen_bit)):
        assert tuned.early_config_prune(tuned.configs, {"Q": torch.empty(1, dtype=dtype)}) == expected
    single = kernels._autotune(["N_Q"], sixteen_bit, None)(kernels.backward_preprocess_kernel)
    assert single.configs == sixteen_bit and single.early_config_prune is None


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_overlapped_loop_runs_exponentials_under_a_product(head_dim):
    """In the sm_90 code of the plain forward every exponential waits for the products before
    it; in the overlapped one the unmasked loop's exponentials are issued while the previous
    tile's P V is in flight, the products are not serialized (a wait after every wgmma, what
    ptxas falls back to when an accumulator is written in flight), and nothing spills."""
    from labkit import sass

    for causal in (False, True):
        plain, overlapped = (attention.forward_sass(head_dim, causal=causal, overlap_qk=flag) for flag in (False, True))
        assert sass.issued_while_pending(plain, "MUFU.EX2") == 0
        exponentials = overlapped.count("MUFU.EX2")
        assert sass.issued_while_pending(overlapped, "MUFU.EX2") >= exponentials // 3, (head_dim, causal)
        ops = sass.opcodes(overlapped)
        assert overlapped.count("WARPGROUP.DEPBAR") <= ops.count("HGMMA") // 4, (head_dim, causal)
        assert "STL" not in ops


_TILE_LISTS = (kernels.FWD_GPU + kernels.FWD_FP32_GPU, kernels.DKDV_GPU + kernels.DKDV_FP32_GPU,
               kernels.DQ_GPU + kernels.DQ_FP32_GPU)
# Every candidate of every kernel at least once: the shorter lists start over.
GPU_TILES = [tuple(tiles[i % len(tiles)] for tiles in _TILE_LISTS) for i in range(max(map(len, _TILE_LISTS)))]


@pytest.mark.parametrize("fwd, dkdv, dq", GPU_TILES, ids=lambda t: "x".join(map(str, t[:2])))
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_the_gpu_tile_shapes_in_the_interpreter(monkeypatch, fwd, dkdv, dq, overlap):
    """Every GPU candidate's tile shape, through the interpreter: the masks and loop bounds
    (diagonal bands not aligned to tiles, ragged tails) must hold for each, not only for the
    interpreter's own small tiles. Cross-attention with a causal shift, and self-attention;
    the forward's unmasked key loop plain and overlapped (no unmasked tile, one, several)."""
    for kernel, tile in ((kernels.fa2_forward_kernel, fwd), (kernels.backward_dkdv_kernel, dkdv),
                         (kernels.backward_dq_kernel, dq)):
        fixed = {"OVERLAP_QK": overlap} if kernel is kernels.fa2_forward_kernel else {}
        monkeypatch.setattr(kernel, "configs", kernels._configs([tile], kernels.BLOCKS, **fixed))
        monkeypatch.setattr(kernel, "cache", {})
    for n_q, n_k, causal in ((70, 200, True), (130, 130, True), (70, 200, False)):
        q, k, v = _cross_qkv(1, 2, 1, n_q, n_k, 16, F32, seed=n_q)
        do = check.randn(1, 2, n_q, 16, dtype=F32, device=DEV, seed=n_k)
        q64, k64, v64 = [t.requires_grad_() for t in _f64(q, k, v)]
        o64, lse64 = ref.naive_attention(q64, k64, v64, causal=causal)
        o64.backward(do.double())
        o, lse = attention.forward(q, k, v, causal)
        check.assert_close(o, o64, tol=_tol(F32), name=f"o, {n_q}x{n_k}, causal {causal}")
        for g, t, name in zip(attention.backward(do, q, k, v, o, lse, causal), (q64, k64, v64), ("dq", "dk", "dv")):
            check.assert_close(g, t.grad, tol=_tol(F32), name=f"{name}, {n_q}x{n_k}, causal {causal}")
