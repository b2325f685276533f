"""The oracles, in plain torch: what each one-sided program must produce.

All-reduce and all-gather reuse the collectives chapter's float64 sum and ``tensor_split``
cut; the dispatch oracle says which rows each PE must receive from each other PE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives.reference import sum_float64

__all__ = ["all_gather_reference", "dispatch_reference", "sum_float64"]


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
