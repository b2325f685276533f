"""Sequence parallelism: the regions between tensor-parallel matmuls, split along the sequence.

With plain tensor parallelism the norms, residual adds and dropout run on the *whole*
``[b, s, h]`` activation on every rank: the same work ``t`` times, and ``t`` copies of the
activations saved for backward. Korthikanti et al. {cite}`korthikanti2022reducing` split
those regions along the sequence instead. The all-reduce that ended a tensor-parallel
region becomes a reduce-scatter (each rank keeps the sum for its ``s/t`` tokens), and
the identity that started one becomes an all-gather; since an all-reduce *is* a
reduce-scatter followed by an all-gather, the bytes on the links do not change.

Each function is the other's adjoint, so backward swaps them: the gradient of an
all-gather is a reduce-scatter, and the other way round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm

SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(shard, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(partial, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather(grad, SEQUENCE_DIM, ctx.group), None


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[b, s/t, h]`` on each rank -> the whole ``[b, s, h]``; backward reduce-scatters."""
    return _GatherSequence.apply(shard, group)


def reduce_scatter_sequence(partial: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Partial sums ``[b, s, h]`` -> this rank's ``[b, s/t, h]`` of their sum; backward all-gathers."""
    return _ReduceScatterSequence.apply(partial, group)


def sequence_slice(length: int, rank: int, world_size: int) -> slice:
    """The tokens rank ``rank`` holds of a sequence of ``length``: contiguous, ``length / t`` each."""
    if length % world_size:
        raise ValueError(f"sequence parallelism splits the sequence evenly: length {length} is not a "
                         f"multiple of {world_size} ranks")
    per_rank = length // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)
