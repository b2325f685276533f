"""Where a decoder keeps the keys and values of the tokens it has already seen.

Both caches hold, for every layer, K and V of shape ``[batch, kv_heads, length, head_dim]``
and answer one call per layer per forward: :meth:`append` the new tokens' K and V, get back
everything cached so far. The model calls :meth:`advance` once all layers have appended.

- :class:`KVCache` preallocates ``capacity`` positions once; appending writes the new
  rows in place and returns views: O(new tokens) bytes per step. This is what a serving
  engine does (in fixed-size pages rather than one slab; see the PagedAttention chapter).
- :class:`GrowingKVCache` concatenates: every step copies the whole cache into a new
  tensor, O(length) bytes per step, plus an allocation. It is the obvious first version
  and the chapter measures what it costs.
- :class:`StaticKVCache` is a :class:`KVCache` whose one-token step has the same shapes
  and addresses at every position, so a CUDA graph can capture it once
  (:class:`labkit.models.GraphedDecoder`).
"""

from __future__ import annotations

import torch

from ..validate import check_positive_int, check_tensor
from .config import DecoderConfig


def _check_new_kv(cache_shape: tuple[int, int, int], layer: int, num_layers: int,
                  k_new: torch.Tensor, v_new: torch.Tensor) -> int:
    """Validate one append; return the number of new positions."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    check_tensor(k_new, "k_new", ndim=4)
    check_tensor(v_new, "v_new", ndim=4)
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} must match")
    batch, heads, head_dim = cache_shape
    b, h, _, d = k_new.shape
    if (b, h, d) != (batch, heads, head_dim):
        raise ValueError(
            f"new K/V must be [batch={batch}, kv_heads={heads}, new, head_dim={head_dim}], "
            f"got {tuple(k_new.shape)}"
        )
    return k_new.shape[2]


class KVCache:
    """A preallocated cache: ``k``, ``v`` of shape ``[layers, batch, kv_heads, capacity, head_dim]``.

    Positions ``>= length`` hold whatever the allocator left there and are never read.
    """

    def __init__(self, config: DecoderConfig, batch: int, capacity: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        check_positive_int(batch, "batch")
        check_positive_int(capacity, "capacity")
        shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the whole capacity, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k_new``, ``v_new`` (``[batch, kv_heads, new, head_dim]``) after the cached
        positions of ``layer``; return views of all ``length + new`` positions."""
        _, batch, heads, _, head_dim = self.k.shape
        n = _check_new_kv((batch, heads, head_dim), layer, self.k.shape[0], k_new, v_new)
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"cache full: {self.length} cached + {n} new > capacity {self.capacity}")
        self.k[layer, :, :, self.length:end] = k_new
        self.v[layer, :, :, self.length:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Count ``n`` appended positions as cached (after every layer has appended them)."""
        check_positive_int(n, "n")
        if self.length + n > self.capacity:
            raise ValueError(f"cannot advance {n} past capacity {self.capacity} (length {self.length})")
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (to re-time one step, or reject draft tokens)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.length = length


class StaticKVCache(KVCache):
    """A preallocated cache whose one-token step is the same sequence of kernels every time.

    A :class:`KVCache` step writes at ``[length]`` and returns views of ``[:length + 1]``:
    a position and a shape that the host computes anew for each token, which a captured
    graph would freeze. Here the step reads its position from device tensors instead:
    ``position`` (``[1]`` int64), where the new token's K and V go, and ``lengths``
    (``[batch]`` int32), how many positions attention reads, the new one included. A
    one-token append writes with ``index_copy_`` at ``position`` and returns views of the
    *whole* capacity; the decode kernel reads no position past ``lengths``. Call
    :meth:`stage_step` before each step, outside any capture: it copies the host's
    ``length`` into those tensors, as a serving engine copies a step's inputs into its
    graph's static buffers. Several tokens at once (a prefill) append as in a KVCache.
    """

    def __init__(self, config: DecoderConfig, batch: int, capacity: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(config, batch, capacity, dtype=dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.lengths = torch.ones(batch, dtype=torch.int32, device=device)
        self._staged_at: int | None = None  # the length the device tensors were last staged for

    def stage_step(self) -> None:
        """Point the next one-token step at position ``length``."""
        if self.length >= self.capacity:
            raise ValueError(f"cache full: {self.length} cached, capacity {self.capacity}")
        self.position.fill_(self.length)
        self.lengths.fill_(self.length + 1)
        self._staged_at = self.length

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill as :meth:`KVCache.append`; one token at ``position``, returning the whole capacity."""
        _, batch, heads, _, head_dim = self.k.shape
        if _check_new_kv((batch, heads, head_dim), layer, self.k.shape[0], k_new, v_new) != 1:
            return super().append(layer, k_new, v_new)
        if self._staged_at != self.length:
            raise RuntimeError(f"stage_step() must precede each one-token step (staged for length "
                               f"{self._staged_at}, length is {self.length})")
        self.k[layer].index_copy_(2, self.position, k_new)
        self.v[layer].index_copy_(2, self.position, v_new)
        return self.k[layer], self.v[layer]


class GrowingKVCache:
    """The concatenating cache: each append builds new tensors one step longer (``torch.cat``)."""

    def __init__(self, config: DecoderConfig, batch: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        check_positive_int(batch, "batch")
        empty = torch.empty(batch, config.num_kv_heads, 0, config.head_dim, dtype=dtype, device=device)
        self.k = [empty] * config.num_layers
        self.v = [empty] * config.num_layers
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, _, head_dim = self.k[0].shape
        _check_new_kv((batch, heads, head_dim), layer, len(self.k), k_new, v_new)
        self.k[layer] = torch.cat([self.k[layer], k_new], dim=2)
        self.v[layer] = torch.cat([self.v[layer], v_new], dim=2)
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        check_positive_int(n, "n")
        if any(t.shape[2] != self.length + n for t in self.k):
            raise ValueError(f"every layer must have appended {n} positions before advance")
        self.length += n

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.k = [t[:, :, :length] for t in self.k]
        self.v = [t[:, :, :length] for t in self.v]
        self.length = length
