"""The oracles: torch.distributed's own collectives, and a float64 sum in one process.

``torch.distributed``'s ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need
sizes that divide by the world size; for other sizes the peer is built from what does
take any size (an all-reduce, or an all-gather of padded shards), so every case we test
is checked against torch's collectives and not against our own arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor forms (the old names warn); torch 2.11 has only the old ones.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


def torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if input.numel() % n == 0:
        _reduce_scatter_single(output.view(-1), input.reshape(-1), group=group)
        return output
    summed = input.reshape(-1).clone()
    dist.all_reduce(summed, group=group)
    output.view(-1).copy_(summed.tensor_split(n)[r])
    return output


def torch_all_gather(output: torch.Tensor, input: torch.Tensor,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    n = dist.get_world_size(group)
    if output.numel() % n == 0:
        _all_gather_single(output.view(-1), input.reshape(-1), group=group)
        return output
    longest = -(-output.numel() // n)
    padded = torch.zeros(longest, dtype=input.dtype, device=input.device)
    padded[: input.numel()] = input.reshape(-1)
    gathered = torch.empty(n * longest, dtype=input.dtype, device=input.device)
    _all_gather_single(gathered, padded, group=group)
    parts = [p[: c.numel()] for p, c in zip(gathered.view(n, longest), output.view(-1).tensor_split(n))]
    output.view(-1).copy_(torch.cat(parts))
    return output


def sum_float64(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact-as-we-can-get all-reduce of every rank's input, in one process."""
    return torch.stack([x.to(torch.float64).reshape(-1) for x in inputs]).sum(0)
