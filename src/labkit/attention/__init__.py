"""FlashAttention: exact attention without the (N, N) matrix, forward and backward in Triton.

The chapter ``chapters/2-transformer-kernels/flash-attention`` builds this step by step.
The kernels are in :mod:`.kernels`, the plain-torch references in :mod:`.reference`,
byte and FLOP counts in :mod:`.cost`, and the benchmarks in :mod:`.bench`. Users call:

- :func:`flash_attention` (differentiable), or :class:`FlashAttentionFunction` directly:
  ``FlashAttentionFunction.apply(q, k, v, causal)`` with ``scale`` defaulting to
  ``1 / sqrt(head_dim)``, the calling convention of a ``torch.autograd.Function``;
- :func:`forward` and :func:`backward`, the two halves without autograd: ``(o, lse)``
  from ``(q, k, v)``, and ``(dq, dk, dv)`` from ``dO`` and what the forward returned.

Layouts. ``q`` is ``(batch, heads, n_queries, head_dim)`` and ``k``, ``v`` are
``(batch, kv_heads, n_keys, head_dim)`` with ``heads % kv_heads == 0`` (fewer K/V heads
is grouped-query attention, one is multi-query); or, for one head, ``q`` is
``(batch, n_queries, head_dim)`` and ``k``, ``v`` ``(batch, n_keys, head_dim)``. Outputs
keep the inputs' layout: ``o`` like ``q``, the logsumexp ``(batch[, heads], n_queries)``.
The last dimension must be contiguous; other strides are free (a ``(batch, seq, heads,
dim)`` tensor viewed through ``.transpose(1, 2)`` needs no copy).

``n_keys`` may differ from ``n_queries``. With ``causal=True`` the mask is aligned to the
bottom right, as in FlashAttention-2: query ``i`` sees keys ``j <= i + n_keys - n_queries``,
so the last query sees every key (queries that extend a prefix of cached keys). That
needs ``n_keys >= n_queries``; fewer keys would leave the first queries with no key at
all and is refused. With equal lengths it is the usual ``j <= i``. Note that
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` aligns the mask to
the top left instead (``j <= i``) when the lengths differ.

Precision. fp16 and bf16 inputs are multiplied on tensor cores with fp32 accumulation;
the softmax statistics, the logsumexp and every accumulator are fp32. fp32 inputs are
multiplied in TF32 on the GPU (Triton's default input precision for fp32 ``tl.dot``:
operands cut to a 10-bit mantissa, accumulated in fp32), so expect errors between fp16's
and bf16's, not fp32's: :data:`FP32_INPUT_TOLERANCE`. Triton's CPU interpreter multiplies
them in full fp32.
"""

from __future__ import annotations

import math

import torch

from .. import backend, validate
from . import kernels

__all__ = [
    "HEAD_DIMS", "DTYPES", "FP32_INPUT_TOLERANCE", "FlashAttentionFunction", "backward", "check_inputs", "flash_attention",
    "forward", "forward_sass",
]

HEAD_DIMS = (16, 32, 64, 128)  # powers of two that tl.dot tiles take; 64 and 128 are the models'
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The relative error to expect from fp32 inputs, whose matmuls run in TF32. Five units of a
# 10-bit mantissa cut without rounding (2^-10), as the book's bf16 tolerance is about five
# units of bf16's rounding: the H200's errors for fp32 inputs exceed what rounding operands
# to 10 bits gives and match dropping their low 13 bits, which makes the unit 2^-10, not 2^-11.
FP32_INPUT_TOLERANCE = 5 * 2.0**-10


def _check_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have its last (head_dim) dimension contiguous, got strides "
            f"{tuple(t.stride())}; call .contiguous() first"
        )


def check_inputs(q, k, v, causal, scale) -> float:
    """Validate the arguments of :func:`forward`; return the softmax scale to use."""
    dev = backend.device()
    for name, t in (("q", q), ("k", k), ("v", v)):
        validate.check_tensor(t, name, ndim=(3, 4), dtypes=DTYPES, device=dev)
        _check_last_dim_contiguous(t, name)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "q, k, v must all be 4-D (batch, heads, seq, head_dim) or all 3-D (batch, seq, head_dim), "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k and v must have q's batch size and head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.ndim == 4 and q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads must be a multiple of k's {k.shape[1]} heads (GQA groups)")
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    if causal and n_keys < n_queries:
        raise ValueError(
            f"causal attention with {n_keys} keys for {n_queries} queries: the mask is aligned to the "
            "bottom right (query i sees keys j <= i + n_keys - n_queries), so the first "
            f"{n_queries - n_keys} queries would see no key; pass at least as many keys as queries"
        )
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


def _with_heads(t: torch.Tensor) -> torch.Tensor:
    """A (batch, seq, dim) tensor as (batch, 1, seq, dim): the kernels' layout, no copy."""
    return t.unsqueeze(1) if t.ndim == 3 else t


def _like_input(t: torch.Tensor, three_d: bool) -> torch.Tensor:
    return t.squeeze(1) if three_d else t


def forward(q, k, v, causal: bool = False, scale: float | None = None):
    """The forward pass alone: ``(o, lse)``, the output and its fp32 logsumexp per query.

    ``o = softmax(scale * q k^T [+ causal mask]) v`` in q's dtype and layout; ``lse`` has
    shape ``(batch, heads, n_queries)`` (``(batch, n_queries)`` for 3-D inputs) and is the
    natural-log ``logsumexp`` of each query's scaled scores, what :func:`backward` needs.
    """
    scale = check_inputs(q, k, v, causal, scale)
    o, lse = kernels.forward(_with_heads(q), _with_heads(k), _with_heads(v), causal, scale)
    return _like_input(o, q.ndim == 3), _like_input(lse, q.ndim == 3)


def backward(do, q, k, v, o, lse, causal: bool = False, scale: float | None = None):
    """The backward pass alone: ``(dq, dk, dv)`` from the upstream gradient ``do``.

    ``q, k, v, causal, scale`` as given to :func:`forward`, ``o, lse`` what it returned.
    The probabilities are recomputed tile by tile from ``q``, ``k`` and ``lse``; nothing
    quadratic in the sequence length is read or stored. Gradients come back contiguous,
    shaped and typed like ``q``, ``k``, ``v`` (a K/V head shared by a group of query heads
    gets the sum of their gradients).
    """
    scale = check_inputs(q, k, v, causal, scale)
    for name, t in (("do", do), ("o", o)):
        validate.check_tensor(t, name, dtypes=(q.dtype,), device=q.device)
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        _check_last_dim_contiguous(t, name)
    validate.check_tensor(lse, "lse", dtypes=(torch.float32,), device=q.device)
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(q.shape[:-1])} (q's without head_dim), "
                         f"got {tuple(lse.shape)}")
    validate.check_tensor(lse, "lse", contiguous=True)  # the kernels index it as one block
    three_d = q.ndim == 3
    q4, k4, v4, o4, do4 = (_with_heads(t) for t in (q, k, v, o, do))
    lse4 = lse.unsqueeze(1) if three_d else lse
    grads = kernels.backward(q4, k4, v4, o4, lse4, do4, causal, scale)
    return tuple(_like_input(g, three_d) for g in grads)


class FlashAttentionFunction(torch.autograd.Function):
    """``o = softmax(scale * q k^T [+ causal mask]) v`` with FA2's forward and backward.

    ``FlashAttentionFunction.apply(q, k, v, causal=False, scale=None)``; inputs as
    :func:`forward` takes them, checked the same way. The forward saves Q, K, V, O and
    the logsumexp (one fp32 per query, shaped like ``o`` without head_dim), never the
    (N, N) probabilities: the backward recomputes them tile by tile from Q, K and the
    logsumexp. That recomputation is the extra 0.5 in the backward's 2.5x FLOP count, and
    what keeps training memory linear in the sequence length.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool = False, scale: float | None = None):
        o, lse = forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # An upstream gradient can arrive broadcast (stride 0) or transposed; the kernels
        # want its rows contiguous like q's.
        dq, dk, dv = backward(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exact ``softmax(scale * q k^T) v``, differentiable, without materializing scores.

    Layouts, dtypes, the causal convention and the precision are the module's (see
    :mod:`labkit.attention`); ``scale`` defaults to ``1 / sqrt(head_dim)``.
    """
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def forward_sass(head_dim: int = 128, *, causal: bool = False, overlap_qk: bool = False, block_m: int = 128,
                 block_n: int = 64, num_warps: int = 8, num_stages: int = 3) -> str:
    """The machine code (SASS) of the FA2 forward compiled for the H200, as ``nvdisasm`` prints it.

    One launch of :func:`labkit.attention.kernels.fa2_forward_kernel` over bf16 tensors of
    ``head_dim`` (16 heads of 2048 tokens), with ``block_m`` queries by ``block_n`` keys a
    tile, ``num_warps`` and ``num_stages``, its unmasked key loop plain or overlapped
    (``overlap_qk``). Compiling needs no GPU (:func:`labkit.sass.compile_sm90`): the code is
    the same on every machine with the same Triton.
    """
    from .. import sass

    validate.check_choice(head_dim, "head_dim", HEAD_DIMS)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        validate.check_positive_int(value, name)
    heads, seq = 16, 2048
    q = torch.empty(1, heads, seq, head_dim, dtype=torch.bfloat16, device=backend.device())
    lse = torch.empty(1, heads, seq, device=q.device)
    args = (q, q, q, q, lse, *q.stride(), *q.stride(), *q.stride(), *q.stride(), heads, 1, seq, seq, seq, seq, 0.1)
    meta = dict(HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, OVERLAP_QK=overlap_qk,
                num_warps=num_warps, num_stages=num_stages)
    return sass.disassemble(sass.compile_sm90(kernels.fa2_forward_kernel.fn, args, meta))
