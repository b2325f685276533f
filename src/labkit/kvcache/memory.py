"""The KV cache's memory bill: bytes per token, per sequence, per batch.

Every token a model has seen leaves one key and one value vector per KV head in every
layer, so a token costs ``2 * layers * kv_heads * head_dim * bytes_per_element`` bytes.
The shapes below are the published configurations (Qwen3 technical report, Table 1;
Llama 3 paper, Table 3; Llama 2 paper): grouped-query attention is the difference
between Llama-2-7B's 32 KV heads and Llama-3-8B's 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_positive_int


@dataclass(frozen=True)
class ModelShape:
    """What fixes a model's KV cache size, and its weight count for the memory left over."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_billion: float
    source: str  # bibliography key of the configuration's publication

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, bytes_per_element)


MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("Qwen3-0.6B", 28, 8, 128, 0.6, "yang2025qwen3"),
    ModelShape("Qwen3-1.7B", 28, 8, 128, 1.7, "yang2025qwen3"),
    ModelShape("Qwen3-4B", 36, 8, 128, 4.0, "yang2025qwen3"),
    ModelShape("Qwen3-8B", 36, 8, 128, 8.2, "yang2025qwen3"),
    ModelShape("Qwen3-14B", 40, 8, 128, 14.8, "yang2025qwen3"),
    ModelShape("Qwen3-32B", 64, 8, 128, 32.8, "yang2025qwen3"),
    ModelShape("Llama-2-7B", 32, 32, 128, 6.7, "touvron2023llama2"),
    ModelShape("Llama-3-8B", 32, 8, 128, 8.0, "grattafiori2024llama3"),
    ModelShape("Llama-3-70B", 80, 8, 128, 70.6, "grattafiori2024llama3"),
)}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> int:
    """``2 (K and V) * layers * kv_heads * head_dim * bytes_per_element``."""
    for value, name in ((layers, "layers"), (kv_heads, "kv_heads"), (head_dim, "head_dim"),
                        (bytes_per_element, "bytes_per_element")):
        check_positive_int(value, name)
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def kv_cache_bytes(shape: ModelShape, batch: int, context: int, bytes_per_element: int = 2) -> int:
    """Bytes of cache for ``batch`` sequences of ``context`` tokens each."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    check_positive_int(batch, "batch")
    check_positive_int(context, "context")
    return batch * context * shape.kv_bytes_per_token(bytes_per_element)


def max_cached_tokens(shape: ModelShape, gpu_bytes: int, bytes_per_element: int = 2,
                      weight_bytes_per_param: float = 2.0) -> int:
    """Tokens of cache that fit in ``gpu_bytes`` once the weights are loaded (0 if they do not fit).

    This ignores activations and the allocator's slack, so it is an upper bound.
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    check_positive_int(gpu_bytes, "gpu_bytes")
    if weight_bytes_per_param <= 0:
        raise ValueError(f"weight_bytes_per_param must be positive, got {weight_bytes_per_param}")
    free = gpu_bytes - shape.params_billion * 1e9 * weight_bytes_per_param
    return max(0, int(free // shape.kv_bytes_per_token(bytes_per_element)))
