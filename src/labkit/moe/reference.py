"""Plain-torch MoE: the oracle for every faster piece of this topic, and the loop baseline.

Run in float64 these are the references the kernels are checked against; run in bf16
they are what a practitioner writes first (and what HF transformers' Qwen3-MoE block
does): one small GEMM per expert, in a Python loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .router import Routing, softmax_topk


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert: SwiGLU, ``down(silu(gate(x)) * up(x))``; ``w_gate_up`` stacks gate over up."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def moe_layer_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """A whole MoE layer in twenty lines: route, then loop over experts and add up.

    ``x``: ``[T, H]``; ``router_weight``: ``[E, H]``; ``w_gate_up``: ``[E, 2I, H]``;
    ``w_down``: ``[E, H, I]``.
    """
    routing = softmax_topk(F.linear(x, router_weight), top_k, normalize=normalize)
    return experts_reference(x, routing, w_gate_up, w_down)


def experts_reference(
    x: torch.Tensor, routing: Routing, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The experts' half of the layer for a given routing, in ``x``'s dtype.

    Each expert runs on exactly the tokens that chose it, and its output, times the
    routing weight, is added to those tokens' rows. Kept apart from the router so that a
    float64 check can reuse the routing a bf16 layer chose: near-ties between the k-th and
    (k+1)-th expert flip under rounding, and a flipped choice is not an arithmetic error.
    """
    out = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        token, choice = torch.where(routing.expert_ids == e)
        if token.numel() == 0:
            continue  # an expert nobody chose costs nothing
        y = expert_mlp(x[token], w_gate_up[e], w_down[e])
        out.index_add_(0, token, (y * routing.weights[token, choice, None]).to(x.dtype))
    return out


def grouped_mm_loop(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[o_e:o_{e+1}] = a[o_e:o_{e+1}] @ w[e]^T`` for each expert, one ``torch.mm`` each."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    bounds = offsets.tolist()  # one device-to-host copy: the loop needs the counts on the host
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(a[lo:hi], w[e].t(), out=out[lo:hi])
    return out


def tile_schedule(counts: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """The grouped GEMM's M-tiles as ``(expert, first_row, end_row)``, in program order.

    The same arithmetic the kernel does in registers (a prefix sum of
    ``ceil(count_e / block_m)``), written out on the host to draw and to test.
    """
    tiles, start = [], 0
    for expert, count in enumerate(counts):
        for first in range(start, start + count, block_m):
            tiles.append((expert, first, min(first + block_m, start + count)))
        start += count
    return tiles
