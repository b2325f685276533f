"""MLA decode in plain torch: the naive way (decompress, then attend) and the absorbed way.

Multi-head latent attention (DeepSeek-V2) caches, per token and layer, one latent vector
``c`` (``kv_lora_rank`` wide, 512 in DeepSeek-V2/V3) and one rotary key ``k_pe``
(``qk_rope_head_dim``, 64) shared by all heads. Head ``h``'s key and value are
up-projections of the latent:

    k[h] = [W_UK[h] c ; k_pe]        W_UK[h]: [qk_nope_head_dim, kv_lora_rank]
    v[h] = W_UV[h] c                 W_UV[h]: [v_head_dim, kv_lora_rank]

*Naive* decode materializes them for every cached token and runs ordinary attention.
*Absorbed* decode never does: since ``q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c``,
the query is moved into latent space once per step (``q_latent[h] = W_UK[h]^T q_nope[h]``),
attention runs against the latents themselves, and ``W_UV[h]`` is applied once to the
attention-weighted latent afterwards (in a model, it folds further into the output
projection). Both are exact; only the order of the multiplications changes.

Every function takes the cache as one ``[batch, capacity, latent + rope]`` tensor, a row
per token with the latent first: the layout :func:`labkit.mla.mla_decode` reads.
"""

from __future__ import annotations

import torch


def split_cache(cache: torch.Tensor, latent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent part ``[..., :latent]`` and the rotary-key part ``[..., latent:]`` of cache rows."""
    return cache[..., :latent], cache[..., latent:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_latent[b, h] = W_UK[h]^T q_nope[b, h]``: ``[batch, heads, nope]`` -> ``[batch, heads, latent]``.

    ``w_uk`` is ``[heads, nope, latent]`` (DeepSeek's ``kv_b_proj`` rows for the keys, per head).
    """
    return torch.einsum("bhd,hdr->bhr", q_nope, w_uk)


def unabsorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o[b, h] = W_UV[h] o_latent[b, h]``: ``[batch, heads, latent]`` -> ``[batch, heads, v_dim]``."""
    return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)


def decompress(cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``[batch, heads, capacity, nope + rope]`` and values ``[batch, heads, capacity,
    v_dim]`` from the latent cache: what an MHA cache of the same model would hold."""
    heads, _, latent = w_uk.shape
    c, k_pe = split_cache(cache, latent)
    k_nope = torch.einsum("bnr,hdr->bhnd", c, w_uk)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1)
    return k, torch.einsum("bnr,hvr->bhnv", c, w_uv)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per (sequence, head) over the first ``lengths[b]`` keys: ``q`` ``[b, h, d]``,
    ``k`` and ``v`` ``[b, h, n, .]`` (a size-1 head dimension serves every head). Float64."""
    out = []
    for b, n in enumerate(lengths.tolist()):
        scores = torch.einsum("hd,hnd->hn", q[b].double(), k[b, :, :n].double().expand(q.shape[1], -1, -1)) * scale
        out.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), v[b, :, :n].double().expand(q.shape[1], -1, -1)))
    return torch.stack(out)


def mla_decode_naive_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                               w_uk: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Decompress the cache into per-head K and V, then attend: ``[batch, heads, v_dim]``, float64."""
    k, v = decompress(cache.double(), w_uk.double(), w_uv.double())
    q = torch.cat([q_nope, q_rope], dim=-1)
    return _attend(q, k, v, lengths, scale)


def mla_decode_absorbed_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                                  lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention in latent space: ``softmax((q_latent . c + q_rope . k_pe) * scale) @ c``.

    Returns the attention-weighted latent ``[batch, heads, latent]`` in float64;
    :func:`unabsorb_output` turns it into the heads' outputs.
    """
    latent = q_latent.shape[-1]
    q = torch.cat([q_latent, q_rope], dim=-1)
    c, _ = split_cache(cache, latent)
    return _attend(q, cache[:, None], c[:, None], lengths, scale)  # one key row for all heads
