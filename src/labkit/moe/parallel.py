"""Expert parallelism: each process holds ``E / P`` experts; tokens travel to them and back.

Every rank routes its own tokens (the router is replicated), sorts them by expert with
:func:`plan_dispatch` (experts are numbered rank-major, so "sorted by expert" is also
"grouped by destination rank"), and then two all-to-alls move the rows: *dispatch*
sends each row to the rank that owns its expert, the owners run their experts with the
grouped GEMM, and *combine* sends the results back along the same splits, reversed.
A first, tiny all-to-all exchanges the per-expert counts, because a receiver must know
how many rows it gets (``all_to_all_single`` takes the split sizes on the host) and how
they divide among its experts. The layer is token-wise, so each rank's output must equal
the single-process layer applied to that rank's tokens: that is the check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import check
from ..validate import check_tensor
from .dispatch import plan_dispatch
from .layer import MoEWeights, random_moe_weights
from .router import softmax_topk


def expert_range(rank: int, world_size: int, num_experts: int) -> tuple[int, int]:
    """``(first, last)`` experts of ``rank``: contiguous blocks of ``E / P``."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not divide among {world_size} ranks")
    per_rank = num_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """The rows this rank receives: ``send_splits[r]`` rows of ``rows`` go to rank ``r`` (in
    order), ``recv_splits[r]`` come from it; one two-sided ``all_to_all_single`` of the group."""
    out = torch.empty(sum(recv_splits), rows.shape[1], dtype=rows.dtype, device=rows.device)
    # Moving rows is a copy, so they travel as raw bytes: gloo's all-to-all knows neither
    # bfloat16 nor int16, and no value changes on the way. Splits count rows (dim 0).
    dist.all_to_all_single(out.view(torch.uint8), rows.contiguous().view(torch.uint8),
                           output_split_sizes=recv_splits, input_split_sizes=send_splits)
    return out


def expert_parallel_moe_layer(
    x: torch.Tensor, local: MoEWeights, *, stats: dict | None = None
) -> torch.Tensor:
    """The MoE layer for this rank's tokens ``x``, with only this rank's experts in ``local``.

    ``local.router`` is the whole ``[E, H]`` router; ``local.gate_up`` / ``local.down`` hold
    experts ``expert_range(rank, P, E)``. If ``stats`` is a dict, it receives the rows this
    rank sent to each rank (``rows_sent``), for the traffic calculator to be checked against.
    """
    from . import gather_combine, grouped_mm  # the checked entry points; imported here to avoid a cycle

    if not isinstance(local, MoEWeights):
        raise TypeError(f"local must be MoEWeights, got {type(local).__name__}")
    check_tensor(x, "x", ndim=2, dtypes=(local.router.dtype,), nonempty=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = local.num_experts
    first, last = expert_range(rank, world, num_experts)
    per_rank = last - first
    if local.gate_up.shape[0] != per_rank:
        raise ValueError(f"rank {rank} must hold {per_rank} experts ({first}:{last}), got {local.gate_up.shape[0]}")

    routing = softmax_topk(F.linear(x, local.router), local.top_k, normalize=local.normalize)
    plan = plan_dispatch(routing.expert_ids, routing.weights, num_experts)

    # 1. Counts: how many rows go to each (rank, expert); receive ours from every rank.
    send_counts = plan.counts
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    recv_counts = recv_counts.view(world, per_rank)  # [source rank, my local expert]
    send_splits = send_counts.view(world, per_rank).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    # 2. Dispatch: rows in expert order are already grouped by destination rank.
    received = all_to_all_rows(x[plan.token_of_row], send_splits, recv_splits)

    # 3. Experts: received rows come grouped (source rank, expert); regroup by expert.
    local_expert = torch.repeat_interleave(
        torch.arange(per_rank, device=x.device).repeat(world), recv_counts.flatten())
    order = torch.argsort(local_expert, stable=True)
    offsets = torch.zeros(per_rank + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(recv_counts.sum(0), 0, out=offsets[1:])
    gate, up = grouped_mm(received, local.gate_up, offsets, gather_rows=order).chunk(2, dim=-1)
    expert_out = torch.empty_like(received)
    expert_out[order] = grouped_mm(F.silu(gate) * up, local.down, offsets)

    # 4. Combine: the same splits, reversed, bring every row home; then the weighted sum.
    returned = all_to_all_rows(expert_out, recv_splits, send_splits)
    if stats is not None:
        stats["rows_sent"] = send_splits
    return gather_combine(returned, plan, routing.weights, dtype=x.dtype)


def check_against_single_process(
    seed: int, tokens_per_rank: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
    dtype_name: str = "float32",
) -> dict:
    """Run on every rank (through :func:`labkit.collectives.launch.run`): EP output vs the plain layer.

    Every rank builds the same weights from ``seed``, keeps its own experts, and makes its
    own tokens (``seed + 1 + rank``, and a rank-dependent count, so the ranks send
    unequal numbers of rows). Returns this rank's output, the single-process output for
    the same tokens, and the rows it sent to each rank.
    """
    from . import moe_layer

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    weights = random_moe_weights(num_experts, hidden, intermediate, top_k, dtype=dtype, device=device, seed=seed)
    x = check.randn(tokens_per_rank + rank, hidden, dtype=dtype, device=device, seed=seed + 1 + rank)
    first, last = expert_range(rank, world, num_experts)
    stats: dict = {}
    out = expert_parallel_moe_layer(x, weights.experts(first, last), stats=stats)
    return {"out": out, "expected": moe_layer(x, weights), "rows_sent": stats["rows_sent"]}
