"""labkit.models.accounting: parameter, FLOP and byte counts per part of a Qwen3 layer,
checked against the models themselves (ours, and HF's on the meta device)."""

import pytest
import torch
from labkit import models
from labkit.models import accounting


@pytest.mark.parametrize("name", list(models.QWEN3_SIZES))
def test_parameters_sum_to_hf_count(name):
    transformers = pytest.importorskip("transformers")
    cfg = models.QWEN3_SIZES[name]
    with torch.device("meta"):  # shapes only: 32B costs nothing
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**models.hf_config_kwargs(cfg)))
    assert sum(p.params for p in accounting.model_parts(cfg, 16)) == hf.num_parameters() == cfg.num_parameters()


def test_parameters_sum_to_our_model_tensors():
    model = models.Decoder(models.TINY)
    assert sum(p.params for p in accounting.model_parts(models.TINY, 3)) == sum(p.numel() for p in model.parameters())


def test_linear_and_attention_flops():
    cfg = models.TINY
    parts = {p.name: p for p in accounting.layer_parts(cfg, tokens=5)}
    assert parts["q_proj"].flops == 2 * 5 * cfg.hidden_size * cfg.num_heads * cfg.head_dim
    # causal: 5 queries see 1 + 2 + 3 + 4 + 5 = 15 keys; QK^T and PV are 2 * head_dim FLOPs a pair each
    assert parts["attention (SDPA)"].flops == 2 * 2 * cfg.num_heads * cfg.head_dim * 15
    assert parts["down_proj"].bytes == (5 * (cfg.intermediate_size + cfg.hidden_size)
                                        + cfg.intermediate_size * cfg.hidden_size) * 2


def test_tied_head_has_no_weights_but_does_its_matmul():
    tied = {p.name: p for p in accounting.model_parts(models.TINY, 4)}["lm_head"]
    assert tied.params == 0 and tied.flops == 2 * 4 * models.TINY.hidden_size * models.TINY.vocab_size


def test_groups_cover_every_part_once():
    parts = accounting.model_parts(models.QWEN3_SIZES["Qwen3-0.6B"], 128)
    groups = accounting.by_group(parts)
    assert set(groups) <= set(accounting.GROUPS)
    assert sum(g.flops for g in groups.values()) == sum(p.flops for p in parts)
    assert sum(g.bytes for g in groups.values()) == sum(p.bytes for p in parts)


def test_elementwise_parts_are_bandwidth_bound():
    for part in accounting.layer_parts(models.QWEN3_SIZES["Qwen3-0.6B"], 4096):
        if part.group in ("norms", "RoPE", "SwiGLU activation", "residual adds"):
            assert part.intensity < 5, part
        if part.group == "MLP matmuls":
            assert part.intensity > 100, part


@pytest.mark.parametrize("call, error, match", [
    (lambda: accounting.layer_parts("Qwen3-0.6B", 8), TypeError, "config must be a DecoderConfig"),
    (lambda: accounting.model_parts(models.TINY, 0), ValueError, "tokens must be positive"),
    (lambda: accounting.layer_parts(models.TINY, 8, bytes_per_element=2.0), TypeError, "bytes_per_element must be an int"),
])
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()
