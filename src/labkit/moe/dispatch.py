"""Dispatch and combine: from ``T`` tokens x ``k`` choices to rows grouped by expert, and back.

A router leaves a ``[T, k]`` table of expert ids. Experts run fastest on *contiguous*
rows, so dispatch sorts the ``T*k`` (token, choice) slots by expert: after it, expert
``e`` owns rows ``offsets[e]:offsets[e+1]`` of one ``[M, H]`` matrix. Combine undoes it:
each row, scaled by its routing weight, goes back to its slot, and a token's ``k`` slots
are summed. Both directions are described by one :class:`DispatchPlan`, so the
permutation is computed once and cannot disagree between the two.

With a capacity (Switch, GShard), an expert keeps at most ``capacity`` rows; the rest are
*dropped*: they get no expert, contribute zero, and the token passes through on the
residual connection alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validate import check_positive_int, check_tensor
from .router import expert_counts


@dataclass(frozen=True)
class DispatchPlan:
    """Where each expert-sorted row comes from and goes back to.

    ``slot_of_row``: int64 ``[M]``, the flattened (token, choice) slot ``t*k + j`` of each
    sorted row; ``token_of_row = slot_of_row // k``; ``weight_of_row``: fp32 ``[M]``;
    ``row_of_slot``: int64 ``[T*k]``, the inverse (``-1`` for a dropped slot);
    ``offsets``: int64 ``[E+1]``, expert ``e``'s rows are ``offsets[e]:offsets[e+1]``.
    ``M = T*k`` minus the dropped slots.
    """

    slot_of_row: torch.Tensor
    token_of_row: torch.Tensor
    weight_of_row: torch.Tensor
    row_of_slot: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    top_k: int

    @property
    def num_experts(self) -> int:
        return self.offsets.numel() - 1

    @property
    def counts(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_dropped(self) -> int:
        return self.num_tokens * self.top_k - self.slot_of_row.numel()


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Switch's capacity: ``ceil(factor * T * k / E)`` rows per expert."""
    for value, name in ((num_tokens, "num_tokens"), (num_experts, "num_experts"), (top_k, "top_k")):
        check_positive_int(value, name)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def plan_dispatch(
    expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None = None
) -> DispatchPlan:
    """Sort the ``T*k`` slots by expert (stable: earlier tokens first), dropping past ``capacity``.

    The sort is stable so that, within an expert, rows keep token order; with a capacity
    that order decides who is dropped (later tokens in the batch, as in Switch), and it
    makes the result reproducible.
    """
    check_tensor(expert_ids, "expert_ids", ndim=2, dtypes=(torch.int64,))
    check_tensor(weights, "weights", ndim=2)
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights must match expert_ids' shape {tuple(expert_ids.shape)}, got {tuple(weights.shape)}")
    check_positive_int(num_experts, "num_experts")
    if capacity is not None:
        check_positive_int(capacity, "capacity")
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.flatten()
    slot_of_row = torch.argsort(flat_ids, stable=True)
    counts = expert_counts(expert_ids, num_experts)  # no device-to-host sync
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        sorted_ids = flat_ids[slot_of_row]
        rank_in_expert = torch.arange(slot_of_row.numel(), device=flat_ids.device) - starts[sorted_ids]
        slot_of_row = slot_of_row[rank_in_expert < capacity]
        counts = counts.clamp(max=capacity)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    row_of_slot = torch.full_like(flat_ids, -1)
    row_of_slot[slot_of_row] = torch.arange(slot_of_row.numel(), device=flat_ids.device)
    return DispatchPlan(
        slot_of_row=slot_of_row,
        token_of_row=slot_of_row // top_k,
        weight_of_row=weights.flatten()[slot_of_row].float(),
        row_of_slot=row_of_slot,
        offsets=offsets,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The tokens' rows in expert order: ``[M, H]``, a gather (one read, one write of ``M*H``)."""
    _check_plan(plan)
    _check_rows(x, "x", plan.num_tokens)
    return x[plan.token_of_row]


def combine(expert_out: torch.Tensor, plan: DispatchPlan, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * expert_out[row of slot (t, j)]``, summed in fp32.

    Rows go back to their slots first and each token's ``k`` slots are then summed in
    choice order: a fixed order of additions, so the result is the same on every run
    (``index_add_`` on a GPU adds in whatever order atomics land). Dropped slots stay zero.
    """
    _check_plan(plan)
    _check_rows(expert_out, "expert_out", plan.slot_of_row.numel())
    hidden = expert_out.shape[-1]
    slots = torch.zeros(plan.num_tokens * plan.top_k, hidden, dtype=torch.float32, device=expert_out.device)
    slots[plan.slot_of_row] = expert_out.float() * plan.weight_of_row[:, None]
    out = slots.view(plan.num_tokens, plan.top_k, hidden).sum(dim=1)
    return out.to(dtype or expert_out.dtype)


def _check_plan(plan: object) -> None:
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a DispatchPlan (from plan_dispatch), got {type(plan).__name__}")


def _check_rows(rows: object, name: str, expected_rows: int) -> None:
    check_tensor(rows, name, ndim=2, nonempty=False)
    if rows.shape[0] != expected_rows:
        raise ValueError(f"{name} must have {expected_rows} rows for this plan, got {rows.shape[0]}")
