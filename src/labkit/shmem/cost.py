"""What one-sided buys, counted and modelled.

**Counts.** The one-sided programs' counts come from running them (``World.totals``). The
two-sided versions' come from their schedules: the collectives chapter's ring
(:func:`labkit.collectives.schedule.ring_all_reduce_transfers`, one matched send/receive per
transfer, every rank blocking on each step's exchange) and the MoE chapter's expert-parallel
dispatch (:mod:`labkit.moe.parallel`: an all-to-all of counts, the counts copied to the host
to size the second all-to-all, then the rows).

**Time.** The alpha-beta model of the collectives chapter
(:func:`labkit.collectives.cost.predicted_seconds`) with two alphas: a *host-issued* step
(a launch, a matched receive, a synchronisation: the collectives chapter measured this on
the H200) and a *device-initiated* one (a store and a flag over NVLink, no host: NCCL's own
LL hop latency is the model's value). A one-shot all-reduce pays one alpha and ``n - 1`` times
the bytes; the ring ``2(n - 1)`` alphas and ``2(n - 1)/n`` of the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives.cost import predicted_seconds
from ..collectives.schedule import ring_all_reduce_transfers
from ..validate import check_choice, check_positive_int

MODELS = ("two-sided ring", "one-sided ring", "one-sided one-shot")


def two_sided_ring_counts(n: int, nbytes: int) -> dict[str, int]:
    """Messages, matched receives, bytes and blocking steps of the collectives chapter's ring (all ranks)."""
    check_positive_int(n, "n")
    steps = ring_all_reduce_transfers(n) if n > 1 else []
    transfers = sum(len(s) for s in steps)
    return {"messages": transfers, "receives posted": transfers, "signals": 0,
            "bytes": round(2 * (n - 1) / n * nbytes * n), "blocking steps per rank": len(steps),
            "host syncs per rank": len(steps)}


def two_sided_dispatch_counts(n: int, rows_between: Sequence[Sequence[int]], row_bytes: int) -> dict[str, int]:
    """The MoE chapter's dispatch: counts all-to-all, a device-to-host copy of them, the rows all-to-all.

    ``rows_between[s][d]`` rows go from rank ``s`` to rank ``d``. Each all-to-all is ``n - 1``
    messages a rank (one per peer, self excluded) and as many matched receives.
    """
    check_positive_int(n, "n")
    per_collective = n * (n - 1)
    moved = sum(rows_between[s][d] for s in range(n) for d in range(n) if s != d)
    return {"messages": 2 * per_collective, "receives posted": 2 * per_collective, "signals": 0,
            "bytes": moved * row_bytes + per_collective * 8, "blocking steps per rank": 2,
            "host syncs per rank": 1}


def one_sided_counts(totals: dict[str, int], *, remote_bytes: int | None = None) -> dict[str, int]:
    """The same columns, from a one-sided run's ``World.totals()``.

    A message is a put, an atomic, or a signal sent on its own: a ``put_signal`` is one message
    (its signal travels with the data, as an RDMA write with an atomic behind it does).
    """
    messages = totals["put"] + totals["atomic"] + totals["signal"] - totals.get("put_signal", 0)
    return {"messages": messages, "receives posted": 0,
            "signals": totals["signal"], "bytes": totals["put_bytes"] if remote_bytes is None else remote_bytes,
            "blocking steps per rank": None, "host syncs per rank": 0}


def all_reduce_time_us(model: str, nbytes: float, n: int, *, host_alpha_us: float, device_alpha_us: float,
                       bandwidth_gbps: float) -> float:
    """Modelled time of an all-reduce of ``nbytes`` over ``n`` GPUs (microseconds)."""
    check_choice(model, "model", MODELS)
    check_positive_int(n, "n")
    if n == 1:
        return 0.0
    if model == "one-sided one-shot":
        if bandwidth_gbps <= 0 or device_alpha_us < 0 or nbytes < 0:
            raise ValueError("need bandwidth_gbps > 0, device_alpha_us >= 0, nbytes >= 0")
        return device_alpha_us + (n - 1) * nbytes / (bandwidth_gbps * 1e3)
    alpha = host_alpha_us if model == "two-sided ring" else device_alpha_us
    return predicted_seconds("ring_all_reduce", nbytes, n, alpha_s=alpha * 1e-6, bandwidth_gbps=bandwidth_gbps) * 1e6


def routing(n: int, tokens_per_pe: int, top_k: int, hidden: int, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random tokens and a random top-k routing of them to PEs: the dispatch's inputs, on every PE."""
    from .. import check

    tokens, dest = [], []
    for p in range(n):
        tokens.append(check.randn(tokens_per_pe, hidden, dtype=torch.float32, seed=seed * 1000 + p).to(dtype))
        g = torch.Generator().manual_seed(seed * 1000 + 500 + p)
        dest.append(torch.randint(0, n, (tokens_per_pe, top_k), generator=g))
    return tokens, dest


def rows_between(dest: Sequence[torch.Tensor], n: int) -> list[list[int]]:
    """``[s][d]``: how many of PE ``s``'s tokens go to PE ``d`` (a token once per PE)."""
    return [[int((dest[s] == d).any(dim=1).sum()) for d in range(n)] for s in range(n)]
