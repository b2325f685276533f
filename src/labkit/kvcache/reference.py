"""Plain-torch decode attention: the oracle, and the split-KV algorithm step by step.

:func:`decode_attention_reference` is the definition: softmax of one query against each
sequence's first ``lengths[b]`` cached keys, in float64. :func:`split_partials` and
:func:`combine_partials` are what the Triton kernels do, written in torch so the chapter
can show that dealing the cache out to splits and merging by log-sum-exp changes nothing.
"""

from __future__ import annotations

import torch


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` per sequence over its cached positions, in float64.

    ``q`` ``[batch, q_heads, d]``; caches ``[batch, kv_heads, capacity, d]``; query head
    ``h`` reads KV head ``h // (q_heads // kv_heads)``. Returns float64 ``[batch, q_heads, d]``.
    """
    batch, q_heads, d = q.shape
    group = q_heads // k_cache.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty(batch, q_heads, d, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lengths.tolist()):
        k = k_cache[b, :, :n].double().repeat_interleave(group, dim=0)  # [q_heads, n, d]
        v = v_cache[b, :, :n].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int, tile: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one head: each split's normalized output ``o_s`` and ``lse_s`` (natural log).

    The positions are cut into tiles of ``tile`` and dealt round-robin, as the kernel deals
    them: split ``s`` gets tiles ``s, s + num_splits, ...``. A split that gets no tile has
    ``o_s = 0`` and ``lse_s = -inf``. ``q`` ``[d]``, ``k``/``v`` ``[n, d]``. Returns
    ``[num_splits, d]`` and ``[num_splits]``.
    """
    scores = (k @ q) * scale
    tile_of = torch.arange(k.shape[0], device=k.device) // tile
    outs, lses = [], []
    for s in range(num_splits):
        mine = tile_of % num_splits == s
        if not mine.any():
            outs.append(torch.zeros_like(q))
            lses.append(torch.tensor(float("-inf"), dtype=scores.dtype, device=k.device))
            continue
        lse = torch.logsumexp(scores[mine], 0)
        outs.append(torch.exp(scores[mine] - lse) @ v[mine])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def combine_partials(o_parts: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The exact merge: ``sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``, ``M = max lse_s``.

    Each ``o_s`` is normalized by its own split's softmax sum ``exp(lse_s)``; weighting by
    ``exp(lse_s)`` undoes that and dividing by the total applies the global one.
    Subtracting ``M`` first keeps every exponential in ``(0, 1]``; an empty split
    (``lse_s = -inf``) weighs nothing.
    """
    weights = torch.exp(lses - lses.max())
    return (weights[:, None] * o_parts).sum(0) / weights.sum()
