"""Choosing codes better than round-to-nearest: GPTQ's error compensation and AWQ's scaling.

Both minimize a layer's *output* error ``||X W^T - X Q^T||^2`` over calibration inputs
``X`` ``[tokens, K]`` rather than the weight error ``||W - Q||^2``. The output error of a
row ``w`` is ``(w - q) H (w - q)^T`` with ``H = X^T X``: what matters is error along the
directions the inputs actually take.

GPTQ (Frantar et al., 2023) quantizes one input column at a time and spreads each
column's rounding error onto the columns not yet quantized, in the least-squares-optimal
way (Optimal Brain Surgeon's update). With ``U`` the upper Cholesky factor of ``H^-1``,
column ``i``'s error ``e = (w_i - q_i) / U_ii`` updates ``W[:, j] -= e U_ij`` for ``j > i``.
The reference implementation batches these rank-1 updates in blocks of 128 columns for
speed; at the book model's sizes the plain loop is clear and fast enough.

AWQ (Lin et al., 2024) keeps RTN but first scales input channel ``k`` of ``W`` by
``s_k = mean|x_k|^alpha`` (and divides the input by it, folded into the previous op),
so the weights that meet large activations get finer effective steps; ``alpha`` is
searched on the calibration output error.
"""

from __future__ import annotations

import torch

from ..validate import check_choice, check_tensor
from .reference import QuantizedWeight, _store, dequantize, encode, group_params, quantize_rtn


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``X^T X / tokens`` in float64 from calibration inputs ``x`` ``[..., K]``."""
    check_tensor(x, "x", dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    x2 = x.reshape(-1, x.shape[-1]).double()
    return x2.T @ x2 / x2.shape[0]


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
                  damp: float = 0.01, scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """GPTQ: codes for ``w`` ``[N, K]`` that minimize the output error under ``h`` ``[K, K]``.

    Group scales are chosen when the loop reaches a group's first column, from the
    weights as already updated (as GPTQ does with ``groupsize``); ``damp`` adds that
    fraction of ``mean(diag h)`` to the diagonal so the Cholesky factorization exists.
    """
    check_tensor(w, "w", ndim=2)
    check_tensor(h, "h", ndim=2)
    check_choice(bits, "bits", (4, 8))
    n, k = w.shape
    if tuple(h.shape) != (k, k):
        raise ValueError(f"h must be [{k}, {k}] for a weight with K = {k}, got {tuple(h.shape)}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size {group_size}")
    W = w.double().clone()
    H = h.double().clone()
    dead = torch.diag(H) == 0  # inputs that never fire: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype, device=H.device)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // group_size, dtype=torch.float64, device=w.device)
    zeros = torch.empty_like(scales)
    for i in range(k):
        g = i // group_size
        if i % group_size == 0:
            scales[:, g], zeros[:, g] = group_params(W[:, i:i + group_size], bits, symmetric)
        u = encode(W[:, i], scales[:, g], zeros[:, g], bits)
        codes[:, i] = u
        q = (u.double() - zeros[:, g]) * scales[:, g]
        err = (W[:, i] - q) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    return _store(codes, scales, zeros, bits, group_size, symmetric, scale_dtype)


def awq_scales(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
               alphas: tuple[float, ...] = tuple(a / 10 for a in range(11))) -> tuple[torch.Tensor, float]:
    """AWQ-style per-input-channel scales ``s`` ``[K]`` and the ``alpha`` that won.

    The quantized layer is ``x / s @ dequant(RTN(W * s))^T``; ``alpha = 0`` is plain RTN.
    """
    check_tensor(w, "w", ndim=2)
    check_tensor(x, "x")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but w has K = {w.shape[1]} inputs")
    x2 = x.reshape(-1, x.shape[-1]).float()
    ref = x2 @ w.float().T
    magnitude = x2.abs().mean(0).clamp(min=1e-8)
    best = (float("inf"), None, 0.0)
    for alpha in alphas:
        s = magnitude**alpha
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1
        effective = dequantize(quantize_rtn(w.float() * s, bits, group_size)) / s
        err = (x2 @ effective.T - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]
