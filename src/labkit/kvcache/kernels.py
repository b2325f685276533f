"""Split-KV decode attention (flash-decoding) in two Triton kernels, and their launcher.

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

Launch parameters are chosen on the host by :func:`default_config` from the shapes alone
(batch, KV heads, capacity): no autotuner, so the choice is the same at every batch size
for the same reason, costs nothing per call, and is fixed at capture time for a CUDA graph.
:func:`split_kv_decode` takes any :class:`DecodeConfig`, which is how the tuning sweep
(``scratch/kv_tune.py``) forces each candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import backend

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


# The split count and the strides that follow it are runtime values, not compile-time ones:
# one compiled kernel serves every split count (Triton would otherwise compile a variant for
# counts divisible by 16 and another for the rest).
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, o_part_ptr, lse_part_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    qk_scale_log2,          # softmax scale x log2(e): exponentials are exp2
    num_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FINAL: tl.constexpr,    # one split: o_part_ptr is the output itself, in q's dtype
):
    # Splits vary fastest, so programs running side by side read neighbouring tiles.
    split = tl.program_id(0)
    # int64 before any multiply by a stride: a batch of long caches passes 2^31 elements.
    kv_head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    length = tl.load(lengths_ptr + b)

    # The GROUP query heads of this KV head, padded to BLOCK_G rows (tl.dot needs >= 16).
    # The padding costs tensor-core work only, of which decoding has plenty to spare.
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    for tile in range(split, tl.cdiv(length, BLOCK_N), num_splits):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < length  # only a sequence's last tile is partial
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split that got no tile of this sequence saw nothing: l_i = 0, so lse = -inf (weight 0).
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    if FINAL:
        tl.store(o_ptrs, o.to(o_part_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptrs, o, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _combine_splits_kernel(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(lse_part_ptr + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # the largest split has weight 1; empty ones 0
    o = tl.load(o_part_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeConfig:
    """How one decode-attention call is launched: splits per sequence, tile, warps, stages."""

    num_splits: int
    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(batch: int, kv_heads: int, max_len: int) -> DecodeConfig:
    """The launch for these shapes: split count first, then the tile for the programs per SM.

    A batch whose (sequence, KV head) pairs already give about a program per SM gets one
    split: no partial results, no combine kernel. Fewer pairs get enough splits for about
    ``PROGRAMS_PER_SM`` programs per SM, all running at once, none with fewer than
    ``MIN_TILES_PER_SPLIT`` tiles of a ``max_len`` cache. Then :data:`GPU_TILES` picks the
    tile. Only shapes are read (never ``lengths``, which live on the device), so the choice
    costs no synchronization and holds for every step a CUDA graph replays.
    """
    sms = _sm_count(torch.cuda.current_device()) if backend.on_gpu() else 4
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


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lengths: torch.Tensor, scale: float, config: DecodeConfig) -> torch.Tensor:
    """Launch the kernels on validated inputs (see :func:`labkit.kvcache.decode_attention`).

    ``lengths`` must be int32 and contiguous. Nothing here reads a device value, so the
    call can be captured in a CUDA graph.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
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
    _decode_split_kernel[(splits, kv_heads, batch)](
        q, k_cache, v_cache, lengths, o_part, lse_part,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides,
        lse_part.stride(0), lse_part.stride(1),
        scale * math.log2(math.e), splits,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FINAL=splits == 1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(batch, q_heads)](
            o_part, lse_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )
    return out
