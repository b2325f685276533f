"""How many tokens a verification step yields, and what that buys once drafting costs something.

With each draft accepted with probability ``alpha``, independently (the model of
Leviathan et al. 2023), a step of ``k`` drafts keeps ``i`` of them with probability
``alpha^i (1 - alpha)`` for ``i < k`` and all ``k`` with probability ``alpha^k``, and
always adds one token (the replacement or the bonus). The expected tokens per step is

    E[tokens] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha),

which tends to ``1 / (1 - alpha)`` however large ``k`` grows. A step costs ``k`` draft
forwards (``draft_cost`` each, as a fraction of one target decode step) plus one target
forward over ``k + 1`` tokens (``verify_cost`` target steps, about 1 while decoding is
bound by reading the weights), so the speedup over plain decoding is
``E[tokens] / (k * draft_cost + verify_cost)``, and past some ``k`` the extra drafts cost
more than the tokens they add.
"""

from __future__ import annotations

import math

import torch


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the acceptance rate) must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_k(k: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{name} (drafts per step) must be an int >= 0, got {k!r}")
    return k


def _check_cost(cost: float, name: str) -> float:
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (in target decode steps), got {cost!r}")
    return float(cost)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one step of ``k`` drafts emits: ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit of time against plain decoding: ``E[tokens] / (k * draft_cost + verify_cost)``."""
    draft_cost = _check_cost(draft_cost, "draft_cost")
    verify_cost = _check_cost(verify_cost, "verify_cost")
    k = _check_k(k)
    if k == 0:
        return 1.0  # no speculation: plain decoding
    if k * draft_cost + verify_cost == 0:
        raise ValueError("a step that costs nothing has no speedup: draft_cost and verify_cost are both 0")
    return expected_tokens(alpha, k) / (k * draft_cost + verify_cost)


def best_k(alpha: float, draft_cost: float, verify_cost: float = 1.0, k_max: int = 32) -> int:
    """The ``k`` in ``0..k_max`` with the highest :func:`expected_speedup` (0: do not speculate)."""
    k_max = _check_k(k_max, "k_max")
    speedups = [expected_speedup(alpha, k, draft_cost, verify_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (speedups[k], -k))


def acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The chance a draft drawn from ``q`` survives verification against ``p``: ``sum_x min(p(x), q(x))``
    over the last dimension (one minus the total-variation distance between them)."""
    if not isinstance(target_probs, torch.Tensor) or not isinstance(draft_probs, torch.Tensor):
        raise TypeError("target_probs and draft_probs must be tensors of probabilities [..., V]")
    if target_probs.shape != draft_probs.shape:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} and draft_probs "
                         f"{tuple(draft_probs.shape)} must have the same shape")
    return torch.minimum(target_probs.double(), draft_probs.double()).sum(dim=-1)


def estimate_alpha(num_accepted: list[int] | torch.Tensor, k: int) -> float:
    """The acceptance rate that best explains observed steps of ``k`` drafts (maximum likelihood
    under the independent-acceptance model): drafts kept over drafts judged, where a step that
    kept ``n < k`` judged ``n + 1`` and one that kept all ``k`` judged ``k``."""
    k = _check_k(k)
    counts = torch.as_tensor(num_accepted, dtype=torch.int64).flatten()
    if k == 0 or counts.numel() == 0:
        raise ValueError(f"need at least one step with k >= 1 drafts, got {counts.numel()} steps and k={k}")
    if bool(((counts < 0) | (counts > k)).any()):
        raise ValueError(f"accepted counts must lie in [0, {k}], got {counts.tolist()}")
    kept = int(counts.sum())
    judged = kept + int((counts < k).sum())
    return kept / judged
