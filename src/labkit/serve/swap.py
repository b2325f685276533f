"""The CPU-side block store that preemption by swap copies KV blocks to and back from.

:class:`SwapSpace` holds K and V for ``num_blocks`` CPU blocks in the device pool's layout
(``[layers, blocks, block_size, kv_heads, head_dim]``, in pinned memory when the pool is on
a GPU, so the copies can run at PCIe speed). Its own :class:`~labkit.serve.BlockManager`
numbers those blocks; the scheduler allocates from it and lists each step's
``(source, destination)`` copies, which :meth:`SwapSpace.swap_out` and
:meth:`SwapSpace.swap_in` carry out, every layer in one indexed copy per direction.
"""

from __future__ import annotations

import torch

from ..validate import check_positive_int
from .block_manager import BlockManager
from .paged_cache import PagedKVCache


class SwapSpace:
    """``num_blocks`` CPU blocks shaped like ``cache``'s, and the manager that hands them out."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        check_positive_int(num_blocks, "num_blocks")
        shape = (cache.k.shape[0], num_blocks, *cache.k.shape[2:])
        pin = cache.k.device.type == "cuda"
        self.k = torch.zeros(shape, dtype=cache.k.dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=cache.v.dtype, pin_memory=pin)
        self.blocks = BlockManager(num_blocks, cache.block_size)

    def swap_out(self, cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: ``pairs`` of ``(device block, CPU block)``."""
        if pairs:
            device_ids, cpu_ids = zip(*pairs)
            device_index = torch.tensor(device_ids, device=cache.k.device)
            self.k[:, list(cpu_ids)] = cache.k[:, device_index].to("cpu")
            self.v[:, list(cpu_ids)] = cache.v[:, device_index].to("cpu")

    def swap_in(self, cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: ``pairs`` of ``(CPU block, device block)``."""
        if pairs:
            cpu_ids, device_ids = zip(*pairs)
            device_index = torch.tensor(device_ids, device=cache.k.device)
            cache.k[:, device_index] = self.k[:, list(cpu_ids)].to(cache.k.device, non_blocking=True)
            cache.v[:, device_index] = self.v[:, list(cpu_ids)].to(cache.v.device, non_blocking=True)
