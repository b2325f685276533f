"""The peer this chapter is checked against: HF transformers' Qwen3-MoE sparse block.

Built from a tiny random config (nothing is downloaded) and loaded with *our* weights, so
the same inputs must give the same outputs. transformers is imported here, lazily: the
rest of :mod:`labkit.moe` never needs it.
"""

from __future__ import annotations

import torch

from .layer import MoEWeights


def qwen3_moe_block(weights: MoEWeights):
    """A ``Qwen3MoeSparseMoeBlock`` holding ``weights`` (in their dtype, on their device).

    transformers 5 stores the experts as two 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]``), the layout :class:`MoEWeights` copies; releases that
    keep one ``nn.Module`` per expert get the same numbers split per expert.
    """
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=weights.hidden,
        moe_intermediate_size=weights.intermediate,
        num_experts=weights.num_experts,
        num_experts_per_tok=weights.top_k,
        norm_topk_prob=weights.normalize,
        hidden_act="silu",
    )
    block = Qwen3MoeSparseMoeBlock(config).to(device=weights.router.device, dtype=weights.router.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(weights.router)
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):
            experts.gate_up_proj.copy_(weights.gate_up)
            experts.down_proj.copy_(weights.down)
        else:
            i = weights.intermediate
            for e, mlp in enumerate(experts):
                mlp.gate_proj.weight.copy_(weights.gate_up[e, :i])
                mlp.up_proj.weight.copy_(weights.gate_up[e, i:])
                mlp.down_proj.weight.copy_(weights.down[e])
    return block.eval()


def qwen3_moe_forward(weights: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """HF's output for tokens ``x`` (``[T, H]``); older blocks also return logits, dropped here."""
    with torch.no_grad():
        out = qwen3_moe_block(weights)(x[None])
    if isinstance(out, tuple):
        out = out[0]
    return out[0]
