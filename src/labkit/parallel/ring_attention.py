"""Context parallelism: ring attention over a sequence split across ranks (forward pass).

Each of ``n`` ranks holds the queries, keys and values of ``s/n`` tokens. Attention needs
every key for every query, so the K/V blocks travel around a ring: at step ``i`` rank
``r`` holds the block of rank ``r - i``, attends its own queries to it, and passes it on
while the next block arrives (the exchange is started before the compute, so the two
overlap) {cite}`liu2023ringattention`. The partial results merge exactly as in
FlashAttention's online softmax: each block gives an output ``o_j`` and a log-sum-exp
``l_j`` per query, and ``o = sum_j exp(l_j - l) o_j`` with ``l = logsumexp_j l_j``.

Under a causal mask, a contiguous split gives rank 0 one block of work and rank ``n-1``
``n`` of them. The *zigzag* layout {cite}`zhu2024ringflashattention` gives rank ``r``
chunks ``r`` and ``2n - 1 - r`` of ``2n``, so every rank does the same work:
:func:`token_positions` makes either layout, and the mask follows the positions.

Only K and V travel (``n - 1`` steps of ``2 * s/n * kv_heads * d`` elements per rank),
so grouped-query attention's few K/V heads make the ring cheaper than the activations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..validate import check_choice, check_tensor
from . import comm

LAYOUTS = ("contiguous", "zigzag")


def token_positions(length: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The positions of a length-``length`` sequence that rank ``rank`` holds."""
    check_choice(layout, "layout", LAYOUTS)
    parts = world_size if layout == "contiguous" else 2 * world_size
    if length % parts:
        raise ValueError(f"the {layout} layout cuts the sequence into {parts} equal chunks: "
                         f"length {length} is not a multiple")
    chunk = length // parts
    chunks = [rank] if layout == "contiguous" else [rank, parts - 1 - rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None):
    """Softmax attention of ``q`` over one K/V block: the output and the log-sum-exp per query."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.softmax(scores, dim=-1) @ v, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   layout: str = "contiguous", group: dist.ProcessGroup | None = None,
                   stats: dict | None = None) -> torch.Tensor:
    """Attention of this rank's queries ``[b, H, s/n, d]`` over the whole sequence's keys.

    ``k`` and ``v`` ``[b, H_kv, s/n, d]`` hold this rank's tokens, laid out by ``layout``
    (see :func:`token_positions`). Computes in fp32 and returns ``q``'s dtype. If ``stats``
    is a dict it receives ``score_elements``: the query-key pairs this rank computed.
    """
    check_tensor(q, "q", ndim=4, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    check_tensor(k, "k", ndim=4, dtypes=(q.dtype,))
    check_tensor(v, "v", ndim=4, dtypes=(q.dtype,))
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q [b, H, s, d] and k, v [b, H_kv, s, d] with H a multiple of H_kv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    length = q.shape[2] * n
    my_positions = token_positions(length, rank, n, layout).to(q.device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((*q.shape[:3], 1), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).float().contiguous()
    q32 = q.float()
    computed = 0
    peers = (dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)) \
        if group is not None else ((rank + 1) % n, (rank - 1) % n)
    for step in range(n):
        exchange = None
        if step < n - 1:  # start passing this block on before computing with it
            incoming = torch.empty_like(kv)
            comm.send_bytes(kv)
            exchange = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, peers[0], group),
                                               dist.P2POp(dist.irecv, incoming, peers[1], group)])
        source = (rank - step) % n
        visible = None
        if causal:
            visible = token_positions(length, source, n, layout).to(q.device)[None, :] <= my_positions[:, None]
        if visible is None or visible.any():
            block_out, block_lse = _attend_block(q32, kv[0], kv[1], visible)
            computed += q.shape[2] * kv.shape[3] if visible is None else int(visible.sum())
            merged = torch.logaddexp(lse, block_lse)
            # A query that sees nothing in this block has block_lse = -inf and weight 0.
            out = out * torch.exp(lse - merged).nan_to_num(0.0) + torch.nan_to_num(block_out) * torch.exp(block_lse - merged).nan_to_num(0.0)
            lse = merged
        if exchange is not None:
            for work in exchange:
                work.wait()
            kv = incoming
    if stats is not None:
        stats["score_elements"] = computed
    return out.to(q.dtype)
