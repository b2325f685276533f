"""What each attention variant caches per token, and the MLA models' published shapes.

Per token and layer a cache holds:

- MHA, GQA, MQA: a key and a value per KV head, ``2 * kv_heads * head_dim`` elements
  (MHA: ``kv_heads = heads``; MQA: ``kv_heads = 1``): :func:`labkit.kvcache.kv_bytes_per_token`.
- MLA: one latent and one shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` elements,
  whatever the number of heads: :func:`mla_kv_bytes_per_token`.

The DeepSeek shapes are those of their ``config.json`` on the Hugging Face Hub, as given
in the DeepSeek-V2 paper (Section 2.1 and Appendix B) and the DeepSeek-V3 report (Section 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_positive_int


def mla_kv_bytes_per_token(layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                           bytes_per_element: int = 2) -> int:
    """``layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element``: one latent and one
    rotary key per layer, shared by every head."""
    for value, name in ((layers, "layers"), (kv_lora_rank, "kv_lora_rank"),
                        (qk_rope_head_dim, "qk_rope_head_dim"), (bytes_per_element, "bytes_per_element")):
        check_positive_int(value, name)
    return layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element


@dataclass(frozen=True)
class MLAShape:
    """The attention shapes of a model with multi-head latent attention."""

    name: str
    layers: int
    heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    params_billion: float  # total, all experts
    source: str            # bibliography key

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """The compressed cache: latent + rotary key, every layer."""
        return mla_kv_bytes_per_token(self.layers, self.kv_lora_rank, self.qk_rope_head_dim, bytes_per_element)

    def decompressed_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """What a cache of the same model's per-head keys and values would hold (naive decode's cache)."""
        key, value = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.layers * self.heads * (key + value) * bytes_per_element


MLA_SHAPES: dict[str, MLAShape] = {s.name: s for s in (
    MLAShape("DeepSeek-V2-Lite", 27, 16, 512, 128, 64, 128, 15.7, "deepseek2024v2"),
    MLAShape("DeepSeek-V2", 60, 128, 512, 128, 64, 128, 236.0, "deepseek2024v2"),
    MLAShape("DeepSeek-V3", 61, 128, 512, 128, 64, 128, 671.0, "deepseek2024v3"),
)}


@dataclass(frozen=True)
class DecodeCost:
    """What one decode step's attention costs per cached token, per layer and sequence."""

    cached_elements: int  # elements read from the cache
    flops: int            # multiply-adds x 2 of the scores and the weighted sum, all heads

    def intensity(self, bytes_per_element: int = 2) -> float:
        """FLOPs per byte of cache read: where the step sits on a roofline."""
        return self.flops / (self.cached_elements * bytes_per_element)


def decode_costs(heads: int, head_dim: int, kv_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int) -> dict[str, DecodeCost]:
    """Per cached token: MHA, GQA (``kv_heads``), MQA at ``head_dim``; MLA naive (decompressed
    per-head keys of ``nope + rope`` and values of ``v_head_dim``) and absorbed (one row of
    ``kv_lora_rank + rope`` for all heads, scored at that width and summed at ``kv_lora_rank``)."""
    for value, name in ((heads, "heads"), (head_dim, "head_dim"), (kv_heads, "kv_heads"),
                        (kv_lora_rank, "kv_lora_rank"), (qk_nope_head_dim, "qk_nope_head_dim"),
                        (qk_rope_head_dim, "qk_rope_head_dim"), (v_head_dim, "v_head_dim")):
        check_positive_int(value, name)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    key = qk_nope_head_dim + qk_rope_head_dim

    def grouped(groups: int) -> DecodeCost:  # K and V per group; q.k and p.v per query head
        return DecodeCost(2 * groups * head_dim, 4 * heads * head_dim)

    return {
        "MHA": grouped(heads),
        f"GQA-{kv_heads}": grouped(kv_heads),
        "MQA": grouped(1),
        "MLA naive": DecodeCost(heads * (key + v_head_dim), 2 * heads * (key + v_head_dim)),
        "MLA absorbed": DecodeCost(kv_lora_rank + qk_rope_head_dim,
                                   2 * heads * (kv_lora_rank + qk_rope_head_dim + kv_lora_rank)),
    }
