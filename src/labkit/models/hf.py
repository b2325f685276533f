"""Hugging Face's names for the same weights, and the config each side understands.

A ``Qwen3ForCausalLM`` state dict and a :class:`~labkit.models.Decoder` state dict hold the
same tensors under different keys (``model.layers.3.self_attn.q_proj.weight`` here is
``blocks.3.attn.wq.weight``); no tensor is transposed or split. This module is the table
between the two, used in both directions. It does not import ``transformers``: loading a
checkpoint's tensors is the caller's business (``safetensors.torch.load_file``, or a
model's ``state_dict()``), and the tests build the HF model they compare with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from .config import DecoderConfig

# HF key (inside "model.layers.<i>.") -> our key (inside "blocks.<i>.")
LAYER_KEYS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
TOP_KEYS: dict[str, str] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")


def hf_key_to_ours(key: str) -> str:
    """Our name for HF key ``key``; ``ValueError`` for a key the book's model has no place for."""
    if key in TOP_KEYS:
        return TOP_KEYS[key]
    m = _HF_LAYER.fullmatch(key)
    if m and m.group(2) in LAYER_KEYS:
        return f"blocks.{m.group(1)}.{LAYER_KEYS[m.group(2)]}"
    raise ValueError(f"HF key {key!r} has no counterpart in labkit's Decoder (biases, sliding windows "
                     "and MoE layers are not part of the book's dense model)")


def our_key_to_hf(key: str) -> str:
    """HF's name for our key ``key``."""
    for hf, ours in TOP_KEYS.items():
        if key == ours:
            return hf
    m = _OUR_LAYER.fullmatch(key)
    if m:
        for hf, ours in LAYER_KEYS.items():
            if m.group(2) == ours:
                return f"model.layers.{m.group(1)}.{hf}"
    raise ValueError(f"{key!r} is not a key of labkit's Decoder")


def load_hf_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a ``Qwen3ForCausalLM`` state dict into ``model`` (a :class:`~labkit.models.Decoder`).

    Every key must map and every weight of ``model`` must be given, with the same shape;
    a tied model takes ``lm_head.weight`` from the embedding (HF may list it or not).
    """
    from .decoder import Decoder

    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    tied = model.config.tie_word_embeddings
    ours: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if tied and key == "lm_head.weight":
            continue
        ours[hf_key_to_ours(key)] = tensor
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    missing, extra = expected - set(ours), set(ours) - expected
    if missing or extra:
        raise ValueError(f"state dict does not fit the config: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(extra)[:4]}")
    params = model.state_dict()
    for key, tensor in ours.items():
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise ValueError(f"{our_key_to_hf(key)}: shape {tuple(tensor.shape)}, the config needs "
                             f"{tuple(params[key].shape)}")
    with torch.no_grad():
        for key, tensor in ours.items():
            params[key].copy_(tensor)


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under HF's names (what ``Qwen3ForCausalLM.load_state_dict`` takes)."""
    return {our_key_to_hf(k): v for k, v in model.state_dict().items()}


def hf_config_kwargs(config: DecoderConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Qwen3Config`` describing the same model."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    )


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    """A :class:`DecoderConfig` from a Qwen3 ``config.json`` (as a dict)."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a mapping (a parsed config.json), got {type(hf).__name__}")
    if hf.get("attention_bias") or hf.get("use_sliding_window") or hf.get("hidden_act", "silu") != "silu":
        raise ValueError("only Qwen3's dense layout (no attention bias, no sliding window, SiLU) is supported")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError("only plain RoPE is supported; this config scales it (YaRN, linear, ...): "
                         f"{rope or scaling}")
    theta = hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    try:
        return DecoderConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 40_960),
        )
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}") from None
