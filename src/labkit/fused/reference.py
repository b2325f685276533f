"""The fused ops in plain torch, written as Hugging Face's ``Qwen3ForCausalLM`` computes them.

These are the oracles every kernel is checked against, and what "torch eager" and
"torch.compile" run in the benchmarks. Each is a few eager operations, one pass over
memory apiece; the kernels do the same arithmetic in one pass.

The rounding follows HF's modules (``Qwen3RMSNorm``, ``apply_rotary_pos_emb``,
``Qwen3MLP``): the norm's statistic in fp32, the normalised row rounded to the input's
dtype *before* the weight multiplies it (Liger calls this the "llama" casting mode),
everything else in the tensors' own dtype. Called on float64 inputs they are the exact
answer that every dtype's result is measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension (``Qwen3RMSNorm``)."""
    x32 = x.float() if x.dtype != torch.float64 else x
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: ``(rms_norm(x + residual), x + residual)``."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the two halves of the last dimension (HF's layout)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[B, T, Hq, D]`` and ``k`` ``[B, T, Hk, D]`` by the angles of their
    positions; ``cos``, ``sin`` are ``[T, D]`` with equal halves (as
    :class:`labkit.models.decoder.RotaryEmbedding` makes them). Out of place."""
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the gated activation between SwiGLU's up- and down-projection."""
    return F.silu(gate) * up


def swiglu_halves_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the two halves of ``gate_up``'s last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def qkv_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                            kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` ``[N, H, D]`` from a stacked projection's output ``qkv`` ``[N, (Hq + 2 Hk) D]``:
    the queries and keys through their norms and the rotation (as the Qwen3 attention module
    runs them, one op after another), the values as they are."""
    head_dim = cos.shape[-1]
    q, k, v = qkv.unflatten(-1, (q_heads + 2 * kv_heads, head_dim)).split([q_heads, kv_heads, kv_heads], dim=1)
    q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    q, k = rope_reference(q[None], k[None], cos, sin)
    return q[0], k[0], v
