"""Decode attention against a KV cache, and what the cache costs in memory.

>>> out = decode_attention(q, k_cache, v_cache, lengths)   # q [B, Hq, D], caches [B, Hkv, L, D]

One query token per sequence attends to the first ``lengths[b]`` positions of its cache;
the Triton kernels (:mod:`labkit.kvcache.kernels`) deal the cache's tiles out to several
programs per sequence (flash-decoding) and merge their results by log-sum-exp.
:mod:`labkit.kvcache.memory` holds the bytes-per-token arithmetic and the real models' shapes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import backend
from ..validate import check_positive_int, check_same_device, check_tensor
from . import kernels
from .memory import MODEL_SHAPES, ModelShape, kv_bytes_per_token, kv_cache_bytes, max_cached_tokens
from .reference import combine_partials, decode_attention_reference, split_partials

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, scale: float | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its cached keys and values.

    ``q``: ``[batch, q_heads, head_dim]``. ``k_cache``, ``v_cache``: ``[batch, kv_heads,
    capacity, head_dim]``, any strides with the last dimension contiguous (so views of a
    preallocated cache pass as they are); ``q_heads`` a multiple of ``kv_heads`` (GQA).
    ``lengths``: ``[batch]`` int32/int64, each in ``[1, capacity]``; positions past a
    sequence's length are never read. ``scale`` defaults to ``head_dim ** -0.5``;
    ``num_splits`` (programs per sequence and KV head) to
    :func:`labkit.kvcache.kernels.default_config`'s choice. Returns ``[batch, q_heads,
    head_dim]`` in ``q``'s dtype.

    Checking ``lengths``' values reads them back to the host (one synchronization), which
    a CUDA graph cannot capture; benchmarks and the graphed decoder call
    :func:`labkit.kvcache.kernels.split_kv_decode` directly.
    """
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, device=backend.device())  # where the kernels run
    check_tensor(k_cache, "k_cache", ndim=4, dtypes=(q.dtype,))
    check_tensor(v_cache, "v_cache", ndim=4, dtypes=(q.dtype,))
    check_tensor(lengths, "lengths", ndim=1, dtypes=(torch.int32, torch.int64))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths)
    batch, q_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match")
    if (k_cache.shape[0], k_cache.shape[3]) != (batch, head_dim):
        raise ValueError(f"caches must be [batch={batch}, kv_heads, capacity, head_dim={head_dim}], "
                         f"got {tuple(k_cache.shape)}")
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tuple(t.stride())}")
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths must have one entry per sequence ({batch}), got {lengths.shape[0]}")
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"lengths must lie in [1, capacity={capacity}], got values in [{lo}, {hi}]")
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    config = kernels.default_config(batch, kv_heads, capacity)
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=check_positive_int(num_splits, "num_splits"))
    return kernels.split_kv_decode(q, k_cache, v_cache, lengths.to(torch.int32).contiguous(), float(scale), config)


__all__ = [
    "MODEL_SHAPES", "ModelShape", "combine_partials", "decode_attention", "decode_attention_reference",
    "kv_bytes_per_token", "kv_cache_bytes", "max_cached_tokens", "split_partials",
]
