"""The book's model, described by one frozen dataclass, and the sizes chapters use.

The fields are the handful that fix a Qwen3-style dense decoder's shapes; their names
say what they are rather than copying Hugging Face's (``num_layers``, not
``num_hidden_layers``). :func:`labkit.models.hf_config_kwargs` translates to HF's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import backend
from ..validate import check_positive_int


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes and constants of a Qwen3-style decoder (RMSNorm, RoPE, GQA with q/k norm, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40_960

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            check_positive_int(getattr(self, name), name)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise TypeError(f"tie_word_embeddings must be a bool, got {type(self.tie_word_embeddings).__name__}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA); 1 is plain multi-head attention."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes one token adds to the KV cache: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_parameters(self) -> int:
        """Weights in the model (the LM head counted once when tied to the embedding)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


# Odd sizes on purpose (vocab 251, hidden 80, intermediate 136): nothing in the model may
# quietly assume a power of two. Small enough that the interpreter runs it in milliseconds.
TINY = DecoderConfig(
    vocab_size=251, hidden_size=80, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=136, rope_theta=10_000.0, tie_word_embeddings=True,
)

# The book's model at GPU size: Qwen3-4B's layer shapes (hidden 2560, 32 query heads and
# 8 KV heads of 128, SwiGLU 9728, tied 151936-token embedding) with 8 layers instead of 36,
# so benchmarks stay within a minute and a few GB.
BOOK_GPU = DecoderConfig(
    vocab_size=151_936, hidden_size=2560, num_layers=8, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
)


def _qwen3(hidden: int, layers: int, heads: int, intermediate: int, tied: bool) -> DecoderConfig:
    return DecoderConfig(vocab_size=151_936, hidden_size=hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=8, head_dim=128, intermediate_size=intermediate, tie_word_embeddings=tied)


# The dense Qwen3 releases' shapes, from their config.json files on the Hugging Face Hub
# (every one has 8 KV heads of 128 and a 151936-token vocabulary; the small ones tie the
# LM head to the embedding). Accounting and benchmarks use them; nothing is downloaded.
QWEN3_SIZES: dict[str, DecoderConfig] = {
    "Qwen3-0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "Qwen3-1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "Qwen3-4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "Qwen3-8B": _qwen3(4096, 36, 32, 12288, tied=False),
    "Qwen3-14B": _qwen3(5120, 40, 40, 17408, tied=False),
    "Qwen3-32B": _qwen3(5120, 64, 64, 25600, tied=False),
}


def book_config() -> DecoderConfig:
    """The book's model at the size this machine runs: :data:`BOOK_GPU` on a GPU, :data:`TINY` on the CPU."""
    return backend.pick(cpu=TINY, gpu=BOOK_GPU)
