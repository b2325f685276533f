"""Attention in plain torch: the oracle, the tiled online-softmax algorithm, its backward.

Three references, each the specification of a kernel in :mod:`labkit.attention.kernels`:

- :func:`naive_attention` materializes the (N, N) score matrix: the definition, and what
  a float64 oracle computes.
- :func:`tiled_attention` is FlashAttention-2's forward written with torch ops on tiles:
  one Q tile at a time, key tiles streamed past it, an online softmax (running max and
  sum, rescaled as the max grows). Same arithmetic as the Triton kernel, no (N, N) matrix.
- :func:`attention_backward` is the backward FlashAttention computes: P rebuilt from the
  saved logsumexp, and the softmax gradient through ``D = rowsum(dO * O)``.

All take (batch, heads, seq, dim) tensors; K and V may have fewer heads than Q (GQA/MQA)
and another length (``n_keys`` for ``n_queries``); the causal mask is then aligned to the
bottom right, as :mod:`labkit.attention` documents.
"""

from __future__ import annotations

import math

import torch


def expand_kv(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each K/V head for the ``n_heads // k.shape[1]`` query heads that share it."""
    return k.repeat_interleave(n_heads // k.shape[1], dim=1)


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str) -> torch.Tensor:
    """``True`` where query ``i`` may see key ``j``: ``j <= i + n_keys - n_queries``.

    Aligned to the bottom right, so the last query sees every key; ``j <= i`` when the
    lengths are equal.
    """
    rows = torch.arange(n_queries, device=device) + (n_keys - n_queries)
    return rows[:, None] >= torch.arange(n_keys, device=device)[None, :]


def naive_attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``(softmax(scale * Q K^T) V, logsumexp)`` with the full score matrix, in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    s = scale * (q @ k.transpose(-1, -2))
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def tiled_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int = 64, block_n: int = 64):
    """FlashAttention-2's forward in torch: online softmax over key tiles, per Q tile.

    For each Q tile the state is a running max ``m`` (per row), a running sum ``l`` of
    ``exp(s - m)`` and an unnormalized output ``acc``. A new key tile with scores ``s``
    raises the max to ``m'``; everything accumulated so far was weighted by ``exp(. - m)``
    and is brought to ``exp(. - m')`` by one factor ``alpha = exp(m - m')``. Dividing by
    ``l`` waits until the last tile. Tiles wholly above the causal diagonal are skipped.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    n_q, n_k = q.shape[2], k.shape[2]
    shift = n_k - n_q  # causal: query i sees keys j <= i + shift
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=q.dtype, device=q.device)
    for i0 in range(0, n_q, block_m):
        qi = q[:, :, i0:i0 + block_m]
        rows = torch.arange(i0, i0 + qi.shape[2], device=q.device) + shift
        m = torch.full(qi.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        last_key = min(n_k, i0 + qi.shape[2] + shift) if causal else n_k
        for j0 in range(0, last_key, block_n):
            kj, vj = k[:, :, j0:j0 + block_n], v[:, :, j0:j0 + block_n]
            s = scale * (qi @ kj.transpose(-1, -2))
            if causal:
                cols = torch.arange(j0, j0 + kj.shape[2], device=q.device)
                s = s.masked_fill(rows[:, None] < cols[None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vj
            m = m_new
        out[:, :, i0:i0 + block_m] = acc / l[..., None]
        lse[:, :, i0:i0 + block_m] = m + torch.log(l)
    return out, lse


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None):
    """``(dQ, dK, dV)`` as FlashAttention computes them, materializing P for clarity.

    With ``S = scale * Q K^T``, ``P = exp(S - lse)`` (rebuilt, not stored) and ``O = P V``:
    ``dV = P^T dO``; ``dP = dO V^T``; the softmax gradient is
    ``dS = P * (dP - D)`` with ``D = rowsum(dP * P) = rowsum(dO * O)`` (the second form
    needs only O and dO, N*d numbers instead of N*N); ``dQ = scale * dS K`` and
    ``dK = scale * dS^T Q``. K/V heads shared by a group get the group's summed gradient.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    h, h_kv = q.shape[1], k.shape[1]
    ke, ve = expand_kv(k, h), expand_kv(v, h)
    s = scale * (q @ ke.transpose(-1, -2))
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ do
    dp = do @ ve.transpose(-1, -2)
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * (ds @ ke)
    dk = scale * (ds.transpose(-1, -2) @ q)

    def per_kv_head(g: torch.Tensor) -> torch.Tensor:
        return g.unflatten(1, (h_kv, h // h_kv)).sum(dim=2)

    return dq, per_kv_head(dk), per_kv_head(dv)
