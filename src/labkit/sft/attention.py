"""Attention over packed documents: causal within a document, nothing across.

The book's :class:`~labkit.models.Decoder` runs a packed batch as one row of ``N`` tokens
with ``positions`` ``[N]`` and an object whose ``attend(layer, q, k, v)`` computes the
attention (the serving engine's packed batches use the same door). :class:`PackedAttention`
is that object for training, with two interchangeable backends:

- ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention` with the explicit
  ``[N, N]`` block-diagonal causal mask. Simple and exact, but an explicit mask keeps
  SDPA off its flash kernel and costs ``N^2`` bits: fine for the CPU, not at 32k tokens.
- ``"flash"``: the FlashAttention chapter's Triton kernel (:func:`labkit.attention.flash_attention`),
  causal, once per document slice ``cu_seqlens[i]:cu_seqlens[i+1]``. Same numbers, no
  mask in memory. FlashAttention's ``flash_attn_varlen_func`` does this in *one* launch:
  its grid walks (document, query tile) pairs read from ``cu_seqlens``, so short documents
  cost no launches of their own. Ours launches per document; the kernels' autotuner keys
  on power-of-two buckets of the length, so a batch's many lengths share a few tunings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import attention as flash
from ..validate import check_choice, check_tensor
from .data import block_diagonal_causal_mask, cu_seqlens_from_positions

BACKENDS = ("sdpa", "flash")


class PackedAttention:
    """Block-diagonal causal attention for a flat row whose ``position_ids`` restart per document."""

    def __init__(self, position_ids: torch.Tensor, backend: str = "sdpa") -> None:
        check_tensor(position_ids, "position_ids", ndim=1, dtypes=(torch.int32, torch.int64))
        check_choice(backend, "backend", BACKENDS)
        self.backend = backend
        self.cu_seqlens = cu_seqlens_from_positions(position_ids).tolist()
        if backend == "sdpa":
            lengths = torch.diff(torch.tensor(self.cu_seqlens))
            document_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(position_ids.device)
            self.mask = block_diagonal_causal_mask(document_ids)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[1, heads, N, d]``, ``k``/``v`` ``[1, kv_heads, N, d]`` -> ``[1, heads, N, d]``."""
        if q.shape[2] != self.cu_seqlens[-1]:
            raise ValueError(f"q has {q.shape[2]} tokens, the packed row {self.cu_seqlens[-1]}")
        if self.backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=True)
        bounds = zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])
        return torch.cat([flash.flash_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True)
                          for s, e in bounds], dim=2)
