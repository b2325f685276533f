"""How a group of parameters is cut into ``N`` equal shards: FSDP1's flat cut and FSDP2's per-parameter cut.

Both layouts turn the group's tensors into one buffer of ``N * shard_numel`` elements,
rank ``r``'s shard being elements ``[r * shard_numel, (r + 1) * shard_numel)``, so that one
``all_gather_into_tensor`` rebuilds every parameter and one ``reduce_scatter_tensor``
hands each rank the summed gradient of its shard. They differ in which elements a rank owns:

- :class:`FlatLayout` (ZeRO, FSDP1's ``FlatParameter``): the tensors are concatenated and
  the concatenation is cut in ``N`` (padded at the end). A parameter may straddle two
  ranks, and a rank's shard is a slice of a flat vector that no longer knows the
  parameters' shapes.
- :class:`PerParameterLayout` (FSDP2's ``DTensor`` with ``Shard(0)``): every parameter is
  cut along its first dimension as ``torch.chunk`` cuts it (``ceil(rows / N)`` rows each,
  the last ranks possibly fewer or none), and each chunk is padded to that many rows. A
  rank owns whole rows of every parameter, which stays a tensor of its own
  (:meth:`local_rows`): it can be saved, loaded, frozen or given its own optimizer
  settings without touching the others. The cost is the copy-out after each all-gather
  (the gathered buffer is in rank order, each parameter's rows spread over it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..validate import check_positive_int


def _check_tensors(tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name} must be a non-empty sequence of tensors, got {type(tensors).__name__}")
    return tensors


class FlatLayout:
    """The tensors of ``shapes``, concatenated and cut into ``world_size`` equal shards."""

    kind = "flat"

    def __init__(self, shapes: Sequence[torch.Size], world_size: int) -> None:
        self.world_size = check_positive_int(world_size, "world_size")
        self.shapes = [torch.Size(s) for s in shapes]
        if not self.shapes:
            raise ValueError("a layout needs at least one tensor shape")
        self.numels = [s.numel() for s in self.shapes]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world_size)
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The gather-order buffer of ``tensors`` (``padded_numel`` elements, padding zero)."""
        tensors = _check_tensors(tensors, "tensors")
        out = tensors[0].new_zeros(self.padded_numel) if out is None else out
        out[self.numel:].zero_()
        for t, offset, numel in zip(tensors, self.offsets, self.numels):
            out[offset:offset + numel].copy_(t.reshape(-1))
        return out

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a gathered buffer shaped like the tensors: no copy."""
        return [buffer[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_of(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        return buffer[rank * self.shard_numel:(rank + 1) * self.shard_numel]


class PerParameterLayout:
    """Each tensor of ``shapes`` cut on dim 0 into ``world_size`` padded chunks (FSDP2's ``Shard(0)``)."""

    kind = "per-parameter"

    def __init__(self, shapes: Sequence[torch.Size], world_size: int) -> None:
        self.world_size = check_positive_int(world_size, "world_size")
        self.shapes = [torch.Size(s) if len(s) else torch.Size([1]) for s in shapes]
        if not self.shapes:
            raise ValueError("a layout needs at least one tensor shape")
        self.numels = [s.numel() for s in self.shapes]
        self.numel = sum(self.numels)
        # torch.chunk's cut: ceil(rows / N) rows per rank; FSDP2 pads every chunk to it
        self.chunk_rows = [-(-s[0] // world_size) for s in self.shapes]
        self.row_numels = [s[1:].numel() for s in self.shapes]
        self.chunk_numels = [r * w for r, w in zip(self.chunk_rows, self.row_numels)]
        self.shard_numel = sum(self.chunk_numels)
        self.chunk_offsets = [sum(self.chunk_numels[:i]) for i in range(len(self.shapes))]

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def rows_of(self, index: int, rank: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of tensor ``index`` that ``rank`` owns."""
        rows, chunk = self.shapes[index][0], self.chunk_rows[index]
        return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        tensors = _check_tensors(tensors, "tensors")
        out = tensors[0].new_zeros(self.padded_numel) if out is None else out.zero_()
        by_rank = out.view(self.world_size, self.shard_numel)
        for i, t in enumerate(tensors):
            rows = t.reshape(self.shapes[i][0], -1)
            for rank in range(self.world_size):
                start, stop = self.rows_of(i, rank)
                if stop > start:
                    at = self.chunk_offsets[i]
                    by_rank[rank, at:at + (stop - start) * self.row_numels[i]].copy_(rows[start:stop].reshape(-1))
        return out

    def unpack(self, buffer: torch.Tensor, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The tensors, copied out of a gathered buffer (into ``out`` when given)."""
        by_rank = buffer.view(self.world_size, self.shard_numel)
        result = [buffer.new_empty(s) for s in self.shapes] if out is None else list(out)
        for i, t in enumerate(result):
            rows = t.view(self.shapes[i][0], -1)
            for rank in range(self.world_size):
                start, stop = self.rows_of(i, rank)
                if stop > start:
                    at = self.chunk_offsets[i]
                    rows[start:stop].copy_(by_rank[rank, at:at + (stop - start) * self.row_numels[i]]
                                           .view(stop - start, -1))
        return result

    def shard_of(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        return buffer[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def local_rows(self, shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of a rank's shard, one per tensor: its own rows, shaped (what ``DTensor.to_local()`` is)."""
        views = []
        for i, shape in enumerate(self.shapes):
            start, stop = self.rows_of(i, rank)
            at = self.chunk_offsets[i]
            views.append(shard[at:at + (stop - start) * self.row_numels[i]].view(stop - start, *shape[1:]))
        return views


LAYOUTS = {"flat": FlatLayout, "per-parameter": PerParameterLayout}
