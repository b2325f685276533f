"""Routers: which experts each token goes to, with what weight, and how balanced that is.

Two rules are implemented, both in plain torch (they are a few small kernels' worth of
work next to the expert GEMMs, and autograd must flow through them while training):

- :func:`softmax_topk`: softmax over all experts, keep the top ``k``, optionally
  renormalize the kept ``k`` to sum to one (Mixtral, Qwen3-MoE).
- :func:`sigmoid_topk_with_bias`: DeepSeek-V3's aux-loss-free rule. Each expert's score
  is a sigmoid; a per-expert *bias* is added only for choosing the top ``k``, and the
  gating weights are the unbiased scores, renormalized. :func:`update_bias` nudges the bias
  after each step: down for experts that got more than their share, up for the others.

:func:`load_balancing_loss` is the Switch Transformer auxiliary loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_positive_int, check_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_logits(logits: object, top_k: object) -> torch.Tensor:
    check_tensor(logits, "logits", ndim=2, dtypes=_FLOATS)
    check_positive_int(top_k, "top_k")
    if top_k > logits.shape[-1]:
        raise ValueError(f"top_k must be at most the number of experts ({logits.shape[-1]}), got {top_k}")
    return logits


@dataclass(frozen=True)
class Routing:
    """A router's decision for ``T`` tokens and ``k`` choices each.

    ``expert_ids``: int64 ``[T, k]``; ``weights``: fp32 ``[T, k]`` (what multiplies each
    expert's output); ``probs``: fp32 ``[T, E]``, the full distribution the balancing loss
    needs (softmax probabilities, or the sigmoid scores normalized per token).
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool = True) -> Routing:
    """Top-``k`` of a softmax over experts; ``normalize`` rescales the kept ``k`` to sum to 1.

    The softmax runs in fp32 whatever the logits' dtype (as HF's Qwen3-MoE does): with 128
    experts the probabilities are ~1e-2, and bf16's 8 mantissa bits would tie many of them.
    """
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids, weights, probs)


def sigmoid_topk_with_bias(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> Routing:
    """DeepSeek-V3 routing: choose by ``sigmoid(logits) + bias``, weigh by the unbiased scores.

    The bias steers *which* experts a token visits, never *how much* each contributes, so
    balancing does not distort the function the layer computes the way an auxiliary loss's
    gradient does.
    """
    _check_logits(logits, top_k)
    check_tensor(bias, "bias", ndim=1, dtypes=_FLOATS)
    if bias.numel() != logits.shape[-1]:
        raise ValueError(f"bias must have one entry per expert ({logits.shape[-1]}), got {bias.numel()}")
    scores = torch.sigmoid(logits.float())
    _, expert_ids = torch.topk(scores + bias.float(), top_k, dim=-1)
    weights = torch.gather(scores, -1, expert_ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids, weights, scores / scores.sum(dim=-1, keepdim=True))


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, choice) pairs each expert received: int64 ``[E]``.

    A scatter-add rather than ``torch.bincount``: on a GPU bincount first copies the
    largest id to the host to size its output, a synchronization in every forward.
    """
    flat = expert_ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, ``E * sum_i f_i * P_i``; 1.0 when perfectly balanced.

    ``f_i`` is the fraction of the ``T*k`` assignments that went to expert ``i`` (a count:
    no gradient), ``P_i`` the mean router probability of expert ``i`` (differentiable). The
    product is smallest when both are uniform, and its gradient pushes probability away
    from the experts that are over-used. HF's ``load_balancing_loss_func`` divides by ``T``
    instead of ``T*k``, so its value is ``k`` times this one.
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing (from softmax_topk or sigmoid_topk_with_bias), got {type(routing).__name__}")
    num_experts = routing.num_experts
    counts = expert_counts(routing.expert_ids, num_experts)
    fraction = counts.float() / routing.expert_ids.numel()
    mean_prob = routing.probs.mean(dim=0)
    return num_experts * (fraction * mean_prob).sum()


def update_bias(bias: torch.Tensor, expert_ids: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's bias step: ``b_i -= rate`` if expert ``i`` is over-loaded, ``+= rate`` if under.

    "Over" means above the mean count ``T*k/E``. Returns a new tensor (no autograd: the
    bias is not a parameter of the loss).
    """
    check_tensor(bias, "bias", ndim=1, dtypes=_FLOATS)
    check_tensor(expert_ids, "expert_ids", ndim=2, dtypes=(torch.int64,))
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"rate must be a positive number, got {rate!r}")
    counts = expert_counts(expert_ids, bias.numel()).float()
    return bias - rate * torch.sign(counts - counts.mean())


def imbalance(expert_ids: torch.Tensor, num_experts: int) -> float:
    """Max over mean expert load: 1.0 is perfect balance, ``E/k`` is everything on one expert.

    The busiest expert sets the layer's time (the others wait for it), so this is the
    factor by which imbalance slows a layer whose experts run in parallel.
    """
    counts = expert_counts(expert_ids, num_experts).float()
    return float(counts.max() / counts.mean())


def zipf_counts(rows: int, num_experts: int, skew: float) -> list[int]:
    """Rows per expert when expert ``e``'s share is proportional to ``(e + 1) ** -skew``.

    ``skew = 0`` is perfectly balanced routing; ``skew = 1`` gives the first of 64 experts
    about a fifth of all rows. Shares are rounded down and the remainder goes to the first
    expert, so the counts sum to ``rows`` exactly.
    """
    check_positive_int(num_experts, "num_experts")
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    share = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    return counts.tolist()
