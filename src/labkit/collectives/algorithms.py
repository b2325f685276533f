"""Collectives built from point-to-point sends and receives: the ring and recursive doubling.

These functions trust their arguments (flat, contiguous, on the right device); the
checked entry points users call are in :mod:`labkit.collectives`. Every transfer is one
``dist.batch_isend_irecv`` of a send to one neighbour and a receive from the other,
posted together: if each rank first sent and then received, with blocking calls, every
rank would wait in its send for a receive nobody has posted yet. Posting both lets
NCCL run them as one group (and gloo as two asynchronous operations), then we wait.

Sums are taken in the tensor's own dtype, step by step, as NCCL does. A rank writes a
finished chunk once and only copies it afterwards, so every rank ends with the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import schedule


@dataclass(frozen=True)
class Peers:
    """This process's place in a group: its rank, the group's size, and how to name peers."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Peers:
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def global_rank(self, group_rank: int) -> int:
        """P2P calls name peers by global rank, even inside a subgroup."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @property
    def right(self) -> int:
        return self.global_rank((self.rank + 1) % self.size)

    @property
    def left(self) -> int:
        return self.global_rank((self.rank - 1) % self.size)


def exchange(send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int,
             group: dist.ProcessGroup | None) -> None:
    """Send ``send`` to one rank and receive ``recv`` from another (or the same), together.

    An empty chunk (numel < world size) is skipped on both sides: both know its size.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, send_to, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, recv_from, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_reduce_scatter_(flat_input: torch.Tensor, out: torch.Tensor, peers: Peers) -> torch.Tensor:
    """``out`` = chunk ``rank`` of ``flat_input``, summed over ranks, in ``n - 1`` ring steps.

    Each step moves one chunk (``1/n`` of the data) to the right neighbour, so a rank sends
    ``(n-1)/n`` of the tensor in all. Partial sums travel in two chunk-sized scratch
    buffers and ``flat_input`` is only read, so ``out`` may be a view of its chunk ``rank``
    (the in-place all-reduce uses that: that chunk is first read at the last step, by
    the same add that writes it).
    """
    n, r = peers.size, peers.rank
    chunks = flat_input.tensor_split(n)
    if n == 1:
        if out.data_ptr() != flat_input.data_ptr():
            out.copy_(flat_input)
        return out
    longest = chunks[0].numel()
    incoming_buf = torch.empty(longest, dtype=flat_input.dtype, device=flat_input.device)
    partial_buf = torch.empty_like(incoming_buf)
    sending = chunks[schedule.reduce_scatter_step(r, 0, n)[0]]  # step 0 sends our own copy
    for step in range(n - 1):
        _, c = schedule.reduce_scatter_step(r, step, n)
        incoming = incoming_buf[: chunks[c].numel()]
        exchange(sending, peers.right, incoming, peers.left, peers.group)
        # The exchange has completed, so the partial we just sent may be overwritten.
        partial = out if step == n - 2 else partial_buf[: chunks[c].numel()]
        torch.add(incoming, chunks[c], out=partial)
        sending = partial  # next step forwards the chunk we just added to
    return out


def ring_all_gather_(flat: torch.Tensor, peers: Peers) -> torch.Tensor:
    """Fill every chunk of ``flat`` from its owner, given that chunk ``rank`` is ours.

    ``n - 1`` steps; each receives straight into its place in ``flat`` (no copies), and
    forwards next step what it received this step.
    """
    n, r = peers.size, peers.rank
    chunks = flat.tensor_split(n)
    for step in range(n - 1):
        send_chunk, recv_chunk = schedule.all_gather_step(r, step, n)
        exchange(chunks[send_chunk], peers.right, chunks[recv_chunk], peers.left, peers.group)
    return flat


def ring_all_reduce_(flat: torch.Tensor, peers: Peers) -> torch.Tensor:
    """All-reduce in place = reduce-scatter (each rank finishes one chunk) + all-gather.

    ``2(n-1)`` steps, each moving ``1/n`` of the tensor: ``2(n-1)/n`` of it per rank,
    which no all-reduce can beat by more than a factor ``n/(n-1)``.
    """
    own = flat.tensor_split(peers.size)[peers.rank]
    ring_reduce_scatter_(flat, own, peers)
    return ring_all_gather_(flat, peers)


def recursive_doubling_all_reduce_(flat: torch.Tensor, peers: Peers) -> torch.Tensor:
    """All-reduce in place by exchanging whole tensors with partners at distance 1, 2, 4, ...

    ``log2(n)`` steps instead of ``2(n-1)``, but each moves the *whole* tensor: the
    latency-bound choice for small messages. A non-power-of-two ``n`` first folds the
    extra ranks into their neighbours and hands them the result at the end (two more
    steps). Partners add the same two tensors (``a + b`` and ``b + a`` are the same bits),
    so every rank ends with identical results.
    """
    n, r = peers.size, peers.rank
    if n == 1:
        return flat
    role = schedule.doubling_role(r, n)
    nothing = flat[:0]
    if role.folded:  # hand our data to the odd neighbour, then wait for the result
        neighbour = peers.global_rank(r + 1)
        exchange(flat, neighbour, nothing, neighbour, peers.group)  # an empty side is skipped
        exchange(nothing, neighbour, flat, neighbour, peers.group)
        return flat
    scratch = torch.empty_like(flat)
    if r < 2 * role.extra:  # the odd member of a folded pair adds its neighbour's data
        neighbour = peers.global_rank(r - 1)
        exchange(nothing, neighbour, scratch, neighbour, peers.group)
        flat.add_(scratch)
    mask = 1
    while mask < role.p:
        partner = peers.global_rank(schedule.doubling_partner(role.virtual, mask, role.extra))
        exchange(flat, partner, scratch, partner, peers.group)
        flat.add_(scratch)
        mask <<= 1
    if r < 2 * role.extra:
        exchange(flat, neighbour, nothing, neighbour, peers.group)
    return flat
