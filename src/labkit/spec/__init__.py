"""Speculative decoding: a small draft model proposes, the target verifies ``k`` tokens in one pass.

>>> from labkit import spec
>>> verdict = spec.verify(draft_tokens, draft_probs, target_probs, generator=gen)   # sampled
>>> verdict = spec.verify(draft_tokens, None, target_logits)                        # greedy
>>> spec.expected_tokens(alpha=0.8, k=4)       # (1 - 0.8**5) / (1 - 0.8)
>>> out = spec.generate_speculative(target_runner, draft_runner, prompt, 256, k=4)

- :mod:`~labkit.spec.verify`: the rejection-sampling verifier (and the greedy one);
- :mod:`~labkit.spec.acceptance`: expected tokens per step, speedup and the best ``k``;
- :mod:`~labkit.spec.stats`: the chi-square test that the output is the target's distribution;
- :mod:`~labkit.spec.runner`: one sequence's forward over ``n`` tokens, from CUDA graphs;
- :mod:`~labkit.spec.loop`: plain and draft-then-verify decoding on those runners;
- :mod:`~labkit.spec.draft`: the target and the draft, trained and distilled on the byte corpus.
"""

from __future__ import annotations

import torch

from ..validate import check_tensor
from .acceptance import acceptance_rate, best_k, estimate_alpha, expected_speedup, expected_tokens
from .draft import (DRAFT_CPU, DRAFT_GPU, DRAFT_PLAN, TARGET_CPU, TARGET_GPU, TARGET_PLAN, TrainPlan, as_dtype,
                    distillation_loss, held_out_loss, train_model)
from .loop import SpecOutput, generate_plain, generate_speculative
from .runner import DenseStepKV, StepRunner
from .stats import ChiSquare, chi_square_test
from .verify import Verdict, exponential_race, residual, verify_greedy, verify_sampled

__all__ = [
    "ChiSquare", "DRAFT_CPU", "DRAFT_GPU", "DRAFT_PLAN", "DenseStepKV", "SpecOutput", "StepRunner", "TARGET_CPU", "TARGET_GPU",
    "TARGET_PLAN", "TrainPlan", "Verdict", "acceptance_rate", "as_dtype", "best_k", "chi_square_test", "distillation_loss",
    "estimate_alpha", "expected_speedup", "expected_tokens", "exponential_race", "generate_plain",
    "generate_speculative", "held_out_loss", "residual", "train_model", "verify", "verify_greedy", "verify_sampled",
]


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target: torch.Tensor,
           generator: torch.Generator | None = None) -> Verdict:
    """Verify ``B`` drafts of ``k`` tokens against the target.

    ``draft_tokens`` ``[B, k]``; ``target`` ``[B, k + 1, V]``. With ``draft_probs``
    (``[B, k, V]``, the distributions the drafts were drawn from) ``target`` holds the
    target's probabilities and the rejection-sampling rule runs; with ``draft_probs=None``
    ``target`` holds its logits and the greedy rule runs. See :mod:`labkit.spec.verify`.
    """
    check_tensor(draft_tokens, "draft_tokens", ndim=2, dtypes=(torch.int32, torch.int64))
    check_tensor(target, "target", ndim=3, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                 device=draft_tokens.device)
    batch, k = draft_tokens.shape
    vocab = target.shape[-1]
    if target.shape[:2] != (batch, k + 1):
        raise ValueError(f"target must be [B, k + 1, V] = [{batch}, {k + 1}, V] for draft_tokens "
                         f"{tuple(draft_tokens.shape)}, got {tuple(target.shape)}")
    if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab}), got values "
                         f"{draft_tokens.min().item()}..{draft_tokens.max().item()}")
    if draft_probs is None:
        return verify_greedy(draft_tokens.long(), target)
    check_tensor(draft_probs, "draft_probs", ndim=3, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                 device=draft_tokens.device)
    if draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [B, k, V] = [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}")
    q_of_draft = draft_probs.gather(-1, draft_tokens.long().unsqueeze(-1))
    if bool((q_of_draft <= 0).any()):
        raise ValueError("every draft token must have positive probability under draft_probs (it was drawn from them)")
    return verify_sampled(draft_tokens.long(), draft_probs, target, generator)
