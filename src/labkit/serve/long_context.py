"""The long-context walls in numbers: which keys each query attends under full causal, sliding
window and chunked attention, what that costs in attention FLOPs, and what each layer keeps
in its KV cache.

- *Sliding window* (Mistral 7B's 4096; Gemma 3's local layers): query ``i`` attends keys
  ``i - W + 1 .. i``. A layer keeps only the last ``W`` tokens' K and V (a ring buffer);
  its attention work grows as ``N W`` instead of ``N^2 / 2``.
- *Chunked* (Llama 4's local layers, chunks of 8192): the sequence is cut into chunks of
  ``C`` and a query attends the keys of its own chunk up to itself; a layer keeps at most
  ``C`` tokens; work ``N C / 2``. Unlike a window, the first query of a chunk sees nothing
  before it.
- Models mix them with *global* layers that attend everything (Gemma 3: five local layers
  per global one; Llama 4: every fourth layer global, without RoPE), because a purely local
  model cannot carry information further than ``W`` tokens per layer. The global layers'
  caches still grow with the context, so the memory wall moves, it does not disappear.

:func:`attention_mask` is the dense ``[queries, keys]`` boolean mask (the reference);
:func:`mask_mod` the same rule as a FlexAttention ``mask_mod``, whose block mask lets the
kernel skip every tile the rule leaves empty: the only way a mask saves compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models import DecoderConfig
from ..validate import check_positive_int


def _check_pattern(window: int | None, chunk: int | None) -> None:
    if window is not None:
        check_positive_int(window, "window")
    if chunk is not None:
        check_positive_int(chunk, "chunk")


def attention_mask(num_queries: int, num_keys: int, *, window: int | None = None, chunk: int | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys each query attends: bool ``[num_queries, num_keys]``, the queries being the last
    ``num_queries`` positions of ``num_keys``. Causal always; ``window``: only the last ``window``
    positions up to the query's own; ``chunk``: only positions in the query's chunk of ``chunk``."""
    check_positive_int(num_queries, "num_queries")
    check_positive_int(num_keys, "num_keys")
    if num_queries > num_keys:
        raise ValueError(f"num_queries ({num_queries}) must be at most num_keys ({num_keys}): queries are the "
                         f"last positions")
    _check_pattern(window, chunk)
    q = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k = torch.arange(num_keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    if chunk is not None:
        allowed &= q // chunk == k // chunk
    return allowed


def mask_mod(window: torch.Tensor, chunk: torch.Tensor):
    """The same rule as :func:`attention_mask` for FlexAttention. ``window`` and ``chunk`` are
    0-dim int tensors (a number at least the sequence length turns a limit off); changing them
    in place changes the rule without recompiling the kernel."""
    def allowed(b, h, q, k):
        return (k <= q) & (q - k < window) & (q // chunk == k // chunk)
    return allowed


def attended_pairs(n: int, *, window: int | None = None, chunk: int | None = None) -> int:
    """How many (query, key) pairs a causal self-attention of ``n`` tokens computes under the rule."""
    check_positive_int(n, "n")
    _check_pattern(window, chunk)
    if chunk is not None:
        full, rest = divmod(n, chunk)
        per_chunk = [chunk] * full + ([rest] if rest else [])
        return sum(attended_pairs(c, window=window) for c in per_chunk)
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window  # the first W queries see fewer


def attention_flops(config: DecoderConfig, n: int, *, window: int | None = None, chunk: int | None = None) -> int:
    """Attention FLOPs of one layer's prefill of ``n`` tokens (``QK^T`` and ``PV``, 2 FLOPs a
    multiply-add each): ``4 * pairs * head_dim * num_heads``."""
    return 4 * attended_pairs(n, window=window, chunk=chunk) * config.head_dim * config.num_heads


def layer_patterns(num_layers: int, *, global_every: int | None, window: int | None = None,
                   chunk: int | None = None) -> list[dict]:
    """Each layer's rule: every ``global_every``-th layer (the last of each group) global, the others
    local with ``window`` or ``chunk``; ``global_every=None``: every layer local; ``1``: all global."""
    check_positive_int(num_layers, "num_layers")
    if global_every is not None:
        check_positive_int(global_every, "global_every")
    _check_pattern(window, chunk)
    local = {"window": window, "chunk": chunk}
    return [{"window": None, "chunk": None} if global_every is not None and (i + 1) % global_every == 0 else dict(local)
            for i in range(num_layers)]


def kv_cache_bytes(config: DecoderConfig, context: int, patterns: Sequence[dict] | None = None,
                   bytes_per_element: int = 2) -> int:
    """Bytes of one sequence's KV cache at ``context`` tokens, each layer keeping what its rule can
    still attend: everything (global), the last ``window`` tokens, or the current ``chunk``."""
    check_positive_int(context, "context")
    patterns = patterns if patterns is not None else [{"window": None, "chunk": None}] * config.num_layers
    if len(patterns) != config.num_layers:
        raise ValueError(f"patterns must give one rule per layer ({config.num_layers}), got {len(patterns)}")
    per_token_layer = config.kv_bytes_per_token(bytes_per_element) // config.num_layers
    kept = 0
    for p in patterns:
        limit = min(x for x in (context, p.get("window"), p.get("chunk")) if x is not None)
        kept += limit
    return kept * per_token_layer


__all__ = ["attended_pairs", "attention_flops", "attention_mask", "kv_cache_bytes", "layer_patterns", "mask_mod"]
