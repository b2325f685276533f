"""Fused kernels for the non-matmul parts of a Qwen3 layer: chapter "Qwen3, layer by layer".

>>> y = rms_norm(x, weight, eps)                   # Qwen3RMSNorm, one pass
>>> y, stream = add_rms_norm(x, residual, weight, eps)   # x + residual, then the next norm
>>> q, k = rope_(q, k, cos, sin)                   # rotary embedding, in place, [B, T, H, D]
>>> h = swiglu(gate, up)                           # silu(gate) * up

Every function has a backward (they are ``torch.autograd.Function`` s) and matches Hugging
Face's ``Qwen3ForCausalLM`` modules, including where they round. The layout follows
Liger-Kernel's: the Triton kernels and their launchers in :mod:`labkit.fused.kernels`, the
autograd wrappers in :mod:`labkit.fused.autograd`, the plain-torch oracles in
:mod:`labkit.fused.reference`, the measurements in :mod:`labkit.fused.bench`; this module
checks its inputs and calls them.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_same_shape, check_tensor, dtype_name
from .autograd import AddRMSNormFunction, RMSNormFunction, RoPEFunction, SwiGLUFunction

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

__all__ = ["DTYPES", "add_rms_norm", "rms_norm", "rope_", "swiglu"]


def _check(x: object, name: str, **kwargs) -> torch.Tensor:
    return check_tensor(x, name, dtypes=DTYPES, device=backend.device(), contiguous=True, **kwargs)


def _check_same_dtype(**tensors: torch.Tensor) -> None:
    if len({t.dtype for t in tensors.values()}) > 1:
        listed = ", ".join(f"{n} {dtype_name(t.dtype)}" for n, t in tensors.items())
        raise TypeError(f"tensors must share one dtype, got {listed}")


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_tensor(weight, "weight", ndim=1, dtypes=DTYPES, device=backend.device(), contiguous=True)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have x's last dimension ({x.shape[-1]}) entries, "
                         f"got shape {tuple(weight.shape)}")
    _check_same_dtype(x=x, weight=weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: ``weight * x / sqrt(mean(x**2) + eps)``.

    ``x``: any shape, contiguous, fp64/fp32/fp16/bf16 on :func:`labkit.device`;
    ``weight``: ``[x.shape[-1]]`` in ``x``'s dtype. The statistic is fp32 (fp64 for fp64).
    """
    _check(x, "x")
    _check_norm_args(x, weight, eps)
    return RMSNormFunction.apply(x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: a decoder block's residual
    add and the norm that follows it. Both are returned because the sum is the residual
    stream the next block adds to."""
    _check(x, "x")
    _check(residual, "residual")
    check_same_shape(x=x, residual=residual)
    _check_same_dtype(x=x, residual=residual)
    _check_norm_args(x, weight, eps)
    return AddRMSNormFunction.apply(x, residual, weight, float(eps))


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[B, T, Hq, D]`` and ``k`` ``[B, T, Hk, D]`` in place (HF's rotate-half
    convention) and return them.

    ``cos``, ``sin``: ``[T, D]`` with equal halves, as
    :class:`labkit.models.decoder.RotaryEmbedding` makes them; only the first half is read.
    All four contiguous and of one dtype. The layout is the projections' own
    (``wq(x).view(B, T, Hq, D)``), before attention's transpose to ``[B, Hq, T, D]``.
    """
    for name, t in (("q", q), ("k", k)):
        _check(t, name, ndim=4)
    for name, t in (("cos", cos), ("sin", sin)):
        _check(t, name, ndim=2)
    _check_same_dtype(q=q, k=k, cos=cos, sin=sin)
    batch, seq_len, _, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(f"k must be [B={batch}, T={seq_len}, heads, D={head_dim}] like q, got {tuple(k.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    check_same_shape(cos=cos, sin=sin)
    if tuple(cos.shape) != (seq_len, head_dim):
        raise ValueError(f"cos and sin must be [T={seq_len}, D={head_dim}], got {tuple(cos.shape)}")
    return RoPEFunction.apply(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, elementwise; ``gate`` and ``up`` contiguous, same shape and dtype."""
    _check(gate, "gate")
    _check(up, "up")
    check_same_shape(gate=gate, up=up)
    _check_same_dtype(gate=gate, up=up)
    return SwiGLUFunction.apply(gate, up)
