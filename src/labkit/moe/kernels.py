"""The MoE kernels: a grouped GEMM (every expert's ``rows @ W[e]^T`` in one launch) and combine.

After dispatch, expert ``e`` owns rows ``offsets[e]:offsets[e+1]`` of ``A`` (``[M, K]``)
and its weight is ``W[e]`` (``[N, K]``, the ``nn.Linear`` layout HF stores experts in).
A loop over experts launches ``E`` GEMMs, most of them small, and pays ``E`` launches and
``E`` ragged tails. Here one launch covers a *tile schedule*: the M-tiles of all experts
laid end to end, times the N-tiles. Program ``pid`` works out which expert owns its
M-tile from the offsets alone (a prefix sum over ``ceil(count_e / BLOCK_M)``, done in
registers by every program), so no schedule is built on the host and nothing waits for
the counts to reach the CPU. The grid is sized by an upper bound that needs only ``M``
and ``E``: ``ceil(M / BLOCK_M) + E`` M-tiles (each expert adds at most one partial tile);
programs past the real tile count return at once.

``gather_rows`` fuses dispatch's permutation into the load of ``A``: row ``r`` of the
product reads ``A[gather_rows[r]]``, so the permuted ``[M, K]`` copy is never written
(vLLM's fused MoE kernel loads its activations the same way).

:func:`combine_kernel` is the way back: each token gathers its ``k`` expert rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend


def _configs() -> list[triton.Config]:
    if not backend.on_gpu():
        # One small config: the interpreter runs programs one by one, and autotuning
        # would run every config.
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    # Hopper: 128x128/128x256 tiles feed wgmma at large M; 64-row tiles waste less of a
    # ragged expert when experts get few tokens (decode).
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
    ]


@triton.autotune(configs=_configs(), key=["N", "K", "ROWS_PER_EXPERT_BUCKET", "HAS_GATHER"])
@triton.jit
def grouped_mm_kernel(
    a_ptr, w_ptr, out_ptr, offsets_ptr, gather_ptr,
    N, K, num_experts,
    ROWS_PER_EXPERT_BUCKET,  # only an autotuning key: the best tile depends on rows per expert
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    HAS_GATHER: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m = pid // tiles_n
    tile_n = pid % tiles_n

    # --- the schedule: which expert owns M-tile `tile_m`, and which of its rows. ---
    e = tl.arange(0, EXPERTS_POW2)
    starts = tl.load(offsets_ptr + e, mask=e < num_experts, other=0)
    ends = tl.load(offsets_ptr + e + 1, mask=e < num_experts, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # zero for an expert with no rows
    tiles_end = tl.cumsum(tiles, axis=0)
    if tile_m >= tl.sum(tiles):
        return  # past the last real tile: the grid was sized by an upper bound
    expert = tl.sum((tiles_end <= tile_m).to(tl.int32))
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0))
    row_end = tl.sum(tl.where(mine, ends, 0))
    rows = tl.sum(tl.where(mine, starts, 0)) + (tile_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end  # the expert's last tile is ragged
    if HAS_GATHER:
        src_rows = tl.load(gather_ptr + rows, mask=row_ok, other=0)
    else:
        src_rows = rows

    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    # int64 offsets: M*K and E*N*K pass 2^31 elements at real MoE sizes.
    a_ptrs = a_ptr + src_rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if EXACT_FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_mm_launch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    gather_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Launch :func:`grouped_mm_kernel`; arguments are checked by :func:`labkit.moe.grouped_mm`."""
    num_rows, n = out.shape
    num_experts, _, k = w.shape
    if num_rows == 0:
        return out
    rows_per_expert = max(1, num_rows // num_experts)
    bucket = 1 << (rows_per_expert - 1).bit_length()

    def grid(meta):
        m_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + min(num_experts, num_rows)
        return (m_tiles * triton.cdiv(n, meta["BLOCK_N"]),)

    grouped_mm_kernel[grid](
        a, w, out, offsets, gather_rows if gather_rows is not None else offsets,
        n, k, num_experts, bucket,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        HAS_GATHER=gather_rows is not None,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        # fp32 inputs are for checking, so they get exact fp32 products, not tf32.
        EXACT_FP32=a.dtype == torch.float32,
    )
    return out


@triton.jit
def combine_kernel(
    rows_ptr, row_of_slot_ptr, weight_ptr, out_ptr,
    num_tokens, hidden, stride_r, stride_o,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j w[t, j] * rows[row_of_slot[t*k + j]]``; a dropped slot (row -1) adds 0.

    Each program owns a block of tokens and of hidden columns and *gathers* its tokens'
    ``k`` rows, summing in fp32 in choice order: the expert rows are read once, the
    output written once, no fp32 ``[T*k, H]`` buffer, no atomics, the same sum every run.
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tokens.to(tl.int64) * TOP_K + j
        row = tl.load(row_of_slot_ptr + slot, mask=token_ok, other=-1)
        weight = tl.load(weight_ptr + slot, mask=token_ok, other=0.0)
        kept = token_ok & (row >= 0)
        values = tl.load(rows_ptr + row[:, None] * stride_r + cols[None, :],
                         mask=kept[:, None] & col_ok[None, :], other=0.0)
        acc += weight[:, None] * values.to(tl.float32)
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


def combine_launch(
    rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Launch :func:`combine_kernel`; arguments are checked by :func:`labkit.moe.gather_combine`."""
    num_tokens, hidden = out.shape
    if num_tokens == 0:
        return out
    block_t, block_h = backend.pick(cpu=(16, 32), gpu=(16, 256))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    combine_kernel[grid](rows, row_of_slot, weights, out, num_tokens, hidden, rows.stride(0), out.stride(0),
                         TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out
