"""The kernels as ``torch.autograd.Function`` s: what :mod:`labkit.fused` hands its callers.

Each forward saves what its backward needs and nothing larger: the norm keeps its input
and the fp32 ``rstd`` per row (not the normalised output), SwiGLU keeps its two inputs
and recomputes the sigmoid, RoPE keeps only the angle tables. Inputs arrive checked and
contiguous from :mod:`labkit.fused`; gradients arriving here may be strided (a transposed
view's gradient is), so the backward makes them contiguous first.
"""

from __future__ import annotations

import torch

from . import kernels


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, _, rstd = kernels.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = kernels.rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """``(rms_norm(x + residual), x + residual)``: the residual add fused into the next norm."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, total, rstd = kernels.rms_norm_forward(x, weight, eps, residual=residual)
        ctx.save_for_backward(total, weight, rstd)
        return y, total

    @staticmethod
    def backward(ctx, dy, dtotal):
        total, weight, rstd = ctx.saved_tensors
        # The sum flows on down the residual stream too: its gradient joins the norm's.
        dsum, dw = kernels.rms_norm_backward(dy.contiguous(), total, weight, rstd,
                                             dresidual=dtotal.contiguous() if dtotal is not None else None)
        return dsum, dsum, dw, None


class RoPEFunction(torch.autograd.Function):
    """Rotates ``q`` and ``k`` in place (so it marks them dirty); the backward rotates the
    gradients back, into new tensors."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        kernels.rope(q, k, cos, sin, q_dst=q, k_dst=k)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.contiguous(), dk.contiguous()
        dq_in, dk_in = torch.empty_like(dq), torch.empty_like(dk)
        kernels.rope(dq, dk, cos, sin, q_dst=dq_in, k_dst=dk_in, inverse=True)
        return dq_in, dk_in, None, None


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return kernels.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return kernels.swiglu_backward(dout.contiguous(), gate, up)
