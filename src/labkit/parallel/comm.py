"""The collectives the parallel layers call, each one logged, so a step's traffic can be counted.

Every strategy of this package communicates through the four functions here
(:func:`all_reduce` and :func:`all_reduce_async`, :func:`all_gather`, :func:`reduce_scatter`, and :func:`send_bytes`
for point-to-point). Each call appends ``(kind, tensor bytes, group size)`` to the
active :class:`CommLog`; :meth:`CommLog.link_bytes` converts the calls into the bytes one
rank puts on its links, with the ring algorithms' factors of
:func:`labkit.collectives.cost.bus_factor` (``2(n-1)/n`` of the tensor for an all-reduce,
``(n-1)/n`` of the *full* tensor for all-gather and reduce-scatter, the whole message for
a send). That is the measured side of the chapter's comparison with
:mod:`labkit.parallel.planner`'s formulas.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..collectives.cost import bus_factor
from ..collectives.reference import torch_all_gather, torch_reduce_scatter


@dataclass
class CommLog:
    """The collective calls one rank made: ``(kind, bytes of the full tensor, group size)``."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)

    def link_bytes(self) -> float:
        """Bytes this rank sent over its links for all the calls, ring algorithms assumed."""
        return sum(nbytes * (1.0 if kind == "send" else bus_factor(kind, n)) for kind, nbytes, n in self.calls)

    def counts(self) -> dict[str, int]:
        """How many calls of each kind."""
        return dict(Counter(kind for kind, _, _ in self.calls))


_active: list[CommLog] = []


@contextlib.contextmanager
def logging_to(log: CommLog):
    """Log every collective of this package made inside the block into ``log``."""
    _active.append(log)
    try:
        yield log
    finally:
        _active.pop()


def _record(kind: str, nbytes: int, group: dist.ProcessGroup | None) -> None:
    if _active:
        _active[-1].calls.append((kind, int(nbytes), dist.get_world_size(group)))


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``t`` over the group, in place."""
    _record("all_reduce", t.numel() * t.element_size(), group)
    dist.all_reduce(t, group=group)
    return t


def all_reduce_async(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Start summing ``t`` over the group, in place; returns the work handle (a DDP bucket's all-reduce)."""
    _record("all_reduce", t.numel() * t.element_size(), group)
    return dist.all_reduce(t, group=group, async_op=True)


def all_gather(shard: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``shard`` concatenated along ``dim``, in rank order."""
    n = dist.get_world_size(group)
    moved = shard.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=shard.dtype, device=shard.device)
    _record("all_gather", out.numel() * out.element_size(), group)
    torch_all_gather(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(full: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice along ``dim`` of ``full`` summed over the group (``dim`` divides evenly)."""
    n = dist.get_world_size(group)
    moved = full.movedim(dim, 0).contiguous()
    if moved.shape[0] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {moved.shape[0]} is not a multiple of {n} ranks")
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=full.dtype, device=full.device)
    _record("reduce_scatter", moved.numel() * moved.element_size(), group)
    torch_reduce_scatter(out, moved, group=group)
    return out.movedim(0, dim)


def send_bytes(t: torch.Tensor) -> None:
    """Log a point-to-point message of ``t`` (the caller sends it)."""
    if _active:
        _active[-1].calls.append(("send", t.numel() * t.element_size(), 2))
