"""Mixture of experts: routers, dispatch and combine, a grouped GEMM, expert parallelism.

The functions users call live here and check their arguments; the Triton kernel is in
:mod:`.kernels`, the plain-torch oracle in :mod:`.reference`, routing in :mod:`.router`,
the permutation in :mod:`.dispatch`, the multi-process layer in :mod:`.parallel`, and the
benchmarks in :mod:`.bench`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backend
from ..validate import check_same_device, check_tensor
from .dispatch import DispatchPlan, combine, expert_capacity, permute, plan_dispatch
from .kernels import combine_launch, grouped_mm_launch
from .layer import MoEWeights, random_moe_weights
from .reference import expert_mlp, experts_reference, grouped_mm_loop, moe_layer_reference
from .router import (
    Routing, expert_counts, imbalance, load_balancing_loss, sigmoid_topk_with_bias, softmax_topk,
    update_bias, zipf_counts,
)

__all__ = [
    "DispatchPlan", "MoEWeights", "Routing", "combine", "expert_capacity", "expert_counts",
    "expert_mlp", "experts_reference", "gather_combine", "grouped_mm", "grouped_mm_loop", "imbalance", "load_balancing_loss",
    "moe_layer", "moe_layer_reference", "permute", "plan_dispatch", "random_moe_weights",
    "sigmoid_topk_with_bias", "softmax_topk", "update_bias", "zipf_counts",
]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _refuse_autograd(function: str, **tensors: torch.Tensor) -> None:
    """The Triton kernels have no backward: a result that silently dropped the gradient
    would train nothing and say nothing, so a tensor that wants one is refused."""
    if not torch.is_grad_enabled():
        return
    wanting = [name for name, t in tensors.items() if t is not None and t.requires_grad]
    if wanting:
        raise RuntimeError(
            f"labkit.moe.{function} is forward-only (its Triton kernels have no backward), but "
            f"{', '.join(wanting)} requires grad: call it under torch.no_grad(), or train through "
            "labkit.moe.reference.moe_layer_reference"
        )


def grouped_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = a[src(r)] @ w[e(r)]^T`` for the rows of every expert, in one launch.

    ``w``: ``[E, N, K]``; ``offsets``: int64 ``[E+1]``, expert ``e`` owning output rows
    ``offsets[e]:offsets[e+1]``; ``src(r) = gather_rows[r]`` if given (``a`` is then the
    unpermuted tokens) else ``r``. Accumulates in fp32; returns ``a``'s dtype. ``offsets``
    is trusted to be non-decreasing from 0 (checking would cost a device-to-host copy).
    """
    # The kernels run where labkit's mode says: CUDA tensors on a GPU, CPU ones in the interpreter.
    check_tensor(a, "a", ndim=2, dtypes=_KERNEL_DTYPES, device=backend.device(), nonempty=False)
    check_tensor(w, "w", ndim=3, dtypes=(a.dtype,))
    check_tensor(offsets, "offsets", ndim=1, dtypes=(torch.int64,))
    check_same_device(a=a, w=w, offsets=offsets)
    _refuse_autograd("grouped_mm", a=a, w=w)
    if a.shape[1] != w.shape[2]:
        raise ValueError(f"a has {a.shape[1]} columns but w's experts take K={w.shape[2]}")
    if offsets.numel() != w.shape[0] + 1:
        raise ValueError(f"offsets must have E+1 = {w.shape[0] + 1} entries, got {offsets.numel()}")
    if gather_rows is None:
        num_rows = a.shape[0]
    else:
        check_tensor(gather_rows, "gather_rows", ndim=1, dtypes=(torch.int64,), nonempty=False)
        check_same_device(a=a, gather_rows=gather_rows)
        num_rows = gather_rows.numel()
    out = torch.empty(num_rows, w.shape[1], dtype=a.dtype, device=a.device)
    return grouped_mm_launch(a, w, offsets, out, gather_rows)


def gather_combine(
    expert_out: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`combine` as one Triton kernel: each token gathers its ``k`` rows (fp32 sum).

    ``weights``: the router's ``[T, k]`` weights (a dropped slot's weight is ignored).
    Reads the ``[M, H]`` expert rows once and writes ``[T, H]``; the plain-torch
    :func:`combine` scatters into an fp32 ``[T*k, H]`` buffer first (about four times the bytes).
    """
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a DispatchPlan (from plan_dispatch), got {type(plan).__name__}")
    check_tensor(expert_out, "expert_out", ndim=2, dtypes=_KERNEL_DTYPES, device=backend.device(), nonempty=False)
    if expert_out.shape[0] != plan.slot_of_row.numel() or expert_out.stride(1) != 1:
        raise ValueError(f"expert_out must be row-major with {plan.slot_of_row.numel()} rows for this plan, "
                         f"got shape {tuple(expert_out.shape)}, strides {tuple(expert_out.stride())}")
    check_tensor(weights, "weights", ndim=2)
    if tuple(weights.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"weights must be [T, k] = {[plan.num_tokens, plan.top_k]}, got {list(weights.shape)}")
    check_same_device(expert_out=expert_out, weights=weights)
    _refuse_autograd("gather_combine", expert_out=expert_out, weights=weights)
    out = torch.empty(plan.num_tokens, expert_out.shape[1], dtype=dtype or expert_out.dtype, device=expert_out.device)
    return combine_launch(expert_out, plan.row_of_slot, weights.float().contiguous(), out, plan.top_k)


def moe_layer(
    x: torch.Tensor,
    weights: MoEWeights,
    *,
    capacity_factor: float | None = None,
    return_routing: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, Routing, DispatchPlan]:
    """The MoE layer: route, dispatch, two grouped GEMMs around SwiGLU, combine.

    Four steps and no Python loop over experts: the first grouped GEMM reads the tokens
    through the dispatch permutation (no permuted copy of ``x``), SwiGLU runs on the
    ``[M, 2I]`` result, the second grouped GEMM writes rows in expert order, and
    :func:`gather_combine` sums each token's rows back. With ``capacity_factor`` an expert keeps at most
    ``expert_capacity(T, E, k, factor)`` rows and the others are dropped (zero output).
    ``return_routing`` also returns the :class:`Routing` and the :class:`DispatchPlan`.
    """
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be MoEWeights, got {type(weights).__name__}")
    check_tensor(x, "x", ndim=2, dtypes=(weights.router.dtype,))
    check_same_device(x=x, router=weights.router)
    if x.shape[1] != weights.hidden:
        raise ValueError(f"x has hidden size {x.shape[1]}, the layer's is {weights.hidden}")
    routing = softmax_topk(F.linear(x, weights.router), weights.top_k, normalize=weights.normalize)
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(x.shape[0], weights.num_experts, weights.top_k, capacity_factor)
    plan = plan_dispatch(routing.expert_ids, routing.weights, weights.num_experts, capacity)
    gate_up = grouped_mm(x, weights.gate_up, plan.offsets, gather_rows=plan.token_of_row)
    gate, up = gate_up.chunk(2, dim=-1)
    expert_out = grouped_mm(F.silu(gate) * up, weights.down, plan.offsets)
    out = gather_combine(expert_out, plan, routing.weights, dtype=x.dtype)
    return (out, routing, plan) if return_routing else out
