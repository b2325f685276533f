"""The system around GRPO: an inference engine rolls out, a trainer learns, weights sync.

``rollout``: :class:`RolloutWorker`, the policy's copy inside :class:`labkit.serve.LLM`;
``sync``: the weight sync into it; ``tis``: the rollout/trainer mismatch and truncated
importance sampling; ``dynamic``: DAPO's dynamic sampling; ``loop``: the controller, with
one-step off-policy rollouts; ``timeline``: colocated against disaggregated placement.
"""

from .dynamic import group_rows, informative_groups
from .loop import SystemConfig, run, warmed_policy
from .rollout import RolloutBatch, RolloutWorker
from .sync import SyncStats, sync_weights
from .tis import mismatch, tis_weights

__all__ = [
    "RolloutBatch", "RolloutWorker", "SyncStats", "SystemConfig", "group_rows", "informative_groups",
    "mismatch", "run", "sync_weights", "tis_weights", "warmed_policy",
]
