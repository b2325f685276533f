"""Split-KV decode attention (flash-decoding) in two Triton kernels, and their launchers.

Decoding asks for one query token per sequence. A flash-attention kernel parallelizes
over query blocks; with a single query per (sequence, head) that leaves ``batch x heads``
programs, far too few to fill 132 SMs when the batch is small and the cache is long. So
each sequence's cache is dealt out to ``num_splits`` programs, one per (split, KV head,
sequence), and a second kernel merges their partial results.

Kernel 1, :func:`_decode_split_kernel`: one program reads its share of one KV head's
cache *once* and serves all ``GROUP`` query heads that share it (GQA), running the online
softmax over ``BLOCK_N``-position tiles. Split ``s`` takes tiles ``s, s + S, s + 2S, ...``
(round-robin, like a grid-stride loop), not one contiguous stretch: the programs of one
head then read neighbouring tiles at the same moment, so the GPU streams each cache front
to back as a copy kernel does; every split gets the same work (within a tile) at *every*
sequence length, which matters when the split count is fixed for a whole capacity (a
captured CUDA graph); and no split length has to be aligned to anything. It writes its
normalized partial output ``o_s`` and its log-sum-exp ``lse_s = m_s + log2(l_s)`` (base 2,
like the exponentials). With one split there is nothing to merge: the program writes the
answer itself and the second kernel is not launched.

Kernel 2, :func:`_combine_splits_kernel`: per (sequence, query head), the exact merge
``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``. A split
that got no tile of a short sequence has ``lse_s = -inf`` and weight zero.
``DecodeConfig(merge_here=True)`` runs the same merge (:func:`_merge_head`) in kernel 1
instead, in the last split of each (sequence, KV head) to finish, and launches no kernel
2; on the H200 it was slower at every split shape of ``kvcache.decode_attention``, which
times both, so the default launches two kernels.

One kernel, three layouts, chosen by compile-time switches so that the KV cache chapter's
contiguous kernel and the paged-attention chapter's share every line but the addressing:

- ``PAGE_SIZE = 0``: a contiguous cache ``[batch, kv_heads, capacity, d]``
  (:func:`split_kv_decode`);
- ``PAGE_SIZE = B``: a paged pool ``[num_blocks, B, kv_heads, d]``; position ``n`` of
  sequence ``b`` is slot ``n % B`` of block ``block_tables[b, n // B]``, loaded per
  position, so a tile may span several blocks (:func:`paged_split_kv_decode`);
- ``BLOCK_Q > 1``: packed causal queries (``cu_seqlens_q``) over the pool, a prefill or a
  chunk after a cached prefix: a program's rows are ``BLOCK_Q`` queries times the GQA
  group, with one split (:func:`paged_prefill`).

Launch parameters are chosen on the host by :func:`default_config` from the shapes alone
(batch, KV heads, capacity): no autotuner, so the choice is the same at every batch size
for the same reason, costs nothing per call, and is fixed at capture time for a CUDA graph.
:func:`split_kv_decode` takes any :class:`DecodeConfig`, which is how the tuning sweep
(``scratch/kv_tune.py``) forces each candidate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import backend
from ..matmul import kernels as matmul_kernels  # the split-K matmul's tickets

# The tile the splits are counted in, and the default launch: (BLOCK_N, warps, stages).
# The interpreter ignores warps and stages; its small tile gives the tests multi-tile splits.
BLOCK_N, NUM_WARPS, NUM_STAGES = backend.pick(cpu=(16, 4, 3), gpu=(64, 4, 3))
# Programs per SM to aim for when a batch is too small to fill the GPU by itself.
PROGRAMS_PER_SM = 2
# A split with fewer tiles than this spends too much on its partial result and its start-up.
MIN_TILES_PER_SPLIT = 4
# (most programs per SM, (BLOCK_N, warps, stages)) on a GPU, from a sweep of 12 tiles x up
# to 8 split counts at 7 batch/context shapes on an H200 (bf16, head_dim 128, group 4).
# The K/V tiles in flight are what hide HBM's latency, and they live in shared memory
# (228 KB per SM): a program alone on its SM takes the deepest pipeline (128 positions x 3
# stages, 139 KB); two or three share an SM with 64 x 3 (71 KB each); more drop to two
# stages (39 KB) so that all of them stay resident at once, with no second wave.
GPU_TILES = ((1, (128, 8, 3)), (3, (64, 4, 3)), (None, (64, 4, 2)))
# Paged prefill: rows (queries x the query heads of one KV head) per program, and its
# (BLOCK_N, warps, stages). A prompt's many queries fill the GPU without splits.
PREFILL_ROWS, PREFILL_TILE = backend.pick(cpu=(16, (16, 4, 1)), gpu=(64, (64, 4, 2)))


# The split count and the strides that follow it are runtime values, not compile-time ones:
# one compiled kernel serves every split count (Triton would otherwise compile a variant for
# counts divisible by 16 and another for the rest).
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, o_part_ptr, lse_part_ptr,
    block_tables_ptr,       # PAGE_SIZE > 0: [batch, blocks per sequence] int32
    cu_seqlens_q_ptr,       # BLOCK_Q > 1: [batch + 1] int32, sequence b's queries are rows cu[b]:cu[b+1] of q
    out_ptr, tickets_ptr,   # MERGE_HERE: the output; one int32 ticket per (sequence, KV head), zero between launches
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,   # kn: one position; kb: one sequence (contiguous) or one block (paged)
    stride_vb, stride_vh, stride_vn,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    qk_scale_log2,          # softmax scale x log2(e): exponentials are exp2
    num_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FINAL: tl.constexpr,    # one split: o_part_ptr is the output itself, in q's dtype
    PAGE_SIZE: tl.constexpr = 0,  # 0: caches [batch, kv_heads, capacity, d]; else a pool [blocks, PAGE_SIZE, kv_heads, d]
    BLOCK_Q: tl.constexpr = 1,    # queries per sequence in one program; > 1: packed causal queries (one split)
    MERGE_HERE: tl.constexpr = False,  # several splits: the last to finish merges them (no combine kernel)
    BLOCK_S: tl.constexpr = 1,    # MERGE_HERE: num_splits rounded up to a power of two
):
    # Splits vary fastest, so programs running side by side read neighbouring tiles.
    split = tl.program_id(0) % num_splits
    q_tile = tl.program_id(0) // num_splits
    # int64 before any multiply by a stride: a batch of long caches passes 2^31 elements.
    kv_head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    length = tl.load(lengths_ptr + b)

    # A program's rows are BLOCK_Q queries x the GROUP query heads of this KV head, padded
    # to BLOCK_G rows (tl.dot needs >= 16). The padding costs tensor-core work only, of
    # which decoding has plenty to spare.
    r = tl.arange(0, BLOCK_G)
    token = r // GROUP
    heads = kv_head * GROUP + r % GROUP
    if BLOCK_Q == 1:   # decoding: one query per sequence, row b of q
        first_row, num_queries = b, 1
    else:              # the last num_queries of the sequence's positions, packed from row cu[b]
        first_row = tl.load(cu_seqlens_q_ptr + b).to(tl.int64)
        num_queries = tl.load(cu_seqlens_q_ptr + b + 1) - first_row
    query = q_tile * BLOCK_Q + token             # which of the sequence's queries a row holds
    row_ok = (token < BLOCK_Q) & (query < num_queries)
    position = length - num_queries + query      # ... and its position: it sees keys 0..position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = first_row + query
    q = tl.load(q_ptr + q_rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # The last key any row of this program sees (a program past its sequence's queries sees none).
    kv_end = tl.where(q_tile * BLOCK_Q < num_queries,
                      tl.minimum(length, length - num_queries + (q_tile + 1) * BLOCK_Q), 0)
    for tile in range(split, tl.cdiv(kv_end, BLOCK_N), num_splits):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < length  # only a sequence's last tile is partial
        if PAGE_SIZE == 0:
            k_rows = b * stride_kb + n * stride_kn
            v_rows = b * stride_vb + n * stride_vn
        else:
            # Position n lives in slot n % PAGE_SIZE of block table[n // PAGE_SIZE]. Entries
            # past the sequence's blocks may hold anything: they are never loaded.
            if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one block: one table entry
                block = tl.load(block_tables_ptr + b * stride_tb + tile * BLOCK_N // PAGE_SIZE).to(tl.int64)
            else:                         # the tile spans BLOCK_N / PAGE_SIZE blocks (or parts of them)
                block = tl.load(block_tables_ptr + b * stride_tb + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            k_rows = block * stride_kb + (n % PAGE_SIZE) * stride_kn
            v_rows = block * stride_vb + (n % PAGE_SIZE) * stride_vn
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_head * stride_kh + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_head * stride_vh + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if BLOCK_Q == 1:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        else:  # causal; every row sees key 0 (tile 0: these queries run with one split), so m stays finite
            s = tl.where(n_ok[None, :] & (n[None, :] <= position[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split that got no tile of this sequence saw nothing: l_i = 0, so lse = -inf (weight 0).
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = o_part_ptr + q_rows[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    if FINAL:
        tl.store(o_ptrs, o.to(o_part_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)
        if MERGE_HERE:
            # The matmul chapter's split-K tickets: every thread's partial is stored before the
            # ticket is taken (the barrier), and the ticket's release / acquire orders those
            # stores before the last split's loads, which read from L2 (.cg), where the other
            # SMs' stores are. The last split merges this KV head's GROUP query heads.
            tl.debug_barrier()
            ticket_ptr = tickets_ptr + b * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                for g in tl.static_range(GROUP):
                    _merge_head(o_part_ptr, lse_part_ptr, out_ptr, b, kv_head * GROUP + g,
                                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                                num_splits, HEAD_DIM, BLOCK_S, BLOCK_D, ".cg")
                tl.atomic_xchg(ticket_ptr, 0)  # ready for the next launch


@triton.jit
def _merge_head(o_part_ptr, lse_part_ptr, out_ptr, b, h,
                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                CACHE: tl.constexpr):
    """Sequence ``b``, query head ``h``: ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(lse_part_ptr + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"),
                  cache_modifier=CACHE)
    weight = tl.exp2(lse - tl.max(lse, 0))  # the largest split has weight 1; empty ones 0
    o = tl.load(o_part_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0, cache_modifier=CACHE)
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _combine_splits_kernel(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    _merge_head(o_part_ptr, lse_part_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                num_splits, HEAD_DIM, BLOCK_S, BLOCK_D, "")


@dataclass(frozen=True)
class DecodeConfig:
    """How one decode-attention call is launched: splits per sequence, tile, warps, stages.

    ``merge_here``: with several splits, the last split of each (sequence, KV head) to
    finish merges their partial results in the split kernel itself, instead of a second
    (combine) kernel launch.
    """

    num_splits: int
    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    merge_here: bool = False


def default_config(batch: int, kv_heads: int, max_len: int) -> DecodeConfig:
    """The launch for these shapes: split count first, then the tile for the programs per SM.

    A batch whose (sequence, KV head) pairs already give about a program per SM gets one
    split: no partial results, no combine kernel. Fewer pairs get enough splits for about
    ``PROGRAMS_PER_SM`` programs per SM, all running at once, none with fewer than
    ``MIN_TILES_PER_SPLIT`` tiles of a ``max_len`` cache. Then :data:`GPU_TILES` picks the
    tile. Only shapes are read (never ``lengths``, which live on the device), so the choice
    costs no synchronization and holds for every step a CUDA graph replays.
    """
    sms = backend.sm_count()
    pairs = batch * kv_heads
    wanted = PROGRAMS_PER_SM * sms // pairs
    if wanted <= PROGRAMS_PER_SM:  # about a program per SM already: splitting only adds a merge
        splits = 1
    else:
        splits = max(1, min(wanted, triton.cdiv(max_len, BLOCK_N) // MIN_TILES_PER_SPLIT))
    if not backend.on_gpu():
        return DecodeConfig(num_splits=splits)
    per_sm = triton.cdiv(pairs * splits, sms)
    tile = next(t for most, t in GPU_TILES if most is None or per_sm <= most)
    return DecodeConfig(splits, *tile)


# A paged launch takes two pipeline stages more than default_config's. The block-table load
# sits in the software pipeline ahead of the K and V loads whose addresses it supplies, and
# takes depth from them: compiled for sm_90 (Triton 3.9), the paged kernel at the contiguous
# kernel's 2 stages does not pipeline the table load at all, and at 3 or 4 stages it keeps one
# K/V buffer in flight where the contiguous kernel at 3 keeps two; 5 restores two. On the H200
# (record serve.paged_decode_stages, Triton 3.6), one extra stage left a lone program per SM
# (batch 16, 128-position tiles) far behind the contiguous kernel, and two recovered most of
# the gap; at batch 64 one and two extra stages measured alike. For a bf16 cache two more
# stages never make one program need more shared memory than an SM has (the 5-stage
# 128-position launch ran there); for an fp32 one see fit_shared_memory.
PAGED_EXTRA_STAGES = 2
# ... and at most this many warps. At batch 16 (a lone program per SM with 128-position
# tiles, which default_config gives 8 warps), two extra stages left the paged kernel at
# 0.91-0.92 of the contiguous kernel's speed with 8 warps and at 0.97-0.98 with 4 (record
# serve.paged_decode_stages, contexts 4K and 16K, which times both warp counts at each
# depth); batch 64's 64-position tiles run 4 warps already.
PAGED_MAX_WARPS = 4


# At the paged depth a program holds two K tiles and two V tiles in shared memory: for 128
# positions of an fp32 cache at head_dim 128, Triton 3.6 asked the H200 for 279,680 bytes,
# four 64 KiB tiles and a little more. A bf16 cache fits any tile of GPU_TILES; an
# fp32 one at 128 positions does not fit an H200 SM's 227 KiB, so its tile halves.
PAGED_TILES_IN_FLIGHT = 4


def fit_shared_memory(config: DecodeConfig, head_dim: int, element_size: int, limit_bytes: int) -> DecodeConfig:
    """``config`` with its tile halved until :data:`PAGED_TILES_IN_FLIGHT` K/V tiles of
    ``block_n`` positions x ``head_dim`` elements of ``element_size`` bytes fit ``limit_bytes``
    (with an eighth to spare for the kernel's other buffers); at least 16 positions."""
    block_n = config.block_n
    while block_n > 16 and PAGED_TILES_IN_FLIGHT * block_n * head_dim * element_size * 9 // 8 > limit_bytes:
        block_n //= 2
    return dataclasses.replace(config, block_n=block_n)


@lru_cache(maxsize=None)
def _shared_memory_limit(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def paged_config(batch: int, kv_heads: int, capacity: int, *, head_dim: int, element_size: int) -> DecodeConfig:
    """:func:`default_config`'s launch for a paged pool: its splits and tile, deeper pipelining.

    :data:`PAGED_EXTRA_STAGES` more stages, for the block-table load ahead of K and V, and
    at most :data:`PAGED_MAX_WARPS` warps; on a GPU, a smaller tile where the deeper
    pipeline's tiles of this cache would not fit an SM's shared memory (:func:`fit_shared_memory`).
    """
    config = default_config(batch, kv_heads, capacity)
    config = dataclasses.replace(config, num_stages=config.num_stages + PAGED_EXTRA_STAGES,
                                 num_warps=min(config.num_warps, PAGED_MAX_WARPS))
    if backend.on_gpu():
        config = fit_shared_memory(config, head_dim, element_size, _shared_memory_limit(torch.cuda.current_device()))
    return config


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lengths: torch.Tensor, scale: float, config: DecodeConfig) -> torch.Tensor:
    """Launch the kernels on validated inputs (see :func:`labkit.kvcache.decode_attention`).

    ``lengths`` must be int32 and contiguous. Nothing here reads a device value, so the
    call can be captured in a CUDA graph.
    """
    # A cache [batch, kv_heads, capacity, d]: strides of a sequence, a head, a position.
    k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    return _split_kv_attention(q, k_cache, v_cache, k_strides, v_strides, lengths, scale, config)


def paged_split_kv_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                          lengths: torch.Tensor, scale: float, config: DecodeConfig) -> torch.Tensor:
    """The same kernels over a paged pool ``[num_blocks, block_size, kv_heads, d]``, on validated inputs.

    Sequence ``b``'s position ``n`` is slot ``n % block_size`` of block ``block_tables[b,
    n // block_size]``; the kernel computes each tile's addresses through the table and
    reads the blocks where they are (see :func:`labkit.serve.attention.paged_decode_attention`).
    ``block_tables`` and ``lengths`` must be int32 and contiguous. No device value is read
    here, so the call can be captured in a CUDA graph.
    """
    return _split_kv_attention(q, k_pool, v_pool, _pool_strides(k_pool), _pool_strides(v_pool), lengths, scale,
                               config, block_tables=block_tables)


def paged_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, lengths: torch.Tensor, max_queries: int, scale: float) -> torch.Tensor:
    """Causal attention of packed queries ``q`` ``[N, q_heads, d]`` over a paged pool, on validated inputs.

    Each program takes :data:`PREFILL_ROWS` rows: ``PREFILL_ROWS // group`` consecutive
    queries of one sequence times the ``group`` query heads of one KV head, so each K/V
    tile it reads serves all of them. There is one split: a prompt has enough queries to
    fill the GPU, and every row then meets key 0 in its first tile, which keeps the
    online softmax's maximum finite under the causal mask. ``max_queries`` is the most
    queries of any sequence (it sizes the grid).
    """
    group = q.shape[1] // k_pool.shape[2]
    queries_per_program = max(1, PREFILL_ROWS // group)
    config = DecodeConfig(num_splits=1, block_n=PREFILL_TILE[0], num_warps=PREFILL_TILE[1],
                          num_stages=PREFILL_TILE[2])
    return _split_kv_attention(q, k_pool, v_pool, _pool_strides(k_pool), _pool_strides(v_pool), lengths, scale,
                               config, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                               queries_per_program=queries_per_program,
                               query_tiles=triton.cdiv(max_queries, queries_per_program))


def _pool_strides(pool: torch.Tensor) -> tuple[int, int, int]:
    # A pool [num_blocks, block_size, kv_heads, d]: strides of a block, a head, a slot.
    return pool.stride(0), pool.stride(2), pool.stride(1)


def _split_kv_attention(q, k, v, k_strides, v_strides, lengths, scale, config, *, block_tables=None,
                        cu_seqlens_q=None, queries_per_program=1, query_tiles=1):
    """Launch the split kernel (and, with several splits, the combine kernel) for either layout."""
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1] if block_tables is None else k.shape[2]
    group = q_heads // kv_heads
    batch = lengths.shape[0]
    splits = config.num_splits
    out = torch.empty_like(q)
    if splits == 1:
        o_part, lse_part = out, out  # the split kernel writes the answer; no log-sum-exp is kept
        o_strides = (out.stride(0), out.stride(1), 0)
    else:
        o_part = torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
    block_d = triton.next_power_of_2(head_dim)
    merge_here = config.merge_here and splits > 1
    # Unused pointers get a tensor that is never read: the kernel's constexprs remove their loads.
    tables = block_tables if block_tables is not None else lengths
    tickets = matmul_kernels.tickets(q.device, batch * kv_heads) if merge_here else lengths
    _decode_split_kernel[(splits * query_tiles, kv_heads, batch)](
        q, k, v, lengths, o_part, lse_part, tables, cu_seqlens_q if cu_seqlens_q is not None else lengths,
        out, tickets,
        q.stride(0), q.stride(1), *k_strides, *v_strides,
        tables.stride(0) if block_tables is not None else 0,
        *o_strides,
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e), splits,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(queries_per_program * group)),
        BLOCK_N=config.block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FINAL=splits == 1,
        PAGE_SIZE=0 if block_tables is None else k.shape[1], BLOCK_Q=queries_per_program,
        MERGE_HERE=merge_here, BLOCK_S=triton.next_power_of_2(splits),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1 and not merge_here:
        _combine_splits_kernel[(batch, q_heads)](
            o_part, lse_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )
    return out
