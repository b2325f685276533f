"""The collectives ZeRO and FSDP call, with every byte counted.

:class:`Communicator` is what the sharded wrappers talk through: ``reduce_scatter`` for
gradients, ``all_gather`` for parameters. Each call is logged as a :class:`Transfer`
(which collective, the tensor's bytes, and the bytes this rank sends doing it with a ring),
so a step's traffic is *counted* from the calls the code really made, and the chapter
compares that count with the formula of :func:`labkit.zero.memory.traffic_per_rank`.

Two implementations: ``"torch"`` calls torch.distributed's tensor collectives (gloo or
NCCL; asynchronous calls return the work handle, which is what prefetching needs), and
``"ring"`` calls the ring algorithms built in the collectives chapter
(:mod:`labkit.collectives`), which are synchronous.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..collectives import ring_all_gather, ring_reduce_scatter
from ..validate import check_choice, dtype_name
from .memory import ring_bytes_sent

IMPLEMENTATIONS = ("torch", "ring")
# torch.distributed's tensor collectives by their names in 2.11 and 2.13, and which tensor is the full one
_TORCH_TENSOR_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
                             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}
# torch 2.13 renamed the tensor forms (the old names warn); torch 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Transfer:
    collective: str
    tensor_bytes: int
    sent_bytes: float
    tag: str


class _Done:
    """The handle of a call that already finished (the ring is synchronous)."""

    def wait(self) -> None:
        return None


@dataclass
class Communicator:
    """Collectives over ``group`` through ``impl``, logged in :attr:`log`."""

    impl: str = "torch"
    group: dist.ProcessGroup | None = None
    log: list[Transfer] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choice(self.impl, "impl", IMPLEMENTATIONS)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def _record(self, collective: str, full: torch.Tensor, tag: str) -> None:
        n_bytes = full.numel() * full.element_size()
        self.log.append(Transfer(collective, n_bytes, ring_bytes_sent(collective, n_bytes, self.world_size), tag))

    def _check(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(f"the full tensor must hold world_size ({self.world_size}) shards of "
                             f"{shard.numel()} elements, got {full.numel()} elements")
        if full.dtype != shard.dtype:
            raise TypeError(f"the full tensor has dtype {dtype_name(full.dtype)} but the shard has "
                            f"{dtype_name(shard.dtype)}; they must match")

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, tag: str = "") -> None:
        """``shard`` = this rank's shard of ``full`` summed over ranks (synchronous)."""
        self._check(full, shard)
        self._record("reduce_scatter", full, tag)
        if self.impl == "ring":
            ring_reduce_scatter(shard, full, self.group)
        else:
            _reduce_scatter_single(shard, full, group=self.group)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, tag: str = "", async_op: bool = False):
        """``full`` = every rank's ``shard`` in rank order; returns a handle to ``wait()`` on."""
        self._check(full, shard)
        self._record("all_gather", full, tag)
        if self.impl == "ring":
            ring_all_gather(full, shard, self.group)
            return _Done()
        work = _all_gather_single(full, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def sent_bytes(self, collective: str | None = None) -> float:
        """Bytes this rank sent since the log was last cleared (of one collective, or all)."""
        return sum(t.sent_bytes for t in self.log if collective is None or t.collective == collective)


@contextlib.contextmanager
def counting_torch_collectives(log: list[Transfer], group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Log, as :class:`Transfer`, every tensor all-gather and reduce-scatter called through
    ``torch.distributed`` inside the block: how the chapter counts what FSDP2 sends.

    FSDP2 issues its collectives through these Python functions; DDP's C++ reducer does
    not, so this sees FSDP2's traffic and not DDP's. A call that reaches a second counted
    name (an old name forwarding to a new one) is counted once.
    """
    world_size = dist.get_world_size(group)
    saved = {name: getattr(dist, name) for name in _TORCH_TENSOR_COLLECTIVES if hasattr(dist, name)}
    depth = [0]

    def counting(name: str, fn):
        collective = _TORCH_TENSOR_COLLECTIVES[name]

        def counted(output, input, *args, **kwargs):
            if depth[0] == 0:
                full = output if collective == "all_gather" else input
                n_bytes = full.numel() * full.element_size()
                log.append(Transfer(collective, n_bytes, ring_bytes_sent(collective, n_bytes, world_size), "torch"))
            depth[0] += 1
            try:
                return fn(output, input, *args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)

