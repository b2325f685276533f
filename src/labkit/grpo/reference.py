"""The GRPO loss written out directly, one sequence and one token at a time, in float64.

Slow and obvious on purpose: it is the oracle the vectorised :func:`labkit.grpo.loss.grpo_loss`
is tested against, so it shares no code with it.
"""

from __future__ import annotations

import math

import torch


def grpo_loss_reference(logp, old_logp, ref_logp, advantages, mask, *, clip_eps=0.2, beta=0.04,
                        normalization="token") -> torch.Tensor:
    n, t = logp.shape
    token_losses: list[list[torch.Tensor]] = []
    for i in range(n):
        row = []
        for j in range(t):
            if mask[i, j] == 0:
                continue
            lp = logp[i, j].double()
            ratio = torch.exp(lp - float(old_logp[i, j]))
            a = float(advantages[i])
            clipped = min(max(ratio, torch.tensor(1 - clip_eps, dtype=torch.float64)), torch.tensor(1 + clip_eps, dtype=torch.float64))
            surrogate = torch.minimum(ratio * a, clipped * a)
            x = float(ref_logp[i, j]) - lp
            kl = torch.exp(x) - x - 1
            row.append(-(surrogate - beta * kl))
        token_losses.append(row)
    if normalization == "token":
        flat = [x for row in token_losses for x in row]
        return sum(flat) / max(len(flat), 1)
    if normalization == "sequence":
        per_seq = [sum(row) / len(row) for row in token_losses if row]
        return sum(per_seq) / len(per_seq)
    return sum(x for row in token_losses for x in row) / (n * t)


def exact_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two categorical distributions given as probability vectors."""
    return float(sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()) if pi > 0))
