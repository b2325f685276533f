"""The fused LoRA linear as a ``torch.autograd.Function``: what :func:`labkit.lora.lora_linear` runs.

Forward, for ``x`` flattened to ``[M, K]``:

    u  = x A^T                          (cuBLAS, [M, r])
    y  = x W^T + s u B^T (+ bias)       (one Triton pass: matmul_lowrank)

Backward, from ``dy`` ``[M, N]``:

    du = s dy B                         (cuBLAS, [M, r])
    dx = dy W + du A                    (the same Triton kernel, operands swapped)
    dA = du^T x,   dB = s dy^T u        (cuBLAS, reductions over M into [r, K] and [N, r])

It saves ``x`` and ``u`` (``r`` numbers a token) and never an ``[M, N]`` intermediate. The
frozen ``W`` gets a gradient only if it requires one (full fine-tuning through the same
layer): ``dW = dy^T x``, one more cuBLAS matmul.
"""

from __future__ import annotations

import torch

from . import kernels


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (a @ b)`` as one GEMM, the scale applied in its epilogue (cuBLAS's alpha): one
    launch and one rounding, where ``(a @ b) * scale`` takes two of each. With ``beta=0`` the
    0-d ``input`` is never read."""
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=scale)


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scaling, bias):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        u = x2 @ lora_a.T
        y = kernels.matmul_lowrank(x2, weight.T, u, lora_b.T, scaling, bias)
        ctx.save_for_backward(x2, u, weight, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, u, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        du = _scaled_mm(dy2, lora_b, s)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = kernels.matmul_lowrank(dy2, weight, du, lora_a, 1.0).reshape(*dy.shape[:-1], x2.shape[1])
        dw = dy2.T @ x2 if ctx.needs_input_grad[1] else None
        da = du.T @ x2 if ctx.needs_input_grad[2] else None
        db = _scaled_mm(dy2.T, u, s) if ctx.needs_input_grad[3] else None
        dbias = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[5] else None
        return dx, dw, da, db, None, dbias
