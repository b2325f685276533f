"""Paged KV storage and the plain-torch paged attention path.

:class:`PagedKVCache` holds, for every layer, K and V of shape
``[num_blocks, block_size, kv_heads, head_dim]``: the pool that
:class:`~labkit.serve.BlockManager` hands out by block id. :meth:`PagedKVCache.sequence`
wraps one sequence's block table in a :class:`SequenceKV`, which has the interface
:class:`labkit.models.Decoder` calls on a cache (``length``, ``append``, ``advance``), so
the book's model runs on paged storage unchanged.

:func:`gather_kv` reads a sequence's keys and values through its block table into a
contiguous ``[1, kv_heads, length, head_dim]`` tensor that the model's own attention
consumes: the plain-torch path, and the definition the kernels are checked against. The
paged kernels of :mod:`labkit.serve.attention` take the same inputs (the pool, block
tables, lengths) and read the blocks in place instead of copying them.
:func:`paged_copy` lays a contiguous cache out as a shuffled pool, so that a paged and a
contiguous kernel can be compared on the same contents.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..models.config import DecoderConfig
from ..validate import check_positive_int


def gather_kv(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, read through its block ``table``.

    ``pool`` is one layer's ``[num_blocks, block_size, kv_heads, head_dim]``; the result is
    ``[1, kv_heads, length, head_dim]``, the layout the model's attention takes.
    """
    _, block_size, heads, head_dim = pool.shape
    blocks = pool.index_select(0, table[: -(-length // block_size)])
    return blocks.reshape(-1, heads, head_dim)[:length].transpose(0, 1).unsqueeze(0)


def paged_copy(cache: torch.Tensor, block_size: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The contents of a contiguous cache ``[batch, kv_heads, capacity, d]`` laid out as a
    pool ``[blocks, block_size, kv_heads, d]`` whose blocks are shuffled (as a free list
    leaves them after some churn), and the block tables ``[batch, capacity / block_size]``
    (int32) that find them: the same contents for a paged and a contiguous kernel.
    """
    if cache.ndim != 4 or cache.shape[2] % block_size:
        raise ValueError(f"cache must be [batch, kv_heads, capacity, d] with capacity a multiple of "
                         f"block_size={block_size}, got {tuple(cache.shape)}")
    batch, kv_heads, capacity, head_dim = cache.shape
    per_seq = capacity // block_size
    blocks = cache.reshape(batch, kv_heads, per_seq, block_size, head_dim).permute(0, 2, 3, 1, 4)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed)).to(cache.device)
    pool = torch.empty(batch * per_seq, block_size, kv_heads, head_dim, dtype=cache.dtype, device=cache.device)
    pool[order] = blocks.reshape(batch * per_seq, block_size, kv_heads, head_dim)
    return pool, order.view(batch, per_seq).to(torch.int32)


class KVStore(NamedTuple):
    """Where one layer's new K and V go: rows ``slot_mapping`` of ``k_rows`` and ``v_rows``
    (the pool's ``[num_blocks * block_size, kv_heads, head_dim]`` views), and the buffer
    for the queries (``None``: a new tensor). What :func:`labkit.fused.qkv_norm_rope` writes."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    slot_mapping: torch.Tensor
    queries: torch.Tensor | None = None


class PagedKVCache:
    """The KV pool: ``k``, ``v`` of shape ``[layers, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        check_positive_int(num_blocks, "num_blocks")
        check_positive_int(block_size, "block_size")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def store(self, layer: int, slot_mapping: torch.Tensor, queries: torch.Tensor | None = None) -> KVStore:
        """Layer ``layer``'s pool as flat slot rows, for tokens going to ``slot_mapping``."""
        k, v = self.k[layer], self.v[layer]
        return KVStore(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]), slot_mapping, queries)

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's K and V in every layer (a copy-on-write the block manager asked for)."""
        self.k[:, destination] = self.k[:, source]
        self.v[:, destination] = self.v[:, source]

    def sequence(self, table: list[int], length: int) -> SequenceKV:
        """The cache view of one sequence whose first ``length`` tokens are stored in ``table``."""
        return SequenceKV(self, table, length)


class SequenceKV:
    """One sequence's slice of a :class:`PagedKVCache`, with the Decoder's cache interface.

    The block table must already have room for the tokens the forward pass appends (the
    scheduler allocates before it runs the model).
    """

    def __init__(self, cache: PagedKVCache, table: list[int], length: int) -> None:
        if length < 0 or -(-length // cache.block_size) > len(table):
            raise ValueError(f"{length} tokens do not fit a table of {len(table)} blocks of {cache.block_size}")
        self.cache = cache
        self.length = length
        self.table = torch.tensor(table, dtype=torch.int64, device=cache.k.device)

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k_new``, ``v_new`` (``[1, kv_heads, new, head_dim]``) after the stored tokens;
        return K and V of all ``length + new`` positions."""
        if k_new.ndim != 4 or k_new.shape[0] != 1 or k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must both be [1, kv_heads, new, head_dim], "
                             f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        end = self.length + k_new.shape[2]
        block_size = self.cache.block_size
        if -(-end // block_size) > len(self.table):
            raise ValueError(f"{end} tokens do not fit a table of {len(self.table)} blocks of {block_size}")
        positions = torch.arange(self.length, end, device=self.table.device)
        blocks, slots = self.table[positions // block_size], positions % block_size
        self.cache.k[layer, blocks, slots] = k_new[0].transpose(0, 1)
        self.cache.v[layer, blocks, slots] = v_new[0].transpose(0, 1)
        return gather_kv(self.cache.k[layer], self.table, end), gather_kv(self.cache.v[layer], self.table, end)

    def advance(self, n: int) -> None:
        """Count ``n`` appended positions as stored (after every layer has appended them)."""
        self.length += check_positive_int(n, "n")
