"""The rollout/trainer mismatch, and truncated importance sampling (TIS) to correct it.

The engine samples token ``y`` with probability ``pi_rollout(y)``, computed by its own
kernels in its own dtype; the trainer recomputes ``pi_old(y)`` for the same tokens with
different kernels, often in another precision. They differ, so the "on-policy" gradient
is in fact off-policy. The importance weight ``pi_old / pi_rollout`` corrects the
expectation; truncating it at ``cap`` (Yao et al. 2025, adopted by verl and slime) bounds
its variance at the price of a small bias where the trainer likes a token far more than
the engine did. The same weight corrects rollouts sampled by a stale policy (asynchronous
training), where the gap is larger.
"""

from __future__ import annotations

import torch

from ..grpo import k3_kl
from ..validate import check_choice, check_same_shape, check_tensor

LEVELS = ("token", "sequence")


def tis_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                cap: float = 2.0, level: str = "token") -> torch.Tensor:
    """Truncated importance weights ``min(pi_trainer / pi_rollout, cap)``, 0 off the mask.

    ``level="token"`` weighs each token by its own ratio; ``"sequence"`` gives every token
    of a sequence the ratio of the whole sequence's probabilities (the product of its
    tokens' ratios), unbiased for sequence-level rewards but of far higher variance.
    The weights are constants: no gradient flows through them.
    """
    check_tensor(trainer_logp, "trainer_logp", ndim=2, dtypes=[torch.float32, torch.float64])
    check_same_shape(trainer_logp=trainer_logp, rollout_logp=rollout_logp, mask=mask)
    check_choice(level, "level", LEVELS)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1:
        raise ValueError(f"cap must be a number >= 1 (a weight of 1 is never truncated), got {cap!r}")
    with torch.no_grad():
        log_ratio = (trainer_logp - rollout_logp) * mask
        if level == "sequence":
            log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(mask)
        return torch.clamp(torch.exp(log_ratio), max=cap) * mask


def mismatch(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's.

    ``kl``: the K3 estimate of KL(pi_rollout || pi_trainer) per token (the tokens were
    sampled by the engine, so this direction has an unbiased estimate);
    ``max_abs``/``mean_abs``: of the log-prob difference; ``ratio_max``: the largest
    ``pi_trainer / pi_rollout``, what a cap truncates.
    """
    check_tensor(trainer_logp, "trainer_logp", ndim=2, dtypes=[torch.float32, torch.float64])
    check_same_shape(trainer_logp=trainer_logp, rollout_logp=rollout_logp, mask=mask)
    with torch.no_grad():
        on = mask > 0
        if not on.any():
            raise ValueError("the mask counts no token")
        diff = (trainer_logp - rollout_logp)[on]
        return {"kl": float(k3_kl(rollout_logp[on], trainer_logp[on]).mean()),
                "max_abs": float(diff.abs().max()), "mean_abs": float(diff.abs().mean()),
                "ratio_max": float(diff.exp().max())}
