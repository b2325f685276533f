"""Multi-head latent attention (DeepSeek-V2/V3): the module, its cache, and absorbed decode.

>>> model = mla_decoder(config, DEEPSEEK_V3)                      # the book's decoder with MLA
>>> o_latent = mla_decode(q_latent, q_rope, cache, lengths, scale=DEEPSEEK_V3.scale)

:func:`mla_decode` is decode attention with the up-projections absorbed: every head's
query already in latent space (:func:`absorb_query`), the cache one ``[batch, capacity,
kv_lora_rank + rope]`` tensor of latents and rotary keys, read once for all heads by the
Triton kernel of :mod:`labkit.mla.kernels`. :mod:`labkit.mla.reference` holds the
plain-torch definitions (naive and absorbed), :mod:`labkit.mla.memory` what each
attention variant caches per token.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import backend
from ..validate import check_positive_int, check_same_device, check_tensor
from . import kernels
from .memory import MLA_SHAPES, DecodeCost, MLAShape, decode_costs, mla_kv_bytes_per_token
from .module import DEEPSEEK_V3, LatentCache, MLAConfig, MLAttention, mla_decoder
from .reference import (
    absorb_query,
    decompress,
    mla_decode_absorbed_reference,
    mla_decode_naive_reference,
    split_cache,
    unabsorb_output,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, *,
               scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode attention: the attention-weighted latent of every head.

    ``q_latent``: ``[batch, heads, latent]``, the queries moved into latent space
    (``W_UK[h]^T q_nope[h]``); ``q_rope``: ``[batch, heads, rope]``, their rotated part.
    ``cache``: ``[batch, capacity, latent + rope]`` (latent first), rows contiguous, any
    batch stride (a layer of :class:`LatentCache` passes as it is). ``lengths``: ``[batch]``
    int32/int64 in ``[1, capacity]``. ``scale``: the softmax scale, ``(nope + rope) ** -0.5``
    for DeepSeek's widths (not derivable from these shapes). Returns ``[batch, heads, latent]``
    in the queries' dtype; :func:`unabsorb_output` applies ``W_UV``.
    """
    check_tensor(q_latent, "q_latent", ndim=3, dtypes=FLOAT_DTYPES, device=backend.device())
    check_tensor(q_rope, "q_rope", ndim=3, dtypes=(q_latent.dtype,))
    check_tensor(cache, "cache", ndim=3, dtypes=(q_latent.dtype,))
    check_tensor(lengths, "lengths", ndim=1, dtypes=(torch.int32, torch.int64))
    check_same_device(q_latent=q_latent, q_rope=q_rope, cache=cache, lengths=lengths)
    batch, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != (batch, heads):
        raise ValueError(f"q_rope must be [batch={batch}, heads={heads}, rope], got {tuple(q_rope.shape)}")
    if cache.shape[0] != batch or cache.shape[2] != latent + rope:
        raise ValueError(f"cache must be [batch={batch}, capacity, latent + rope = {latent + rope}], "
                         f"got {tuple(cache.shape)}")
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("cache", cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tuple(t.stride())}")
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths must have one entry per sequence ({batch}), got {lengths.shape[0]}")
    capacity = cache.shape[1]
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"lengths must lie in [1, capacity={capacity}], got values in [{lo}, {hi}]")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    config = kernels.default_config(batch, heads, capacity)
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=check_positive_int(num_splits, "num_splits"))
    return kernels.mla_decode_absorbed(q_latent, q_rope, cache, lengths.to(torch.int32).contiguous(),
                                       float(scale), config)


__all__ = [
    "DEEPSEEK_V3", "MLA_SHAPES", "DecodeCost", "LatentCache", "MLAConfig", "MLAShape", "MLAttention", "absorb_query",
    "decode_costs", "decompress", "mla_decode", "mla_decode_absorbed_reference", "mla_decode_naive_reference", "mla_decoder",
    "mla_kv_bytes_per_token", "split_cache", "unabsorb_output",
]
