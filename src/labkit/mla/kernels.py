"""MLA decode with absorbed weights: one Triton kernel over the compressed cache, and its launcher.

After absorption (:mod:`labkit.mla.reference`), every query head of a layer attends over
the *same* cached rows: a token's 512-wide latent ``c`` (which serves as the value and,
through the absorbed query, as the key) and its 64-wide rotary key ``k_pe``, stored side
by side as one ``[batch, capacity, latent + rope]`` tensor. For head ``h``:

    s[h, n] = (q_latent[h] . c[n] + q_rope[h] . k_pe[n]) * scale
    o_latent[h] = softmax_n(s[h]) @ c

Kernel :func:`_mla_decode_split_kernel` is labkit.kvcache's split-KV decode with the KV
head replaced by the shared latent: program ``(head_block, split, b)`` takes ``BLOCK_H``
query heads and the tiles ``split, split + S, ...`` of sequence ``b`` and runs the online
softmax over them. All heads of one sequence read the same rows, so the head blocks vary
fastest in the grid: the programs that share a tile run side by side and read it from HBM
once (the others find it in L2). With ``BLOCK_H`` at the largest the registers allow (64,
as FlashMLA uses), DeepSeek-V3's 128 heads take two programs per tile; the autotuner may
pick a smaller block where that is faster (:data:`GPU_TILES`). Partial
results are merged by labkit.kvcache's combine kernel, the merge the GQA kernel uses:
its partial outputs and base-2 log-sum-exps have the layout that kernel reads.

The split count comes from :func:`default_config`, from shapes alone; the tile from the
autotuner, once per shape (or from :class:`MLADecodeConfig`'s ``tile``, which the tests
use to check every candidate). After its first call for a shape, a call can be captured
in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import backend
# The GQA decode kernel's merge and SM count serve this kernel unchanged.
from ..kvcache.kernels import _combine_splits_kernel

# (BLOCK_H, BLOCK_N, warps, stages): heads per program, cache rows per tile. The accumulator
# alone is BLOCK_H x 512 fp32 (128 KB at 64 heads), so the register file bounds the tile.
# The GPU candidates are those that the GPU's Triton (3.6) compiles for sm_90 without
# spilling registers (the SASS has no local-memory stores or loads; labkit.sass reads it
# without a GPU): 64 heads use Hopper's wgmma and fill a thread's 255 registers at 8 warps,
# fewer fall back to mma.sync but leave room for longer tiles and deeper pipelines. A 64x32
# tile in one stage was a candidate until its SASS showed dozens of spilled values reloaded
# in every iteration; at 16 warps a thread gets 128 registers and 64-head tiles spill more.
# Which is fastest depends on whether the shape is bound by bytes (few heads) or by
# tensor-core work (128 heads), so Triton's autotuner picks per shape on first use, among
# the tiles whose head block does not exceed the heads there are. The interpreter runs one
# small tile.
GPU_TILES = ((64, 16, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2),
             (16, 32, 4, 3), (16, 64, 4, 2), (16, 64, 8, 3), (16, 128, 8, 2))
CPU_TILE = (16, 16, 4, 2)
# Programs per SM to aim for when batch x head blocks is too few to fill the GPU.
PROGRAMS_PER_SM = 2
# A split with fewer tiles than this spends too much on its partial result and its start-up.
MIN_TILES_PER_SPLIT = 4
# The combine kernel holds splits x 512 fp32 partials per head in registers: past 64 splits
# ptxas spills kilobytes of them (checked for sm_90 without a GPU), so no launch asks for more.
MAX_SPLITS = 64
# The head block and tile the split count is planned for (the autotuner may pick others). 16
# heads is the block the autotuner chose at every shape of the H200 record. Planned for 64,
# 128 heads at batch 16 got 8 splits where 16-head blocks already made 128 programs, and
# every split writes a 2 KB partial a head (512 fp32) for the combine to read back: 34 MB
# of partials for 19 MB of cache at context 1K. On an H100 (diagnostic, not recorded; split
# counts 1-32 at 16 and 128 heads, batch 16 and 64, contexts 1K, 4K (batch 16) and 16K)
# the 64-head plan's split count was 0-49% slower than the fastest (59.3 against 39.8 us
# there), this plan's 0-12% (42.0 us there).
PLAN_BLOCK_H, PLAN_BLOCK_N = backend.pick(cpu=CPU_TILE[:2], gpu=(16, 32))


@triton.jit(do_not_specialize=["num_splits", "num_heads", "stride_lb", "stride_lh"])
def _mla_decode_split_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, lengths_ptr, o_part_ptr, lse_part_ptr,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,
    stride_cb, stride_cn,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    qk_scale_log2,          # softmax scale x log2(e): exponentials are exp2
    num_splits, num_heads,
    LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FINAL: tl.constexpr,    # one split: o_part_ptr is the output itself, in the query's dtype
):
    # Head blocks vary fastest: the programs that read the same tiles run together.
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # int64 before any multiply by a stride
    length = tl.load(lengths_ptr + b)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)  # latent columns: the value, and the absorbed key
    e = tl.arange(0, BLOCK_E)  # rotary key columns, stored after the latent
    h_ok = h < num_heads
    r_ok = r < LATENT
    e_ok = e < ROPE
    q_lat = tl.load(q_latent_ptr + b * stride_qlb + h[:, None] * stride_qlh + r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_rope_ptr + b * stride_qrb + h[:, None] * stride_qrh + e[None, :],
                   mask=h_ok[:, None] & e_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    row_base = cache_ptr + b * stride_cb
    for tile in range(split, tl.cdiv(length, BLOCK_N), num_splits):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < length  # only a sequence's last tile is partial
        rows = row_base + n[:, None] * stride_cn
        c = tl.load(rows + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(rows + LATENT + e[None, :], mask=n_ok[:, None] & e_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # The latent is the value too: the tile loaded for the scores serves the output.
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split that got no tile of this sequence saw nothing: l_i = 0, so lse = -inf (weight 0).
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = o_part_ptr + b * stride_ob + h[:, None] * stride_oh + split * stride_os + r[None, :]
    if FINAL:
        tl.store(o_ptrs, o.to(o_part_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptrs, o, mask=h_ok[:, None] & r_ok[None, :])
        tl.store(lse_part_ptr + b * stride_lb + h * stride_lh + split, lse, mask=h_ok)


def _tile_config(tile: tuple[int, int, int, int]) -> triton.Config:
    block_h, block_n, warps, stages = tile
    return triton.Config({"BLOCK_H": block_h, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _head_blocks_that_fit(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles whose head block is larger than the heads (16 heads in a 64-row block
    would do four times the tensor-core work for nothing)."""
    most = max(16, triton.next_power_of_2(named_args["num_heads"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= most] or configs[-1:]


# The same kernel, its tile chosen by timing the candidates once per shape. The key names
# arguments that fix the shape: heads, splits, and the cache's batch stride (its capacity
# times the row width), since the best tile for a short cache is not the best for a long one.
_mla_decode_autotuned = triton.autotune(
    configs=[_tile_config(t) for t in backend.pick(cpu=(CPU_TILE,), gpu=GPU_TILES)],
    key=["num_heads", "num_splits", "stride_cb"],
    prune_configs_by={"early_config_prune": _head_blocks_that_fit},
)(_mla_decode_split_kernel)


@dataclass(frozen=True)
class MLADecodeConfig:
    """How one absorbed MLA decode call is launched: splits per sequence, and optionally a
    fixed tile ``(BLOCK_H, BLOCK_N, warps, stages)``; ``None`` lets the autotuner choose."""

    num_splits: int
    tile: tuple[int, int, int, int] | None = None


def default_config(batch: int, num_heads: int, max_len: int) -> MLADecodeConfig:
    """The launch for these shapes: enough splits that the GPU has about
    ``PROGRAMS_PER_SM`` programs per SM, none with fewer than ``MIN_TILES_PER_SPLIT`` tiles,
    and at most ``MAX_SPLITS``.

    Reads shapes only (never ``lengths``), as :func:`labkit.kvcache.kernels.default_config`.
    """
    sms = backend.sm_count()
    programs = batch * triton.cdiv(num_heads, PLAN_BLOCK_H)
    wanted = PROGRAMS_PER_SM * sms // programs
    if wanted <= 1:
        splits = 1
    else:
        splits = max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_len, PLAN_BLOCK_N) // MIN_TILES_PER_SPLIT))
    return MLADecodeConfig(num_splits=splits)


def mla_decode_absorbed(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                        lengths: torch.Tensor, scale: float, config: MLADecodeConfig) -> torch.Tensor:
    """Launch on validated inputs (see :func:`labkit.mla.mla_decode`); ``[batch, heads, latent]``.

    ``lengths`` int32 and contiguous. Nothing here reads a device value, so once the
    autotuner has chosen a tile for the shape (its first call), the call can be captured
    in a CUDA graph.
    """
    batch, heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    splits = config.num_splits
    out = q_latent.new_empty(batch, heads, latent)
    if splits == 1:
        o_part, lse_part = out, out  # the split kernel writes the answer; no log-sum-exp is kept
        o_strides = (out.stride(0), out.stride(1), 0)
    else:
        o_part = torch.empty(batch, heads, splits, latent, dtype=torch.float32, device=q_latent.device)
        lse_part = torch.empty(batch, heads, splits, dtype=torch.float32, device=q_latent.device)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
    args = (
        q_latent, q_rope, cache, lengths, o_part, lse_part,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1),
        *o_strides,
        lse_part.stride(0), lse_part.stride(1),
        scale * math.log2(math.e), splits, heads,
    )
    constants = dict(
        LATENT=latent, ROPE=rope,
        BLOCK_R=triton.next_power_of_2(latent), BLOCK_E=max(16, triton.next_power_of_2(rope)),
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", FINAL=splits == 1,
    )
    if config.tile is None:
        _mla_decode_autotuned[lambda meta: (triton.cdiv(heads, meta["BLOCK_H"]), splits, batch)](*args, **constants)
    else:
        block_h, block_n, warps, stages = config.tile
        _mla_decode_split_kernel[(triton.cdiv(heads, block_h), splits, batch)](
            *args, **constants, BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    if splits > 1:
        _combine_splits_kernel[(batch, heads)](
            o_part, lse_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            splits,
            HEAD_DIM=latent, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(latent),
        )
    return out
