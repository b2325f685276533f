"""The pieces of the GRPO objective: log-probs of generated tokens, group-relative
advantages, the K3 estimator of KL, and the clipped surrogate with its normalisation.

Shapes: ``G`` completions per prompt, ``B`` prompts, so ``N = B*G`` sequences of ``T``
tokens; ``mask`` is 1 on generated tokens that count (the completion up to and including
its end token) and 0 on the prompt and on padding.
"""

from __future__ import annotations

import torch

from ..validate import check_choice, check_same_shape, check_tensor

NORMALIZATIONS = ("token", "sequence", "constant")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(tokens[:, t] | tokens[:, :t])`` for ``t >= 1``, shape ``[N, T-1]``.

    Position ``t`` of the logits predicts token ``t+1``, hence the shift. The log-softmax is
    taken in float32 whatever the logits' dtype: bf16 log-probs differ by ~1e-2, which
    would show up as a spurious KL and a ratio away from 1 before any update.
    """
    check_tensor(logits, "logits", ndim=3, dtypes=[torch.float32, torch.float16, torch.bfloat16, torch.float64])
    check_tensor(tokens, "tokens", ndim=2, dtypes=[torch.int64])
    if logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, T, vocab] for tokens {tuple(tokens.shape)}")
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean_group(r)) / (std_group(r) + eps)``, one value per completion.

    The group mean is the baseline a critic would otherwise learn: completions better
    than their siblings are pushed up, worse ones down. A group whose rewards are all
    equal carries no signal and gets advantage 0. ``scale=False`` drops the division by
    the standard deviation (Dr. GRPO), which otherwise up-weights prompts that are
    nearly always solved or nearly always failed.
    """
    check_tensor(rewards, "rewards", ndim=1, dtypes=[torch.float32, torch.float64])
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token K3 estimate of KL(policy || reference): ``e^x - x - 1`` with ``x = ref - logp``.

    Sampled from the policy, ``E[e^x] = sum_y p_ref(y) = 1``, so ``E[e^x - 1] = 0`` and the
    mean is ``E[-x] = E[logp - ref]``, the exact KL: unbiased. And ``e^x >= 1 + x``, so every
    sample is >= 0, unlike the plain ``logp - ref`` estimate, whose samples can be negative.
    """
    check_same_shape(logp=logp, ref_logp=ref_logp)
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    normalization: str = "token",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss to minimise, and metrics.

    Per token: ``-(min(r A, clip(r, 1-eps, 1+eps) A) - beta * KL)`` with
    ``r = exp(logp - old_logp)``. ``old_logp`` and ``ref_logp`` are constants (the policy
    that sampled, the frozen reference); only ``logp`` carries gradient.

    ``normalization`` decides how token losses are averaged:
    - ``"token"``: over every counted token in the batch (DAPO); each token weighs the same.
    - ``"sequence"``: per sequence, then over sequences (the original GRPO). A token of a
      short completion weighs more than one of a long completion, a bias by length.
    - ``"constant"``: sum divided by ``N * T`` (Dr. GRPO): no dependence on lengths at all.

    ``is_weights`` (constants, shaped like ``logp``) multiply each token's clipped surrogate:
    the truncated importance-sampling weights that correct for tokens sampled by a
    different policy than ``old_logp``'s (an inference engine's, or a stale one;
    :mod:`labkit.rl.tis`). The KL term is not weighted, as in verl.
    """
    check_tensor(logp, "logp", ndim=2)
    check_same_shape(logp=logp, old_logp=old_logp, ref_logp=ref_logp, mask=mask)
    check_tensor(advantages, "advantages", ndim=1)
    if len(advantages) != len(logp):
        raise ValueError(f"{len(advantages)} advantages for {len(logp)} sequences")
    check_choice(normalization, "normalization", NORMALIZATIONS)
    if old_logp.requires_grad or ref_logp.requires_grad:
        raise ValueError("old_logp and ref_logp must be constants: pass them detached")
    if is_weights is not None:
        check_same_shape(logp=logp, is_weights=is_weights)
        if is_weights.requires_grad:
            raise ValueError("is_weights must be constants: pass them detached")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    if is_weights is not None:
        surrogate = surrogate * is_weights.to(logp.dtype)
    kl = k3_kl(logp, ref_logp)
    per_token = -(surrogate - beta * kl)
    if normalization == "token":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif normalization == "sequence":
        lengths = mask.sum(dim=1)
        per_seq = (per_token * mask).sum(dim=1) / lengths.clamp(min=1)
        loss = per_seq[lengths > 0].mean() if (lengths > 0).any() else per_seq.sum() * 0
    else:
        loss = (per_token * mask).sum() / mask.numel()
    with torch.no_grad():
        counted = mask.sum().clamp(min=1)
        clipped = ((ratio - 1).abs() > clip_eps).to(mask.dtype)
        metrics = {
            "kl": float((kl * mask).sum() / counted),
            "clip_fraction": float((clipped * mask).sum() / counted),
            "ratio_mean": float((ratio * mask).sum() / counted),
        }
    return loss, metrics
