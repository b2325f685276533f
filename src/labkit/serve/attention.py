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

The ``*_reference`` functions are the plain-torch definitions (a loop over sequences that
gathers each one's blocks into a contiguous copy, then SDPA). The public functions check
their arguments and run the split-KV Triton kernel of :mod:`labkit.kvcache.kernels`,
which reads the blocks in place through the block table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import backend
from ..kvcache import FLOAT_DTYPES, kernels
from ..validate import check_same_device, check_tensor
from .paged_cache import gather_kv

INDEX_DTYPES = (torch.int32, torch.int64)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k_new``, ``v_new`` (``[N, kv_heads, head_dim]``) to flat slots ``slot_mapping`` ``[N]``."""
    _check_pools(k_pool, v_pool)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(t, name, ndim=3, dtypes=(k_pool.dtype,))
        if t.shape[1:] != k_pool.shape[2:]:
            raise ValueError(f"{name} must be [N, kv_heads={k_pool.shape[2]}, head_dim={k_pool.shape[3]}], "
                             f"got {tuple(t.shape)}")
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=INDEX_DTYPES)
    if not k_new.shape[0] == v_new.shape[0] == slot_mapping.shape[0]:
        raise ValueError(f"k_new, v_new and slot_mapping must have one row per token, got "
                         f"{k_new.shape[0]}, {v_new.shape[0]} and {slot_mapping.shape[0]}")
    check_same_device(k_pool=k_pool, k_new=k_new, v_new=v_new, slot_mapping=slot_mapping)
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


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, *,
                           scale: float | None = None) -> torch.Tensor:
    """One query per sequence over its ``lengths[b]`` positions, read in place through ``block_tables``.

    ``q``: ``[batch, q_heads, head_dim]``; ``k_pool``, ``v_pool``: ``[num_blocks,
    block_size, kv_heads, head_dim]`` with ``q_heads`` a multiple of ``kv_heads``;
    ``block_tables``: ``[batch, max_blocks]`` int32/int64, whose first ``ceil(lengths[b] /
    block_size)`` entries of row ``b`` are block ids (the rest are never read);
    ``lengths``: ``[batch]``, each in ``[1, max_blocks * block_size]``. Returns ``[batch,
    q_heads, head_dim]`` in ``q``'s dtype. The launch is
    :func:`labkit.kvcache.kernels.paged_config`'s for a capacity of ``max_blocks *
    block_size``: the contiguous kernel's splits and tile, with deeper pipelining for the table load.

    Checking the values of ``lengths`` and ``block_tables`` reads them back to the host
    (one synchronization), which a CUDA graph cannot capture; a graphed model runner calls
    :func:`labkit.kvcache.kernels.paged_split_kv_decode` directly.
    """
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, device=backend.device())
    tables, lengths = _check_paged(q, k_pool, v_pool, block_tables, lengths, q.shape[0])
    scale = _check_scale(scale, q.shape[-1])
    batch = q.shape[0]
    capacity = tables.shape[1] * k_pool.shape[1]
    config = kernels.paged_config(batch, k_pool.shape[2], capacity, head_dim=k_pool.shape[3],
                                   element_size=k_pool.element_size())
    return kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lengths, scale, config)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            lengths: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``q`` ``[N, q_heads, head_dim]``, read in place through ``block_tables``.

    Sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` (``[batch + 1]``
    int32/int64, starting at 0, non-decreasing, ending at ``N``): the last ``n_b`` of its
    ``lengths[b]`` positions, whose K and V are already in the pool, so ``0 <= n_b <=
    lengths[b]``; the earlier positions are its cached prefix. Other arguments as in
    :func:`paged_decode_attention`. Returns ``[N, q_heads, head_dim]``.
    """
    check_tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1, dtypes=INDEX_DTYPES)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
    tables, lengths = _check_paged(q, k_pool, v_pool, block_tables, lengths, batch)
    scale = _check_scale(scale, q.shape[-1])
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    cu = cu_seqlens_q.tolist()
    counts = [end - start for start, end in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or cu[-1] != q.shape[0] or min(counts) < 0:
        raise ValueError(f"cu_seqlens_q must start at 0, never decrease and end at N={q.shape[0]}, got {cu}")
    too_many = [b for b, (n, length) in enumerate(zip(counts, lengths.tolist())) if n > length]
    if too_many:
        b = too_many[0]
        raise ValueError(f"sequence {b} has {counts[b]} queries but only {int(lengths[b])} positions: "
                         f"each sequence's queries are the last of its lengths[b] positions")
    return kernels.paged_prefill(q, k_pool, v_pool, tables, cu_seqlens_q.to(torch.int32).contiguous(), lengths,
                                 max(counts), scale)


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    check_tensor(k_pool, "k_pool", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(v_pool, "v_pool", ndim=4, dtypes=(k_pool.dtype,))
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must match: "
                         f"[num_blocks, block_size, kv_heads, head_dim]")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tuple(t.stride())}")


def _check_paged(q, k_pool, v_pool, block_tables, lengths, batch):
    """Shapes, dtypes, devices and values of the paged kernels' arguments; int32 tables and lengths."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES, device=backend.device())  # where the kernels run
    _check_pools(k_pool, v_pool)
    if k_pool.dtype != q.dtype:
        raise TypeError(f"k_pool and v_pool must have q's dtype {q.dtype}, got {k_pool.dtype}")
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(lengths, "lengths", ndim=1, dtypes=INDEX_DTYPES)
    check_same_device(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, lengths=lengths)
    num_blocks, block_size, kv_heads, head_dim = k_pool.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q's head_dim ({q.shape[2]}) must match the pools' ({head_dim})")
    if q.shape[1] % kv_heads:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({kv_heads})")
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dimension must be contiguous, got strides {tuple(q.stride())}")
    if block_tables.shape[0] != batch or lengths.shape[0] != batch:
        raise ValueError(f"block_tables and lengths must have one row per sequence ({batch}), got "
                         f"{tuple(block_tables.shape)} and {tuple(lengths.shape)}")
    capacity = block_tables.shape[1] * block_size
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"lengths must lie in [1, max_blocks * block_size = {capacity}], got values in [{lo}, {hi}]")
    # Only the blocks a sequence uses must be valid ids; the rest of its row is padding.
    used = torch.arange(block_tables.shape[1], device=lengths.device)[None, :] * block_size < lengths[:, None]
    ids = block_tables[used]
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block_tables must hold block ids in [0, {num_blocks}) for every used block, "
                         f"got values in [{int(ids.min())}, {int(ids.max())}]")
    return block_tables.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous()


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)
