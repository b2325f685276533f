"""Dynamic sampling (DAPO): train only on groups whose rewards differ.

A group whose completions all earn the same reward has advantage 0 for every token: it
costs a rollout and a trainer pass and contributes no gradient, only a smaller effective
batch. DAPO (Yu et al. 2025) filters such groups out and keeps sampling until the batch
has enough informative ones; late in a run, when most prompts are always solved, that is
most groups.
"""

from __future__ import annotations

import torch

from ..validate import check_positive_int, check_tensor


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` bools: which groups of ``group_size`` consecutive rewards are not all equal."""
    check_tensor(rewards, "rewards", ndim=1, dtypes=[torch.float32, torch.float64])
    check_positive_int(group_size, "group_size")
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """The row indices of the sequences of the groups selected by bools ``groups`` ``[B]``."""
    check_tensor(groups, "groups", ndim=1, dtypes=[torch.bool])
    check_positive_int(group_size, "group_size")
    chosen = torch.nonzero(groups).flatten()
    return (chosen[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()
