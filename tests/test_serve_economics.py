"""labkit.serve.economics: step FLOPs and bytes against the model's own accounting, the
roofline and cost arithmetic, and the clear errors of bad arguments."""

from __future__ import annotations

import pytest

import labkit  # noqa: F401
from labkit import models
from labkit.models import accounting
from labkit.memory.roofline import Work
from labkit.serve import economics

QWEN = models.QWEN3_SIZES["Qwen3-0.6B"]


@pytest.mark.parametrize("config", [models.TINY, QWEN], ids=["tiny", "qwen3-0.6b"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_prefill_flops_match_the_models_accounting(config, tokens):
    """One sequence's prefill: the matmuls and attention of labkit.models.accounting, with the
    LM head on the last token only (accounting counts it on every token)."""
    parts = accounting.by_group(accounting.model_parts(config, tokens))
    head_per_token = parts["LM head"].flops // tokens
    expected = sum(parts[g].flops for g in ("attention projections", "MLP matmuls", "attention core (SDPA)"))
    cost = economics.step_flops_bytes(config, batch=1, new_tokens=tokens)
    assert cost.flops == expected + head_per_token


def test_decode_step_counts():
    cost1 = economics.step_flops_bytes(QWEN, batch=1, new_tokens=1, context=1000)
    cost64 = economics.step_flops_bytes(QWEN, batch=64, new_tokens=1, context=1000)
    kv = QWEN.kv_bytes_per_token(2)
    weights = cost1.bytes - kv * 1001
    # Every weight once (the tied embedding read as the LM head); the norms' few weights left out.
    assert weights == pytest.approx(QWEN.num_parameters() * 2, rel=1e-3)
    assert cost1.bytes == weights + kv * 1001
    assert cost64.bytes == weights + 64 * kv * 1001
    assert cost64.flops == pytest.approx(64 * cost1.flops)
    # A decode step does about one multiply-add per weight (2 bytes): intensity near 1 at batch 1.
    # It grows with the batch while the weights dominate the bytes (short contexts); at 1000
    # tokens each sequence's cache outweighs the 0.6B weights and caps it.
    assert 0.5 < cost1.intensity < 1.5
    short1, short64 = (economics.step_flops_bytes(QWEN, batch=b, new_tokens=1, context=16) for b in (1, 64))
    assert short64.intensity > 40 * short1.intensity
    assert cost64.intensity < 16
    # A 4096-token prefill is far more intense than any of them.
    assert economics.step_flops_bytes(QWEN, batch=1, new_tokens=4096).intensity > 1000


def test_roofline_floor_and_ridge_point():
    cost = Work(flops=2e12, bytes=1e9)
    assert cost.intensity == 2000
    assert economics.floor_s(cost, tflops=1000, tbps=4) == pytest.approx(2e-3)   # compute-bound
    assert economics.floor_s(cost, tflops=1e5, tbps=0.1) == pytest.approx(1e-2)  # bandwidth-bound
    assert economics.ridge_point(989, 4.8) == pytest.approx(989 / 4.8)


def test_cost_little_and_tco_arithmetic():
    # $3.60 an hour at 1000 tokens/s, busy all the time: 3.6 million tokens an hour for $3.60.
    assert economics.cost_per_million_tokens(3.6, 1000) == pytest.approx(1.0)
    assert economics.cost_per_million_tokens(3.6, 1000, utilization=0.5) == pytest.approx(2.0)
    assert economics.littles_law_concurrency(10, 2.5) == 25
    h200 = economics.GPUS["H200 SXM"]
    tco = economics.tco_dollars_per_gpu_hour(h200, gpu_price=30_000, server_overhead=0.5, years=4,
                                             dollars_per_kwh=0.1, pue=1.3, power_draw_fraction=0.8,
                                             dollars_per_kw_month=150)
    assert tco["capital"] == pytest.approx(45_000 / (4 * 8760))
    assert tco["energy"] == pytest.approx(10.2 / 8 * 0.8 * 1.3 * 0.1)
    assert tco["rack, power and cooling"] == pytest.approx(10.2 / 8 * 150 / 730)
    assert tco["total"] == pytest.approx(tco["capital"] + tco["energy"] + tco["rack, power and cooling"])


def test_memory_bounds_the_batch_and_the_slo_picks_the_largest_batch_within_it():
    h100, h200 = economics.GPUS["H100 SXM"], economics.GPUS["H200 SXM"]
    small_gpu = economics.GPUSpec("40 GB", 40, 1.0, 100, 300, 3.0, 4)
    assert economics.max_batch(models.QWEN3_SIZES["Qwen3-32B"], small_gpu, 4096) == 0  # 64 GB of weights
    fits = economics.max_batch(QWEN, h200, 4096)
    assert fits > economics.max_batch(QWEN, h100, 4096) > 0
    kv = QWEN.kv_bytes_per_token(2) * 4096
    assert fits * kv <= 141e9 * 0.9 - QWEN.num_parameters() * 2 < (fits + 1) * kv
    best = economics.best_batch_under_slo(QWEN, h200, context=4096, tpot_slo_s=0.02, dollars_per_hour=4.0)
    over = economics.decode_operating_point(QWEN, h200, batch=best.batch + 1, context=4096, dollars_per_hour=4.0)
    assert best.step_s <= 0.02 and (best.batch == fits or over.step_s > 0.02)
    smaller = economics.decode_operating_point(QWEN, h200, batch=max(1, best.batch // 2), context=4096,
                                               dollars_per_hour=4.0)
    assert smaller.dollars_per_million >= best.dollars_per_million
    assert economics.best_batch_under_slo(QWEN, h200, context=4096, tpot_slo_s=1e-6, dollars_per_hour=4.0) is None
    half = economics.decode_operating_point(QWEN, h200, batch=8, context=1024, dollars_per_hour=4.0,
                                            roofline_efficiency=0.5)
    full = economics.decode_operating_point(QWEN, h200, batch=8, context=1024, dollars_per_hour=4.0)
    assert half.step_s == pytest.approx(2 * full.step_s)


@pytest.mark.parametrize("call, match", [
    (lambda: economics.step_flops_bytes("cfg", batch=1, new_tokens=1), "DecoderConfig"),
    (lambda: economics.step_flops_bytes(QWEN, batch=0, new_tokens=1), "batch"),
    (lambda: economics.step_flops_bytes(QWEN, batch=1, new_tokens=1, context=-1), "context"),
    (lambda: economics.cost_per_million_tokens(3.0, 0), "tokens_per_s"),
    (lambda: economics.cost_per_million_tokens(3.0, 10, utilization=1.5), "utilization"),
    (lambda: economics.ridge_point(True, 1.0), "tflops"),
    (lambda: economics.littles_law_concurrency(-1, 1), "arrival_rate_per_s"),
    (lambda: economics.max_batch(QWEN, economics.GPUS["H200 SXM"], 100, memory_fraction=0), "memory_fraction"),
    (lambda: economics.decode_operating_point(QWEN, economics.GPUS["H200 SXM"], batch=1, context=1,
                                              dollars_per_hour=1, roofline_efficiency=2), "roofline_efficiency"),
])
def test_bad_arguments_are_explained(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
