"""Fused kernels for the non-matmul parts of a Qwen3 layer: chapter "Qwen3, layer by layer".

>>> y = rms_norm(x, weight, eps)                   # Qwen3RMSNorm, one pass
>>> y, stream = add_rms_norm(x, residual, weight, eps)   # x + residual, then the next norm
>>> q, k = rope_(q, k, cos, sin)                   # rotary embedding, in place, [B, T, H, D]
>>> h = swiglu(gate, up)                           # silu(gate) * up
>>> h = swiglu_halves(gate_up)                     # the same, of one stacked matmul's halves (inference)
>>> q = qkv_norm_rope(qkv, qw, kw, eps, cos, sin, q_out=q, k_out=k_pool, v_out=v_pool, slot_mapping=slots)

The first four have a backward (they are ``torch.autograd.Function`` s); the last two are
inference's, forward only: they read the outputs of the stacked projections an inference
engine runs (:meth:`labkit.models.Decoder.fuse_projections`). All match Hugging Face's
``Qwen3ForCausalLM`` modules, including where they round. The layout follows
Liger-Kernel's: the Triton kernels and their launchers in :mod:`labkit.fused.kernels`, the
autograd wrappers in :mod:`labkit.fused.autograd`, the plain-torch oracles in
:mod:`labkit.fused.reference`, the measurements in :mod:`labkit.fused.bench`; this module
checks its inputs and calls them.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_same_device, check_same_shape, check_tensor, dtype_name
from . import kernels
from .autograd import AddRMSNormFunction, RMSNormFunction, RoPEFunction, SwiGLUFunction

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

__all__ = ["DTYPES", "add_rms_norm", "qkv_norm_rope", "rms_norm", "rope_", "swiglu", "swiglu_halves"]


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


def _forward_only(name: str, *tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{name} is inference's, forward only (no backward): call it under torch.no_grad(), "
                           f"or use the separate ops for training")


def swiglu_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate`` and ``up`` are the two halves of the last dimension
    of contiguous ``gate_up`` ``[..., 2M]`` (one matmul by the stacked gate and up weights);
    ``[..., M]`` out. Forward only."""
    _check(gate_up, "gate_up")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got shape {tuple(gate_up.shape)}")
    _forward_only("swiglu_halves", gate_up)
    return kernels.swiglu_halves_forward(gate_up)


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, *, q_out: torch.Tensor, k_out: torch.Tensor,
                  v_out: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """A stacked q/k/v projection's output to attention's inputs, in one pass. Forward only.

    ``qkv`` ``[N, (Hq + 2 Hk) * D]`` holds each token's ``Hq`` query heads, then ``Hk`` key
    heads, then ``Hk`` value heads (rows may be strided, each row contiguous). The queries go
    through ``q_norm`` (weight ``q_weight`` ``[D]``) and the rotation into ``q_out``
    ``[N, Hq, D]``; the keys through ``k_norm`` (``k_weight``) and the rotation into row
    ``slot_mapping[t]`` of ``k_out`` ``[S, Hk, D]`` (row ``t`` when ``slot_mapping`` is None);
    the values, unchanged, into the same row of ``v_out``. A paged pool's
    ``[blocks, block_size, Hk, D]`` viewed as ``[blocks * block_size, Hk, D]`` is such a
    store. ``cos``, ``sin``: ``[N, D]`` with equal halves, as
    :class:`labkit.models.decoder.RotaryEmbedding` makes them. Returns ``q_out``.
    """
    check_tensor(qkv, "qkv", ndim=2, dtypes=DTYPES, device=backend.device())
    if qkv.stride(1) != 1:
        raise ValueError(f"each row of qkv must be contiguous, got strides {tuple(qkv.stride())}")
    _check(q_out, "q_out", ndim=3)
    num_tokens, q_heads, head_dim = q_out.shape
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        check_tensor(t, name, ndim=3, dtypes=DTYPES, device=backend.device())
        if t.shape[2] != head_dim or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be [S, kv_heads, D={head_dim}] with each row's heads and dims contiguous, "
                             f"got shape {tuple(t.shape)} strides {tuple(t.stride())}")
    kv_heads = k_out.shape[1]
    if v_out.shape[1] != kv_heads:
        raise ValueError(f"k_out and v_out must have the same kv_heads, got {k_out.shape[1]} and {v_out.shape[1]}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    if tuple(qkv.shape) != (num_tokens, (q_heads + 2 * kv_heads) * head_dim):
        raise ValueError(f"qkv must be [N={num_tokens}, (Hq={q_heads} + 2 * Hk={kv_heads}) * D={head_dim}] "
                         f"(from q_out and k_out), got {tuple(qkv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(t, name, ndim=2)
        if tuple(t.shape) != (num_tokens, head_dim):
            raise ValueError(f"{name} must be [N={num_tokens}, D={head_dim}], got {tuple(t.shape)}")
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(t, name, ndim=1, dtypes=DTYPES, device=backend.device(), contiguous=True)
        if t.shape[0] != head_dim:
            raise ValueError(f"{name} must be [D={head_dim}], got {tuple(t.shape)}")
    _check_same_dtype(qkv=qkv, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, q_out=q_out, k_out=k_out,
                      v_out=v_out)
    if slot_mapping is None:
        if k_out.shape[0] < num_tokens or v_out.shape[0] < num_tokens:
            raise ValueError(f"without slot_mapping, k_out and v_out need a row per token ({num_tokens}), got "
                             f"{k_out.shape[0]} and {v_out.shape[0]}")
    else:
        check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int32, torch.int64), contiguous=True)
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping must be [N={num_tokens}], got {tuple(slot_mapping.shape)}")
    check_same_device(qkv=qkv, q_out=q_out, k_out=k_out, v_out=v_out, cos=cos, sin=sin,
                      **({} if slot_mapping is None else {"slot_mapping": slot_mapping}))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    _forward_only("qkv_norm_rope", qkv, q_weight, k_weight)
    kernels.qkv_norm_rope(qkv, q_weight, k_weight, float(eps), cos, sin, q_out=q_out, k_out=k_out, v_out=v_out,
                          slot_mapping=slot_mapping)
    return q_out
