"""Who sends which chunk to whom, at every step: the ring and recursive-doubling schedules.

The schedules are plain integer arithmetic, kept apart from the code that moves bytes
(:mod:`labkit.collectives.algorithms`) so that the same formulas drive the real
processes, the single-process simulation behind the chapter's animation, and the tests.

A tensor of ``numel`` elements is cut into ``n`` contiguous chunks the way
``torch.tensor_split`` cuts it: the first ``numel % n`` chunks hold one element more.
So sizes need not divide by the world size, and a chunk may be empty when
``numel < n``.
"""

from __future__ import annotations

from dataclasses import dataclass


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the ``n`` chunks of a flat tensor, as ``tensor_split`` cuts it."""
    base, longer = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < longer else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_scatter_step(rank: int, step: int, n: int) -> tuple[int, int]:
    """``(chunk sent to rank+1, chunk received from rank-1)`` at ``step`` of a ring reduce-scatter.

    Rank ``r`` starts by sending its own copy of chunk ``r-1``; each step it adds its own
    contribution to the chunk it received and passes the sum on. After ``n-1`` steps the
    chunk it holds is ``r``, summed over all ``n`` ranks: rank ``r`` owns shard ``r``,
    the same shard ``reduce_scatter_tensor`` gives it.
    """
    return (rank - step - 1) % n, (rank - step - 2) % n


def all_gather_step(rank: int, step: int, n: int) -> tuple[int, int]:
    """``(chunk sent to rank+1, chunk received from rank-1)`` at ``step`` of a ring all-gather.

    Rank ``r`` starts with chunk ``r`` and forwards, each step, the chunk it received in
    the step before; after ``n-1`` steps every chunk has visited every rank.
    """
    return (rank - step) % n, (rank - step - 1) % n


def largest_power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class DoublingRole:
    """A rank's part in recursive doubling when ``n`` is not a power of two.

    The first ``2 * extra`` ranks pair up, (0, 1), (2, 3), ...: the even one hands its data
    to the odd one and waits (``folded``); the remaining ``p`` ranks, a power of two,
    exchange with partners at distance 1, 2, 4, ... in ``virtual`` numbering.
    """

    folded: bool
    virtual: int
    extra: int
    p: int


def doubling_role(rank: int, n: int) -> DoublingRole:
    p = largest_power_of_two_at_most(n)
    extra = n - p
    if rank < 2 * extra:
        return DoublingRole(folded=rank % 2 == 0, virtual=rank // 2, extra=extra, p=p)
    return DoublingRole(folded=False, virtual=rank - extra, extra=extra, p=p)


def doubling_partner(virtual: int, mask: int, extra: int) -> int:
    """The real rank of ``virtual ^ mask`` (the odd member of a folded pair stands for it)."""
    v = virtual ^ mask
    return 2 * v + 1 if v < extra else v + extra


@dataclass(frozen=True)
class Transfer:
    phase: str  # "reduce-scatter" or "all-gather"
    step: int
    src: int
    dst: int
    chunk: int


def ring_all_reduce_transfers(n: int) -> list[list[Transfer]]:
    """Every transfer of a ring all-reduce, grouped by step: ``2(n-1)`` steps of ``n`` each."""
    steps = []
    for phase, step_fn in (("reduce-scatter", reduce_scatter_step), ("all-gather", all_gather_step)):
        for s in range(n - 1):
            steps.append([Transfer(phase, s, r, (r + 1) % n, step_fn(r, s, n)[0]) for r in range(n)])
    return steps


def simulate_ring_all_reduce(n: int) -> list[list[list[frozenset[int]]]]:
    """What each rank holds of each chunk, before the first step and after every step.

    ``states[t][rank][chunk]`` is the set of ranks whose contribution that copy of the chunk
    contains. It starts as ``{rank}`` everywhere and ends as all ranks everywhere; the
    chapter's animation draws it, and the tests check the real processes against it.
    """
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    states = [[row[:] for row in held]]
    for transfers in ring_all_reduce_transfers(n):
        sent = [(t.dst, t.chunk, held[t.src][t.chunk], t.phase) for t in transfers]
        for dst, chunk, contents, phase in sent:  # all sends of a step happen at once
            held[dst][chunk] = held[dst][chunk] | contents if phase == "reduce-scatter" else contents
        states.append([row[:] for row in held])
    return states
