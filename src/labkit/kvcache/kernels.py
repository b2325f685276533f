"""Split-KV decode attention (flash-decoding) in two Triton kernels, and their launcher.

Decoding asks for one query token per sequence. A flash-attention kernel parallelizes
over query blocks; with a single query per (sequence, head) that leaves ``batch x heads``
programs, far too few to fill 132 SMs when the batch is small and the cache is long. So
the cache is cut along its length into ``num_splits`` pieces, one program per
(sequence, KV head, split), and a second kernel merges the pieces.

Kernel 1, :func:`_decode_split_kernel`: one program reads one split of one KV head's
cache *once* and serves all ``GROUP`` query heads that share it (GQA), running the
online softmax over ``BLOCK_N``-position tiles. It writes its normalized partial output
``o_s`` and its log-sum-exp ``lse_s = m_s + log2(l_s)`` (base 2, like the exponentials).

Kernel 2, :func:`_combine_splits_kernel`: per (sequence, query head), the exact merge
``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``. A split
that lies past a sequence's length has ``lse_s = -inf`` and weight zero.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import backend

# Every split covers a multiple of this many positions, so every BLOCK_N the kernel may
# use divides it (the largest tuned tile on a GPU; the interpreter's fixed tile on a CPU).
SPLIT_ALIGN = backend.pick(cpu=32, gpu=128)
# A split shorter than this spends more on its partial result than on its reads.
MIN_SPLIT_LEN = 256


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, o_part_ptr, lse_part_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    qk_scale_log2,          # softmax scale x log2(e): exponentials are exp2
    split_len,              # positions per split, a multiple of BLOCK_N
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # int64 before any multiply by a stride: a batch of long caches passes 2^31 elements.
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    # The GROUP query heads of this KV head, padded to BLOCK_G rows (tl.dot needs >= 16).
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
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end  # the last tile of a sequence is partial
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split wholly past this sequence's end saw nothing: l_i = 0, so lse = -inf (weight 0).
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, o, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
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


def _tuning_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
        for n in (64, 128) for w in (4, 8) for s in (2, 3)
    ]


# On a GPU the split kernel picks its tile and pipeline depth by measurement, per head
# size, group and split length; the interpreter runs one fixed, small configuration.
if backend.on_gpu():
    _split_kernel = triton.autotune(_tuning_configs(), key=["HEAD_DIM", "GROUP", "split_len"])(
        _decode_split_kernel)
    _FIXED: dict[str, int] = {}
else:
    _split_kernel = _decode_split_kernel
    _FIXED = {"BLOCK_N": 32}


def default_num_splits(batch: int, kv_heads: int, max_len: int) -> int:
    """Enough splits for about eight programs per SM, none shorter than ``MIN_SPLIT_LEN``.

    A few programs fit on an SM at once (their K/V pipeline stages fill its shared
    memory), so eight per SM makes several waves: pieces small enough that the last,
    partial wave leaves little of the GPU idle.
    """
    sms = torch.cuda.get_device_properties(0).multi_processor_count if backend.on_gpu() else 4
    wanted = triton.cdiv(8 * sms, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_len, MIN_SPLIT_LEN)))


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lengths: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """Launch both kernels on validated inputs (see :func:`labkit.kvcache.decode_attention`)."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    group = q_heads // kv_heads
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = triton.cdiv(max_len, split_len)  # rounding up split_len may leave fewer
    o_part = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, lengths, o_part, lse_part,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scale * math.log2(math.e), split_len,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_FIXED,
    )
    _combine_splits_kernel[(batch, q_heads)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
    )
    return out
