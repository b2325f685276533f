"""The MoE kernels: a grouped GEMM (every expert's ``rows @ W[e]^T`` in one launch) and combine.

After dispatch, expert ``e`` owns rows ``offsets[e]:offsets[e+1]`` of ``A`` (``[M, K]``)
and its weight is ``W[e]`` (``[N, K]``, the ``nn.Linear`` layout HF stores experts in).
A loop over experts launches ``E`` GEMMs, most of them small, and pays ``E`` launches and
``E`` ragged tails. Here one launch covers a *tile schedule*: the M-tiles of all experts
laid end to end, times the N-tiles. A program works out which expert owns an M-tile from
the offsets alone (a prefix sum over ``ceil(count_e / BLOCK_M)``, done in registers), so no
schedule is built on the host and nothing waits for the counts to reach the CPU.

Tile ``t`` is M-tile ``t // tiles_n`` and N-tile ``t % tiles_n``, so the programs running
at one time hold neighbouring tiles: all N-tiles of one M-tile (the same rows of ``A``) and
whole experts' weights. At the Qwen3-MoE shape (N = 1536: six 256-wide N-tiles) one wave of
132 programs covers about five experts of 512 rows, some 45 MB of ``A`` and ``W`` that fit
in the H200's 60 MB L2, so each byte comes from HBM about once; the grouped swizzle a dense
GEMM uses to get that reuse has nothing left to win here.

One loop over tiles serves two grids. Without ``PERSISTENT`` there is one program per tile
and the grid is an upper bound that needs only ``M`` and ``E``: ``ceil(M / BLOCK_M) + E``
M-tiles (each expert adds at most one partial tile); programs past the real tile count
do nothing. With ``PERSISTENT`` one program per SM strides over the tiles, and Triton
flattens the two loops so that the next tile's first loads are in flight while this
tile's results are stored.

On Hopper the weights, and ``A`` when it is not gathered, are read through tensor
descriptors (``TMA``): one thread starts the copy of a whole tile into shared memory, with
no per-element addresses in registers. Ragged ends need no masks there: a tile's rows past
its expert's end (or columns past ``N``) are read but never stored, and the copy zero-fills
past ``K`` and past the tensor. Where TMA cannot run (rows not 16-byte aligned, a GPU older
than Hopper) masked pointer loads do the same work; the interpreter runs both.

``gather_rows`` fuses dispatch's permutation into the load of ``A``: row ``r`` of the
product reads ``A[gather_rows[r]]``, so the permuted ``[M, K]`` copy is never written
(vLLM's fused MoE kernel loads its activations the same way). Hopper's TMA cannot gather
rows, so a gathered ``A`` always comes through pointers.

:func:`combine_kernel` is the way back: each token gathers its ``k`` expert rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import backend

# Autotuning buckets by rows per expert: from each threshold on, the BLOCK_M worth trying.
# Small experts want short tiles (less of each ragged tile wasted, more tiles to fill 132
# SMs); large ones want the 128- and 256-row tiles that keep Hopper's tensor cores fed.
_ROW_TILES = ((0, (32, 64)), (128, (64, 128)), (512, (128, 256)))

_HOPPER_SHARED_MEMORY = 227 * 1024  # per program, the opt-in maximum

# The interpreter has no SMs; a few persistent programs still loop over several tiles each.
_INTERPRETER_PROGRAMS = 3


def tile_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                persistent: bool = False) -> triton.Config:
    """One tile configuration of :func:`grouped_mm_kernel` (pass it to ``grouped_mm_launch(config=)``)."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PERSISTENT": persistent},
                         num_warps=num_warps, num_stages=num_stages, pre_hook=_fit_descriptors)


def tile_name(config: triton.Config) -> str:
    """``config`` as a short label, e.g. ``128x256x64 w8 s3 persistent``."""
    kw = config.kwargs
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
            + (" persistent" if kw["PERSISTENT"] else ""))


def _fit_descriptors(nargs: dict) -> None:
    """A TMA copy's box is part of its descriptor, so the descriptors follow the config's tile."""
    if nargs["a_desc"] is not None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    if nargs["w_desc"] is not None:
        nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


# Hopper: 128x256 and 256x128 tiles with 64-wide K steps feed wgmma at large M (stages of
# 48 KB; a persistent program also keeps a 32 KB epilogue buffer, all within 227 KB of shared
# memory); 64-row tiles waste less of a ragged expert when experts get few tokens (decode).
# The autotuner tries those whose BLOCK_M _ROW_TILES allows for the rows per expert. On an
# H200 (E = 64, K = 2048, N = 1536, 512-2048 rows per expert) the persistent 128x256 tile
# with 4 stages led a sweep of 16 or came within 2% of its lead at every size. Persistent
# tiles ran at half the speed of one program per tile wherever A came through pointer
# loads, as a gathered A always does, so gathered rows get no persistent tile.
GPU_CONFIGS = [
    tile_config(32, 128, 128, 4, 4),
    tile_config(64, 128, 64, 4, 4),
    tile_config(64, 128, 128, 4, 3),
    tile_config(64, 256, 64, 8, 3),
    tile_config(128, 128, 64, 8, 4),
    tile_config(128, 256, 64, 8, 4),
    tile_config(128, 256, 64, 8, 4, persistent=True),
    tile_config(256, 128, 64, 8, 3, persistent=True),
]


def _configs() -> list[triton.Config]:
    if not backend.on_gpu():
        # One small config: the interpreter runs programs one by one, and autotuning
        # would run every config.
        return [tile_config(16, 32, 32, 4, 1)]
    return GPU_CONFIGS


def _rows_class(rows_per_expert: int) -> int:
    return max(i for i, (threshold, _) in enumerate(_ROW_TILES) if rows_per_expert >= threshold)


def fits_in_shared_memory(config: triton.Config, element_size: int) -> bool:
    """Whether ``config``'s pipeline stages of A and W tiles fit in an H200 program's shared memory."""
    kw = config.kwargs
    stage = element_size * kw["BLOCK_K"] * (kw["BLOCK_M"] + kw["BLOCK_N"])
    return config.num_stages * stage <= _HOPPER_SHARED_MEMORY


def _configs_for_rows(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotune only the row tiles that suit this many rows per expert (each config costs a compile).

    fp32 stages are twice as large: where none of those tiles fits in shared memory, any
    tile that does is tried instead. Gathered rows skip the persistent tiles.
    """
    element_size = named_args["a_ptr"].element_size()
    fits = [c for c in configs if fits_in_shared_memory(c, element_size)]
    if {**named_args, **kwargs}.get("HAS_GATHER"):
        fits = [c for c in fits if not c.kwargs["PERSISTENT"]] or fits
    block_ms = _ROW_TILES[named_args["ROWS_CLASS"]][1]
    return [c for c in fits if c.kwargs["BLOCK_M"] in block_ms] or fits or configs


@triton.jit
def _locate_tile(tile, tiles_n, experts, starts, ends, m_tiles_start, m_tiles_end, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Tile ``tile`` of the schedule: its expert, its first row, the end of the expert's rows, its first column."""
    tile_m = tile // tiles_n
    expert = tl.sum((m_tiles_end <= tile_m).to(tl.int32))
    mine = experts == expert
    first_row = tl.sum(tl.where(mine, starts, 0)) + (tile_m - tl.sum(tl.where(mine, m_tiles_start, 0))) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0))
    return expert, first_row, row_end, (tile % tiles_n) * BLOCK_N


@triton.jit(do_not_specialize=["ROWS_CLASS"])
def _grouped_mm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, offsets_ptr, gather_ptr,
    N, K, num_experts,
    ROWS_CLASS,  # only an autotuning key: the best tile depends on rows per expert
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    HAS_GATHER: tl.constexpr,
    TMA: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # --- the schedule: every expert's M-tiles, counted once per program. ---
    experts = tl.arange(0, EXPERTS_POW2)
    starts = tl.load(offsets_ptr + experts, mask=experts < num_experts, other=0)
    ends = tl.load(offsets_ptr + experts + 1, mask=experts < num_experts, other=0)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # zero for an expert with no rows
    m_tiles_end = tl.cumsum(m_tiles, axis=0)
    m_tiles_start = m_tiles_end - m_tiles
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = (tl.sum(m_tiles) * tiles_n).to(tl.int32)  # int32 tiles, as TMA coordinates must be
    ks = tl.arange(0, BLOCK_K)

    step = tl.num_programs(0)
    # The store finds its tile from its own counter, as Triton's persistent-matmul tutorial
    # does: its pipeliner mishandles a value used both before and after the K loop when
    # it flattens the tile loop.
    store_tile = tl.program_id(0) - step
    for tile in tl.range(tl.program_id(0), num_tiles, step, flatten=PERSISTENT):
        expert, first_row, row_end, first_col = _locate_tile(tile, tiles_n, experts, starts, ends, m_tiles_start,
                                                             m_tiles_end, BLOCK_M, BLOCK_N)
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end  # the expert's last tile is ragged
        cols = first_col + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if HAS_GATHER:
            src_rows = tl.load(gather_ptr + rows, mask=row_ok, other=0)
        else:
            src_rows = rows
        # int64 offsets: M*K and E*N*K pass 2^31 elements at real MoE sizes.
        a_rows = a_ptr + src_rows.to(tl.int64) * stride_am
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (ks < K - k0)[None, :]
            if TMA and not HAS_GATHER:
                a = a_desc.load([first_row.to(tl.int32), k0])
            else:
                a = tl.load(a_rows[:, None] + (k0 + ks)[None, :] * stride_ak, mask=row_ok[:, None] & k_ok, other=0.0)
            if TMA:
                w = w_desc.load([expert * N + first_col, k0])  # W seen as [E*N, K]
            else:
                w = tl.load(w_rows[:, None] + (k0 + ks)[None, :] * stride_wk, mask=col_ok[:, None] & k_ok, other=0.0)
            if EXACT_FP32:
                acc = tl.dot(a, w.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.T, acc)

        store_tile += step
        _, first_row, row_end, first_col = _locate_tile(store_tile, tiles_n, experts, starts, ends, m_tiles_start,
                                                        m_tiles_end, BLOCK_M, BLOCK_N)
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


grouped_mm_kernel = triton.autotune(
    configs=_configs(), key=["N", "K", "ROWS_CLASS", "HAS_GATHER", "TMA"],
    prune_configs_by={"early_config_prune": _configs_for_rows},
)(_grouped_mm_kernel)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D view TMA can copy from: rows 16-byte aligned, elements contiguous."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


@functools.lru_cache(maxsize=None)
def _device_has_tma(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the interpreter emulates descriptors
    return torch.cuda.get_device_capability(device)[0] >= 9


def grouped_mm_launch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    gather_rows: torch.Tensor | None,
    *,
    config: triton.Config | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Launch :func:`grouped_mm_kernel`; arguments are checked by :func:`labkit.moe.grouped_mm`.

    ``config`` (from :func:`tile_config`) runs that tile instead of the autotuner's choice,
    and ``use_tma`` forces tensor descriptors on or off (the default: wherever TMA can
    run); both are for tuning sweeps and tests.
    """
    num_rows, n = out.shape
    num_experts, _, k = w.shape
    if num_rows == 0:
        return out
    # TMA reads W as one [E*N, K] matrix, which needs each expert's rows to follow the last's.
    w_rows = w.view(num_experts * w.shape[1], k) if w.stride(0) == w.shape[1] * w.stride(1) else None
    if use_tma is None:
        use_tma = (_device_has_tma(a.device) and w_rows is not None and _tma_ready(w_rows)
                   and (gather_rows is not None or _tma_ready(a)))
    # Placeholder boxes: _fit_descriptors sizes them for the config that runs.
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 16]) if use_tma and gather_rows is None else None
    w_desc = TensorDescriptor(w_rows, list(w_rows.shape), list(w_rows.stride()), [16, 16]) if use_tma else None

    def grid(meta):
        m_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + min(num_experts, num_rows)
        tiles = m_tiles * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, backend.sm_count(a.device, interpreter=_INTERPRETER_PROGRAMS)) if meta["PERSISTENT"] else tiles,)

    if config is None:
        kernel, meta = grouped_mm_kernel, {}
    else:
        kernel, meta = _grouped_mm_kernel, config.all_kwargs()
        _fit_descriptors({"a_desc": a_desc, "w_desc": w_desc, **config.kwargs})
    rows_per_expert = num_rows // num_experts
    kernel[grid](
        a, a_desc, w, w_desc, out, offsets, gather_rows if gather_rows is not None else offsets,
        n, k, num_experts, _rows_class(rows_per_expert),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        HAS_GATHER=gather_rows is not None,
        TMA=use_tma,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        # fp32 inputs are for checking, so they get exact fp32 products, not tf32.
        EXACT_FP32=a.dtype == torch.float32,
        **meta,
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
