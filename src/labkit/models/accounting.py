"""Parameters, FLOPs and bytes of a Qwen3-style decoder, part by part.

:func:`layer_parts` lists what one decoder layer does to ``tokens`` tokens of one causal
sequence (a prefill, or a training step's forward), in the order it does it, with the
names of Hugging Face's modules; :func:`model_parts` adds the embedding, the final norm and
the LM head. Each :class:`Part` carries

- ``params``: its weights;
- ``flops``: forward floating-point operations (a multiply-add is 2; a matmul of
  ``[T, a] @ [a, b]`` is ``2 T a b``; causal attention's two matmuls see ``T (T + 1) / 2``
  query-key pairs; the elementwise parts count their arithmetic per element);
- ``bytes``: the HBM traffic it cannot avoid when run as one kernel (inputs read once,
  outputs written once, weights read once), in the given element size.

``bytes`` and ``flops`` together say which parts are bound by bandwidth: a part whose
``flops / bytes`` sits far below the GPU's ridge point (hundreds of FLOP per byte on an
H200) takes time in proportion to its bytes, however few FLOPs it does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_positive_int
from .config import DecoderConfig

# Arithmetic per element of the elementwise parts (the FLOP convention of the chapter):
NORM_FLOPS = 4      # square, accumulate, scale by rstd, scale by the weight
ROPE_FLOPS = 3      # x * cos + rotate_half(x) * sin
SWIGLU_FLOPS = 5    # silu(g) = g / (1 + exp(-g)): negate, exp, add, divide; then * up
ADD_FLOPS = 1

GROUPS = ("embedding", "norms", "attention projections", "RoPE", "attention core (SDPA)",
          "residual adds", "MLP matmuls", "SwiGLU activation", "LM head")


@dataclass(frozen=True)
class Part:
    name: str      # HF's module (or operation) name
    group: str     # one of GROUPS
    params: int
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """FLOP per byte of unavoidable traffic."""
        return self.flops / self.bytes if self.bytes else 0.0


def _check(config: DecoderConfig, tokens: int, bytes_per_element: int) -> None:
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    check_positive_int(tokens, "tokens")
    check_positive_int(bytes_per_element, "bytes_per_element")


def _linear(name: str, group: str, tokens: int, d_in: int, d_out: int, es: int) -> Part:
    return Part(name, group, d_in * d_out, 2 * tokens * d_in * d_out, (tokens * (d_in + d_out) + d_in * d_out) * es)


def _norm(name: str, tokens: int, width: int, es: int, rows_per_token: int = 1) -> Part:
    n = tokens * rows_per_token * width
    return Part(name, "norms", width, NORM_FLOPS * n, 2 * n * es + width * es)


def layer_parts(config: DecoderConfig, tokens: int, bytes_per_element: int = 2) -> list[Part]:
    """One decoder layer's parts for ``tokens`` tokens of one causal sequence, in order."""
    _check(config, tokens, bytes_per_element)
    es, t = bytes_per_element, tokens
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hk = config.num_heads, config.num_kv_heads
    q_width, kv_width = hq * d, hk * d
    pairs = t * (t + 1) // 2  # causal: query j sees keys 0..j
    return [
        _norm("input_layernorm", t, h, es),
        _linear("q_proj", "attention projections", t, h, q_width, es),
        _linear("k_proj", "attention projections", t, h, kv_width, es),
        _linear("v_proj", "attention projections", t, h, kv_width, es),
        _norm("q_norm", t, d, es, rows_per_token=hq),
        _norm("k_norm", t, d, es, rows_per_token=hk),
        Part("rotary (q, k)", "RoPE", 0, ROPE_FLOPS * t * (q_width + kv_width), 2 * t * (q_width + kv_width) * es),
        # QK^T and PV, each 2 * d FLOPs per (head, query, visible key); flash attention
        # reads q, k, v once and writes the output once.
        Part("attention (SDPA)", "attention core (SDPA)", 0, 2 * 2 * hq * d * pairs,
             t * (2 * q_width + 2 * kv_width) * es),
        _linear("o_proj", "attention projections", t, q_width, h, es),
        Part("residual add (attention)", "residual adds", 0, ADD_FLOPS * t * h, 3 * t * h * es),
        _norm("post_attention_layernorm", t, h, es),
        _linear("gate_proj", "MLP matmuls", t, h, i, es),
        _linear("up_proj", "MLP matmuls", t, h, i, es),
        Part("act_fn(gate) * up", "SwiGLU activation", 0, SWIGLU_FLOPS * t * i, 3 * t * i * es),
        _linear("down_proj", "MLP matmuls", t, i, h, es),
        Part("residual add (MLP)", "residual adds", 0, ADD_FLOPS * t * h, 3 * t * h * es),
    ]


def model_parts(config: DecoderConfig, tokens: int, bytes_per_element: int = 2) -> list[Part]:
    """Every part of the model: the embedding, ``num_layers`` layers (each part summed over
    the layers), the final norm and the LM head (no weights of its own when tied)."""
    _check(config, tokens, bytes_per_element)
    es, t, h, v = bytes_per_element, tokens, config.hidden_size, config.vocab_size
    layers = [Part(p.name, p.group, p.params * config.num_layers, p.flops * config.num_layers,
                   p.bytes * config.num_layers) for p in layer_parts(config, tokens, bytes_per_element)]
    head = _linear("lm_head", "LM head", t, h, v, es)
    if config.tie_word_embeddings:
        head = Part(head.name, head.group, 0, head.flops, head.bytes)
    # The embedding is a gather: it reads T rows of the table and writes them.
    embed = Part("embed_tokens", "embedding", v * h, 0, 2 * t * h * es)
    return [embed, *layers, _norm("norm", t, h, es), head]


def by_group(parts: list[Part]) -> dict[str, Part]:
    """The parts summed by group, in :data:`GROUPS` order (groups with no part left out)."""
    totals: dict[str, Part] = {}
    for group in GROUPS:
        members = [p for p in parts if p.group == group]
        if members:
            totals[group] = Part(group, group, sum(p.params for p in members), sum(p.flops for p in members),
                                 sum(p.bytes for p in members))
    return totals
