"""A preference dataset made from a verifiable task: no human labels, no reward model.

For each prompt of :class:`labkit.grpo.AdditionTask` the *chosen* completion is the
correct sum (the task's checker says so) and the *rejected* one is a wrong answer the
warmed-up policy itself sampled, the likeliest of its wrong samples (by mean token
log-prob): the mistakes the model actually makes and believes, which is what on-policy
preference data (as in iterative DPO) is made of. Where every sample of a prompt
was right, the rejected answer is the correct sum moved by a small offset (a plausible
slip: off by one, a wrong tens digit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..grpo import AdditionTask, completion_mask, sample_group, token_logprobs
from ..validate import check_positive_int, check_tensor
from .chunked import IGNORE_INDEX

SLIPS = (1, -1, 10, -10, 2, -2, 9, 11)


@dataclass
class PreferencePairs:
    """``B`` prompts, each with a chosen (correct) and a rejected (wrong) completion."""

    operands: torch.Tensor  # [B, 2]: the numbers each prompt adds
    prompts: torch.Tensor  # [B, P]
    chosen: torch.Tensor  # [B, A]: answer digits, eos, padding
    rejected: torch.Tensor  # [B, A]
    from_policy: torch.Tensor  # [B] bool: the rejected answer was sampled from the policy
    eos: int

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, index: torch.Tensor) -> "PreferencePairs":
        return PreferencePairs(self.operands[index], self.prompts[index], self.chosen[index], self.rejected[index],
                               self.from_policy[index], self.eos)

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs`` ``[2B, P+A-1]`` and ``targets`` of the same shape: chosen rows first,
        then rejected, as :func:`labkit.align.preference_loss` takes them. ``targets[:, t]``
        is the token after ``inputs[:, t]``, ``IGNORE_INDEX`` on the prompt and after eos."""
        completions = torch.cat([self.chosen, self.rejected])
        tokens = torch.cat([self.prompts.repeat(2, 1), completions], dim=1)
        targets = tokens[:, 1:].clone()
        scored = torch.zeros_like(targets, dtype=torch.bool)
        scored[:, self.prompts.shape[1] - 1:] = completion_mask(completions, self.eos).bool()
        targets[~scored] = IGNORE_INDEX
        return tokens[:, :-1], targets


def _pad(answers: list[list[int]], width: int, pad: int) -> torch.Tensor:
    out = torch.full((len(answers), width), pad)
    for i, a in enumerate(answers):
        out[i, : len(a)] = torch.tensor(a)
    return out


def build_pairs(task: AdditionTask, pairs: torch.Tensor, policy: torch.nn.Module | None, *,
                samples_per_prompt: int = 4, generator: torch.Generator) -> PreferencePairs:
    """Preference pairs for the operand ``pairs`` ``[B, 2]``; rejected answers sampled from
    ``policy`` (the likeliest wrong one of ``samples_per_prompt`` at temperature 1), or all slips if it is None."""
    check_tensor(pairs, "pairs", ndim=2, dtypes=[torch.int64])
    check_positive_int(samples_per_prompt, "samples_per_prompt")
    width = task.max_answer_tokens
    prompts = task.prompts(pairs)
    chosen = _pad(task.answers(pairs), width, task.PAD)
    sums = pairs.sum(dim=1)
    slip = torch.tensor(SLIPS)[torch.randint(len(SLIPS), (len(pairs),), generator=generator)]
    slipped = torch.where(sums + slip >= 0, sums + slip, sums - slip)
    rejected = _pad(task.answers(torch.stack([slipped, torch.zeros_like(slipped)], dim=1)), width, task.PAD)
    from_policy = torch.zeros(len(pairs), dtype=torch.bool)
    if policy is not None:
        device = next(policy.parameters()).device
        was_training = policy.training
        policy.eval()
        rollout = sample_group(policy, prompts.to(device), group_size=samples_per_prompt, max_new_tokens=width,
                               eos=task.EOS, pad=task.PAD, generator=generator)
        with torch.no_grad():
            logp = token_logprobs(policy(rollout.tokens), rollout.tokens)
        policy.train(was_training)
        mean_logp = ((logp * rollout.mask).sum(1) / rollout.mask.sum(1).clamp(min=1)).cpu()
        sampled = rollout.completions.cpu()
        sampled = torch.cat([sampled, torch.full((len(sampled), width - sampled.shape[1]), task.PAD)], dim=1)
        sampled[~completion_mask(sampled, task.EOS).bool()] = task.PAD
        wrong = task.reward(sampled, pairs.repeat_interleave(samples_per_prompt, dim=0)) == 0
        score = torch.where(wrong, mean_logp, float("-inf")).view(len(pairs), samples_per_prompt)
        from_policy = wrong.view(len(pairs), samples_per_prompt).any(dim=1)
        picked = sampled.view(len(pairs), samples_per_prompt, width)[torch.arange(len(pairs)), score.argmax(dim=1)]
        rejected = torch.where(from_policy[:, None], picked, rejected)
    return PreferencePairs(pairs, prompts, chosen, rejected, from_policy, task.EOS)
