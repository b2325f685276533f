"""The FlashAttention kernels as one differentiable op.

The forward saves Q, K, V, O and the logsumexp (N floats per row of heads), never the
(N, N) probabilities: the backward recomputes them tile by tile from Q, K and the
logsumexp. That recomputation is the extra 0.5 in the backward's 2.5x FLOP count, and
what keeps training memory linear in the sequence length.
"""

from __future__ import annotations

import torch

from . import kernels


class FlashAttentionFunction(torch.autograd.Function):
    """``o = softmax(scale * q k^T [+ causal mask]) v`` with FA2 forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = kernels.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # An upstream gradient can arrive broadcast (stride 0) or transposed; the kernels
        # want its rows contiguous like q's.
        do = do.contiguous()
        dq, dk, dv = kernels.backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None
