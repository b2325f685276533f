"""Attention over the paged KV pool: the interface the engine's batched forward calls.

A step of the engine packs every scheduled sequence's new tokens into one flat batch of
``N`` tokens. Three operations touch the pool (one layer's K or V pool is
``[num_blocks, block_size, kv_heads, head_dim]``):

- :func:`write_kv`: store the ``N`` new tokens' K and V at their slots
  (``slot = block_id * block_size + offset``; vLLM's ``reshape_and_cache``).
- :func:`paged_decode_attention`: one query per sequence over its first ``lengths[b]``
  positions, read through its row of ``block_tables``.
- :func:`paged_prefill_attention`: ``n_b`` queries per sequence (packed, with
  ``cu_seqlens_q``), the last ``n_b`` of its ``lengths[b]`` positions, causal. A fresh
  prefill, a chunk of a long prompt and a recompute after preemption are all this case.

The functions here are the plain-torch definitions (a loop over sequences that gathers
each one's blocks); the Triton kernels that replace them read the blocks in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged_cache import gather_kv


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k_new``, ``v_new`` (``[N, kv_heads, head_dim]``) to flat slots ``slot_mapping`` ``[N]``."""
    num_blocks, block_size = k_pool.shape[:2]
    k_pool.view(num_blocks * block_size, *k_pool.shape[2:])[slot_mapping] = k_new
    v_pool.view(num_blocks * block_size, *v_pool.shape[2:])[slot_mapping] = v_new


def paged_prefill_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                      lengths: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``q`` ``[N, q_heads, head_dim]`` over the pool.

    Sequence ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``: the last ones of its
    ``lengths[b]`` positions, whose K and V are already in the pool. Returns ``[N, q_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    starts, ends = cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:]
    for b, (start, end, length) in enumerate(zip(starts, ends, lengths.tolist())):
        k = gather_kv(k_pool, block_tables[b], length)
        v = gather_kv(v_pool, block_tables[b], length)
        queries = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, q_heads, n, head_dim]
        new = end - start
        mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - new, length, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                     block_tables: torch.Tensor, lengths: torch.Tensor, *,
                                     scale: float | None = None) -> torch.Tensor:
    """One query per sequence, ``q`` ``[batch, q_heads, head_dim]``, over its ``lengths[b]`` positions."""
    batch = q.shape[0]
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, cu_seqlens_q, lengths, scale=scale)


# The engine calls these names; the paged-attention chapter puts its Triton kernels behind them.
paged_decode_attention = paged_decode_attention_reference
paged_prefill_attention = paged_prefill_attention_reference
