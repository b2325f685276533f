"""Sampling a group of completions per prompt, and the mask of what they generated.

The rollout runs without gradients: it only produces token ids. Log-probs for the loss
are recomputed afterwards in one batched forward, as trainers do, because the rollout
engine (here a plain sampling loop; in verl or TRL often vLLM) is not the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..validate import check_positive_int, check_tensor

Policy = Callable[[torch.Tensor], torch.Tensor]  # tokens [N, T] -> logits [N, T, vocab]


@dataclass
class Rollout:
    tokens: torch.Tensor  # [N, P + new]: prompt then completion, padding after eos
    mask: torch.Tensor  # [N, P + new - 1], aligned with token_logprobs: 1 on counted completion tokens
    prompt_length: int

    @property
    def completions(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_length:]

    @property
    def lengths(self) -> torch.Tensor:
        """Completion tokens counted per sequence (up to and including eos)."""
        return self.mask.sum(dim=1)


def completion_mask(completions: torch.Tensor, eos: int) -> torch.Tensor:
    """1 up to and including the first ``eos`` of each row, 0 after it (padding)."""
    check_tensor(completions, "completions", ndim=2, dtypes=[torch.int64])
    is_eos = (completions == eos).int()
    before_or_at = torch.cumsum(is_eos, dim=1) - is_eos == 0  # no eos strictly before this position
    return before_or_at.float()


@torch.no_grad()
def sample_group(policy: Policy, prompts: torch.Tensor, *, group_size: int, max_new_tokens: int,
                 eos: int, pad: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> Rollout:
    """``group_size`` sampled completions for each prompt row (rows of the same length).

    The prompts are repeated so that the ``G`` completions of prompt ``b`` are rows
    ``b*G .. b*G+G-1``, the layout :func:`labkit.grpo.loss.group_advantages` expects.
    Each step recomputes the whole prefix: the task's sequences are a dozen tokens, and the
    KV-cache chapter shows the cached version that long sequences need.
    """
    check_tensor(prompts, "prompts", ndim=2, dtypes=[torch.int64])
    check_positive_int(group_size, "group_size")
    check_positive_int(max_new_tokens, "max_new_tokens")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    tokens = prompts.repeat_interleave(group_size, dim=0)
    finished = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
    for _ in range(max_new_tokens):
        logits = policy(tokens)[:, -1].float() / temperature
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(tokens.device)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        finished |= nxt == eos
        if finished.all():
            break
    p = prompts.shape[1]
    mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    mask[:, p - 1:] = completion_mask(tokens[:, p:], eos)
    return Rollout(tokens, mask, p)
