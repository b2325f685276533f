"""The oracles, in plain torch: what each one-sided program must produce.

All-reduce and all-gather reuse the collectives chapter's float64 sum and ``tensor_split``
cut; the dispatch oracle says which rows each PE must receive from each other PE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives.reference import sum_float64

__all__ = ["all_gather_reference", "dispatch_reference", "sum_float64", "two_sided_dispatch"]


def all_gather_reference(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([s.reshape(-1) for s in shards])


def dispatch_reference(tokens: Sequence[torch.Tensor], dest: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``out[d][s]``: the rows of PE ``s`` that go to PE ``d`` (a row once per PE, in token order)."""
    n = len(tokens)
    out = [[] for _ in range(n)]
    for d in range(n):
        for s in range(n):
            keep = (dest[s] == d).any(dim=1)
            out[d].append(tokens[s][keep])
    return out


def two_sided_dispatch(tokens: Sequence[torch.Tensor], dest: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The MoE chapter's two-sided dispatch on this rank of a process group: ``out[s]`` = rows from rank ``s``.

    Run on every rank (``labkit.collectives.launch.run``) with every rank's inputs: an
    all-to-all of counts, the counts to the host (``tolist``: the synchronisation one-sided
    removes), then the rows with :func:`labkit.moe.parallel.all_to_all_rows`, torch's
    ``all_to_all_single`` underneath.
    """
    import torch.distributed as dist

    from ..moe.parallel import all_to_all_rows

    rank, n = dist.get_rank(), dist.get_world_size()
    x, d = tokens[rank], dest[rank]
    masks = [(d == p).any(dim=1) for p in range(n)]
    rows = torch.cat([x[m] for m in masks])
    send_counts = torch.tensor([int(m.sum()) for m in masks], dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    recv = recv_counts.tolist()
    return list(all_to_all_rows(rows, send_counts.tolist(), recv).split(recv))
