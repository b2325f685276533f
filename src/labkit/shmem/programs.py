"""Programs written against the simulated symmetric heap: one-sided collectives and an MoE dispatch.

Each is an SPMD function ``program(pe, ...)`` that :meth:`labkit.shmem.heap.World.run` runs on
every PE, as an NVSHMEM kernel runs on every GPU. They trust their arguments; the checked
entry points are in :mod:`labkit.shmem`.

- :func:`ring_all_reduce`: the collectives chapter's ring, same schedule
  (:mod:`labkit.collectives.schedule`) and the same additions in the same order, but every
  transfer is a ``put_signal`` into the neighbour's landing slot for that step: nobody posts a
  receive, and the only synchronisation is the flag the receiver waits on.
- :func:`one_shot_all_reduce`: every PE puts its whole buffer into every peer, then each adds
  the ``n`` copies in PE order: one step of latency instead of ``2(n - 1)``, at ``n - 1`` times
  the bytes (PyTorch SymmetricMemory's ``one_shot_all_reduce``).
- :func:`all_gather`: every PE puts its shard straight into its place on every peer, and adds 1
  to one counter there; each waits for the counter to reach ``n - 1``.
- :func:`dispatch`: DeepEP's low-latency dispatch, simplified: a token is put into the landing
  buffer of every PE that holds one of its experts, at a slot the *sender* counts, and a
  signal per destination (after a fence) tells the receiver how many came. No count
  exchange first, as the two-sided all-to-all needs.
"""

from __future__ import annotations

import torch

from ..collectives.schedule import all_gather_step, chunk_bounds, reduce_scatter_step
from .heap import PE, SIGNAL_ADD, SIGNAL_SET, SymTensor


def ring_all_reduce(pe: PE, data: SymTensor, slots: SymTensor, flags: SymTensor) -> torch.Tensor:
    """Sum ``data`` over PEs in place, by a ring of ``2(n-1)`` one-sided steps.

    ``slots`` is ``(2(n-1), longest chunk)``: step ``s`` lands in row ``s`` of the right
    neighbour, so a slot is never reused and no PE waits for its neighbour to free one.
    ``flags`` is ``(2(n-1),)`` int64, zero: the left neighbour sets ``flags[s]`` to 1 when
    step ``s``'s data has landed (``put_signal`` orders the signal after the data).
    """
    n, r = pe.n_pes, pe.my_pe
    local = pe.local(data).view(-1)
    bounds = chunk_bounds(local.numel(), n)
    right = (r + 1) % n
    for step in range(2 * (n - 1)):
        rs = step < n - 1
        send, recv = reduce_scatter_step(r, step, n) if rs else all_gather_step(r, step - (n - 1), n)
        (a, b), (c, d) = bounds[send], bounds[recv]
        # A blocking put copies the source now: we may overwrite local[a:b] at a later step.
        pe.put_signal(slots[step, : b - a], local[a:b], flags[step], 1, SIGNAL_SET, right)
        pe.signal_wait_until(flags[step], "eq", 1)
        incoming = pe.local(slots[step, : d - c])
        if rs:  # incoming + own, as the two-sided ring adds: the same bits
            torch.add(incoming, local[c:d], out=local[c:d])
        else:
            local[c:d].copy_(incoming)
    pe.quiet()
    return local.clone()


def one_shot_all_reduce(pe: PE, data: SymTensor, slots: SymTensor, flags: SymTensor) -> torch.Tensor:
    """Every PE's ``data`` into row ``my_pe`` of every peer's ``slots`` (``(n, numel)``), then a sum.

    Each PE adds the ``n`` rows in PE order, so every PE ends with the same bits. ``flags`` is
    one int64 counter: each peer adds 1 when its row has landed; we wait for ``n - 1``.
    """
    n, r = pe.n_pes, pe.my_pe
    mine = pe.local(data).view(-1)
    pe.local(slots[r]).copy_(mine)
    for k in range(1, n):
        peer = (r + k) % n  # start with the next PE, so not every PE hits PE 0 first
        pe.put_signal(slots[r], mine, flags, 1, SIGNAL_ADD, peer)
    pe.signal_wait_until(flags, "ge", n - 1)
    rows = pe.local(slots)
    total = rows[0].clone()
    for k in range(1, n):
        total += rows[k]
    mine.copy_(total)
    pe.quiet()
    return total


def all_gather(pe: PE, out: SymTensor, shard: torch.Tensor, counter: SymTensor) -> torch.Tensor:
    """``out`` (flat, symmetric) = every PE's ``shard`` in PE order (``tensor_split``'s cut); one wait.

    ``counter`` is one int64, zero: every peer adds 1 after its shard has landed.
    """
    n, r = pe.n_pes, pe.my_pe
    start, stop = chunk_bounds(out.numel, n)[r]
    pe.local(out).view(-1)[start:stop].copy_(shard)
    for k in range(1, n):
        pe.put_signal(out[start:stop], shard, counter, 1, SIGNAL_ADD, (r + k) % n)
    pe.signal_wait_until(counter, "ge", n - 1)
    pe.quiet()
    return pe.local(out).clone()


def dispatch(pe: PE, tokens: torch.Tensor, dest: torch.Tensor, recv: SymTensor, recv_count: SymTensor,
             *, fence: bool = True) -> list[torch.Tensor]:
    """DeepEP-style one-sided dispatch: ``tokens[i]`` to every PE named in ``dest[i]`` (once each).

    ``tokens`` is this PE's ``(T, H)``; ``dest`` ``(T, k)`` holds the PE of each of a token's
    ``k`` experts. ``recv`` is ``(n, capacity, H)``: a sender ``s`` writes its tokens for PE
    ``d`` into ``recv[s]`` on ``d``, at slots ``0, 1, ...`` it counts itself (so no two senders
    share a slot, and nobody asks anybody for an offset). ``recv_count`` is ``(n,)`` int64,
    zero: after its last token to ``d`` (and a fence, so the signal cannot overtake the data)
    the sender sets ``recv_count[s]`` on ``d`` to ``count + 1`` (a zero count must still be
    told: ``+ 1`` keeps it apart from "not yet"). Returns, per source PE, the rows received,
    in the source's token order. ``fence=False`` drops the fence, to show what goes wrong.
    """
    n, r = pe.n_pes, pe.my_pe
    capacity = recv.shape[1]
    sent = [0] * n
    for i in range(tokens.shape[0]):
        for d in dict.fromkeys(int(x) for x in dest[i]):  # each PE once, in expert order
            if sent[d] == capacity:
                raise ValueError(f"PE {r} sends more than capacity={capacity} tokens to PE {d}")
            pe.put_nbi(recv[r, sent[d]], tokens[i], d)
            sent[d] += 1
    if fence:
        pe.fence()
    for k in range(n):
        d = (r + k) % n
        pe.signal_op(recv_count[r], sent[d] + 1, SIGNAL_SET, d)
    got = []
    for s in range(n):
        count = pe.signal_wait_until(recv_count[s], "ne", 0) - 1
        got.append(pe.local(recv[s, :count]).clone())
    pe.quiet()  # our nbi sources (tokens) may change once this returns
    return got
