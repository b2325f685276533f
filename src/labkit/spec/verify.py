"""The verifier: which of ``k`` drafted tokens the target keeps, and the token it adds.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). The draft proposed
``x_1..x_k``, drawing ``x_i`` from its distribution ``q_i``; one forward pass of the
target over them gave ``p_1..p_{k+1}`` (``p_i`` is the target's distribution for
position ``i``, given the context and ``x_1..x_{i-1}``). Walk the drafts in order:

- keep ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``;
- at the first rejection, stop and draw the replacement from the *residual*
  ``norm(max(0, p_i - q_i))``: the mass where the target wants more than the draft gave;
- if all ``k`` were kept, draw a bonus token from ``p_{k+1}``, which the same forward
  computed for free.

Each emitted token is then distributed exactly as the target's own sample: a token ``x``
comes out of step ``i`` either as an accepted draft, with probability
``q(x) min(1, p(x)/q(x)) = min(q(x), p(x))``, or as a replacement, with probability
``(1 - sum_y min(q(y), p(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))``; the
two sums ``sum_y max(0, p - q)`` and ``1 - sum_y min(p, q)`` are equal, so the second term
is ``max(0, p(x) - q(x))`` and the total is ``min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x)``.

Both functions work on a batch of ``B`` independent drafts and return, per row, how many
drafts were kept (``n``) and the token that follows them (the replacement, or the bonus
when ``n == k``): the row emits ``draft_tokens[:n]`` then ``next_token``. Random draws
use the exponential race (``argmax(probs / E)``, ``E`` exponential, picks ``i`` with
probability ``probs[i] / sum(probs)``), as :func:`labkit.serve.sample_batch` does: the
residual needs no normalising and nothing waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Per row: ``num_accepted`` drafts kept (``[B]``, 0..k) and the ``next_token`` after them (``[B]``)."""

    num_accepted: torch.Tensor
    next_token: torch.Tensor

    def emitted(self, draft_tokens: torch.Tensor, row: int = 0) -> list[int]:
        """The tokens row ``row`` emits: its kept drafts, then the next token (a host read)."""
        n = int(self.num_accepted[row])
        return draft_tokens[row, :n].tolist() + [int(self.next_token[row])]


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of ``mask`` ``[B, k]`` are true before the first false."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def exponential_race(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``weights`` ``[..., V]`` (non-negative, not necessarily normalised),
    index ``i`` with probability ``weights[i] / sum(weights)``."""
    noise = torch.empty(weights.shape, dtype=torch.float32, device=weights.device).exponential_(generator=generator)
    return race_winner(weights, noise)


def race_winner(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(weights / noise)`` over the last dimension, for ``noise`` drawn from Exp(1):
    index ``i`` wins with probability ``weights[i] / sum(weights)``. ``noise`` is clamped
    in place away from 0: exponential noise of exactly 0 (possible on the CPU) would make a
    zero weight 0 / 0 = NaN, which argmax picks (pytorch#48841)."""
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (weights.to(noise.dtype) / noise).argmax(dim=-1)


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)``, unnormalised: where a rejected draft's replacement comes from."""
    return (target_probs.float() - draft_probs.float()).clamp_min(0.0)


def verify_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> Verdict:
    """The rejection-sampling rule on ``B`` drafts of ``k`` tokens (arguments checked by
    :func:`labkit.spec.verify`): ``draft_tokens`` ``[B, k]``, ``draft_probs`` ``[B, k, V]``,
    ``target_probs`` ``[B, k + 1, V]``."""
    k = draft_tokens.shape[1]
    index = draft_tokens.unsqueeze(-1)
    p_draft = target_probs[:, :k].float().gather(-1, index).squeeze(-1)   # p_i(x_i)
    q_draft = draft_probs.float().gather(-1, index).squeeze(-1)            # q_i(x_i) > 0: x_i was drawn from q_i
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = u * q_draft < p_draft                                       # u < p/q, i.e. probability min(1, p/q)
    n = leading_true(accepted)
    # Row i < k: the residual of position i; row k: the target's own p_{k+1} (the bonus).
    fallback = torch.cat([residual(target_probs[:, :k], draft_probs), target_probs[:, k:].float()], dim=1)
    chosen = fallback.gather(1, n.view(-1, 1, 1).expand(-1, 1, fallback.shape[-1])).squeeze(1)
    return Verdict(n, exponential_race(chosen, generator))


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """The temperature-0 rule: keep drafts while they equal the target's argmax; the next token is
    the target's argmax after them. The output is greedy decoding's, token for token."""
    k = draft_tokens.shape[1]
    best = target_logits.argmax(dim=-1)                                    # [B, k + 1]
    n = leading_true(best[:, :k] == draft_tokens)
    return Verdict(n, best.gather(1, n.unsqueeze(1)).squeeze(1))
