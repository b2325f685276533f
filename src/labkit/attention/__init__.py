"""FlashAttention: exact attention without the (N, N) matrix, forward and backward in Triton.

The chapter ``chapters/2-transformer-kernels/flash-attention`` builds this step by step.
Users call :func:`flash_attention`; the kernels are in :mod:`.kernels`, the plain-torch
references in :mod:`.reference`, the autograd wrapper in :mod:`.autograd`, byte and FLOP
counts in :mod:`.cost`, and the benchmarks in :mod:`.bench`.
"""

from __future__ import annotations

import math

import torch

from .. import backend, validate
from . import kernels
from .autograd import FlashAttentionFunction

__all__ = ["HEAD_DIMS", "DTYPES", "flash_attention", "flash_attention_forward", "check_inputs"]

HEAD_DIMS = (16, 32, 64, 128)  # powers of two that tl.dot tiles take; 64 and 128 are the models'
DTYPES = (torch.float16, torch.bfloat16)


def check_inputs(q, k, v, causal, scale) -> float:
    """Validate the arguments of :func:`flash_attention`; return the softmax scale to use."""
    dev = backend.device()
    for name, t in (("q", q), ("k", k), ("v", v)):
        validate.check_tensor(t, name, ndim=4, dtypes=DTYPES, device=dev)
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have its last (head_dim) dimension contiguous, got strides "
                f"{tuple(t.stride())}; call .contiguous() first"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(
            "k and v must be (batch, kv_heads, seq, head_dim) with q's batch, seq and head_dim "
            f"(self-attention); got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if h % k.shape[1]:
        raise ValueError(f"q's {h} heads must be a multiple of k's {k.shape[1]} heads (GQA groups)")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exact ``softmax(scale * q k^T) v``, differentiable, without materializing scores.

    ``q``: (batch, heads, seq, head_dim); ``k``, ``v``: (batch, kv_heads, seq, head_dim)
    with ``heads % kv_heads == 0`` (kv_heads < heads is GQA, 1 is MQA). fp16 or bf16, the
    last dimension contiguous, head_dim in :data:`HEAD_DIMS`. ``causal`` masks keys after
    the query; ``scale`` defaults to ``1 / sqrt(head_dim)``.
    """
    scale = check_inputs(q, k, v, causal, scale)
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """The forward alone, returning ``(o, lse)``: the output and its fp32 logsumexp (B, H, N)."""

    scale = check_inputs(q, k, v, causal, scale)
    return kernels.forward(q, k, v, causal, scale)
