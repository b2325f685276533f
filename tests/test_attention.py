"""labkit.attention: every kernel against float64 references and torch SDPA.

Shapes are small and odd (lengths 1, 17, 100, 130: not multiples of any block), so the
ragged-tile masks run; causal and not; GQA and MQA (fewer K/V heads). Under the
interpreter each program runs in Python, so B * H stays <= 4 and lengths in the hundreds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit import backend, check
from labkit.attention import check_inputs, cost, flash_attention, flash_attention_forward, kernels
from labkit.attention import reference as ref

DEV = backend.device()
F16, BF16 = torch.float16, torch.bfloat16

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
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, "q must have dtype"),
    (lambda q, k, v: (q, k.bfloat16(), v), TypeError, "share a dtype"),
    (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, "same shape"),
    (lambda q, k, v: (q, k[:, :, :4], v[:, :, :4]), ValueError, "self-attention"),
    (lambda q, k, v: [t.repeat_interleave(2, dim=-1)[..., ::2] for t in (q, k, v)],
     ValueError, "last \\(head_dim\\) dimension contiguous"),
    (lambda q, k, v: (q.repeat(1, 1, 1, 3), k.repeat(1, 1, 1, 3), v.repeat(1, 1, 1, 3)),
     ValueError, "head_dim must be one of"),
    (lambda q, k, v: (q[:, :1], k.expand(1, 2, 8, 16).contiguous(), v.expand(1, 2, 8, 16).contiguous()),
     ValueError, "multiple of"),
])
def test_bad_tensors_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*make(*_good()))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"scale": "0.1"}, TypeError, "scale must be a float"),
    ({"scale": 0.0}, ValueError, "positive finite"),
    ({"scale": float("nan")}, ValueError, "positive finite"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*_good(), **kwargs)


def test_forward_only_entry_point_validates_too():
    q, k, v = _good()
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention_forward(q, k, v, causal="yes")
    assert check_inputs(q, k, v, False, None) == pytest.approx(0.25)


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
    causal_plan = cost.tile_schedule(4096, 128, 64, causal=True)
    run = sum(k != cost.SKIPPED for row in causal_plan for k in row)
    assert abs(run / (len(causal_plan) * len(causal_plan[0])) - 0.5) < 0.02
    with pytest.raises(ValueError, match="multiple of block_n"):
        cost.tile_schedule(100, 48, 32, causal=True)
