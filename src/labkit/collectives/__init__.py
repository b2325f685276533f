"""Collectives from scratch: ring reduce-scatter, all-gather and all-reduce, and
recursive-doubling all-reduce, on ``torch.distributed`` point-to-point sends and receives.

The functions mirror torch's: ``ring_all_reduce(t)`` sums ``t`` across ranks in place like
``dist.all_reduce(t)``; ``ring_reduce_scatter(out, inp)`` and ``ring_all_gather(out, inp)``
take the arguments of ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, but any
size works: shards are cut as ``torch.tensor_split`` cuts (the first ``numel % n`` shards
one element longer). The reduction is a sum. Call them inside a process group
(:func:`labkit.collectives.launch.run`, or torchrun and ``launch.init_from_torchrun``).

Like NCCL's, these are collective calls: every rank of the group must make the same call
with the same sizes, or the ring waits until the group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..validate import check_tensor, dtype_name
from . import algorithms, schedule
from .algorithms import Peers

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)

__all__ = [
    "SUPPORTED_DTYPES", "recursive_doubling_all_reduce", "ring_all_gather", "ring_all_reduce",
    "ring_reduce_scatter", "shard_numel",
]


def _check_data(t: object, name: str) -> torch.Tensor:
    return check_tensor(t, name, dtypes=SUPPORTED_DTYPES, contiguous=True, nonempty=False)


def _peers(group: object, *tensors: torch.Tensor) -> Peers:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("no process group: call this on ranks started by "
                           "labkit.collectives.launch.run, or under torchrun after launch.init_from_torchrun()")
    if dist.get_backend(group) == "nccl":
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"the NCCL backend moves CUDA tensors; got a tensor on {t.device}")
    return Peers.of(group)


def _check_pair(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"output has dtype {dtype_name(output.dtype)} but input has {dtype_name(input.dtype)}")
    if output.device != input.device:
        raise ValueError(f"output is on {output.device} but input is on {input.device}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.numel() and b.numel()) or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def shard_numel(numel: int, world_size: int, rank: int) -> int:
    """How many elements rank ``rank`` owns of a tensor of ``numel`` (``tensor_split``'s cut)."""
    start, stop = schedule.chunk_bounds(numel, world_size)[rank]
    return stop - start


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` across the group's ranks, in place, by a ring: reduce-scatter + all-gather."""
    _check_data(tensor, "tensor")
    return algorithms.ring_all_reduce_(tensor.view(-1), _peers(group, tensor)).view(tensor.shape)


def recursive_doubling_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` across the group's ranks, in place, in ``ceil(log2 n)`` whole-tensor exchanges."""
    _check_data(tensor, "tensor")
    return algorithms.recursive_doubling_all_reduce_(tensor.view(-1), _peers(group, tensor)).view(tensor.shape)


def _check_shard_pair(output: torch.Tensor, input: torch.Tensor, group: object, *, shard: str) -> Peers:
    """Check an (output, input) pair of which one (``shard``) is this rank's shard of the other."""
    _check_data(output, "output")
    _check_data(input, "input")
    _check_pair(output, input)
    peers = _peers(group, output, input)
    part, whole = (output, input) if shard == "output" else (input, output)
    whole_name = "input" if shard == "output" else "output"
    want = shard_numel(whole.numel(), peers.size, peers.rank)
    if part.numel() != want:
        raise ValueError(f"{shard} must hold rank {peers.rank}'s shard of the {whole.numel()} elements of "
                         f"{whole_name} over {peers.size} ranks, {want} elements; got {part.numel()}")
    return peers


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``output`` = this rank's shard of ``input`` summed over ranks; ``input`` is left as it was."""
    peers = _check_shard_pair(output, input, group, shard="output")
    own = input.view(-1).tensor_split(peers.size)[peers.rank]
    if _overlap(output, input) and output.data_ptr() != own.data_ptr():
        raise ValueError("output overlaps input other than as this rank's own shard of it; "
                         "partial sums would overwrite data still to be sent")
    algorithms.ring_reduce_scatter_(input.view(-1), output.view(-1), peers)
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``output`` = every rank's ``input`` shard, concatenated in rank order."""
    peers = _check_shard_pair(output, input, group, shard="input")
    flat = output.view(-1)
    flat.tensor_split(peers.size)[peers.rank].copy_(input.view(-1))
    algorithms.ring_all_gather_(flat, peers)
    return output
