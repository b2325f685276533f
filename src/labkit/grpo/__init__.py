"""GRPO from first principles: group-relative advantages, the K3 KL, the clipped loss,
rollouts with the right masks, and a real run on a task with a verifiable answer.

``loss`` holds the objective's pieces; ``rollout`` the sampling and its masks; ``task``
the synthetic task and its rule-based reward; ``train`` the warm-up and the GRPO loop;
``reference`` a direct float64 oracle for the loss.
"""

from .loss import NORMALIZATIONS, grpo_loss, group_advantages, k3_kl, token_logprobs
from .rollout import Rollout, completion_mask, sample_group
from .task import AdditionTask
from .train import RunConfig, run

__all__ = [
    "NORMALIZATIONS", "AdditionTask", "Rollout", "RunConfig", "completion_mask", "grpo_loss",
    "group_advantages", "k3_kl", "run", "sample_group", "token_logprobs",
]
