"""An MoE layer's parameters, laid out the way HF transformers' Qwen3-MoE stores them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import check


@dataclass(frozen=True)
class MoEWeights:
    """``router``: ``[E, H]``; ``gate_up``: ``[E, 2I, H]`` (gate rows, then up rows);
    ``down``: ``[E, H, I]``; ``top_k`` experts per token; ``normalize``: renormalize the
    kept top-k weights (Qwen3-MoE's ``norm_topk_prob``)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    normalize: bool = True

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    @property
    def hidden(self) -> int:
        return self.router.shape[1]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]

    def to(self, dtype: torch.dtype) -> MoEWeights:
        return MoEWeights(self.router.to(dtype), self.gate_up.to(dtype), self.down.to(dtype),
                          self.top_k, self.normalize)

    def experts(self, first: int, last: int) -> MoEWeights:
        """Experts ``first:last`` only (what one expert-parallel rank holds); router kept whole."""
        return MoEWeights(self.router, self.gate_up[first:last], self.down[first:last],
                          self.top_k, self.normalize)


def random_moe_weights(
    num_experts: int, hidden: int, intermediate: int, top_k: int, *,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
) -> MoEWeights:
    """Random weights scaled like a trained layer's (``1/sqrt(fan_in)``), so outputs are O(1)."""
    return MoEWeights(
        router=check.randn(num_experts, hidden, dtype=dtype, device=device, seed=seed, scale=hidden**-0.5),
        gate_up=check.randn(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device,
                            seed=seed + 1, scale=hidden**-0.5),
        down=check.randn(num_experts, hidden, intermediate, dtype=dtype, device=device,
                         seed=seed + 2, scale=intermediate**-0.5),
        top_k=top_k,
    )
