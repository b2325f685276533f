"""Triton kernels of the LoRA chapter: the fused LoRA matmul, and Punica-style BGMV and SGMV.

**Fused LoRA linear.** ``y = x W^T + s (x A^T) B^T`` unfused (peft) is three matmuls and an
add: the base output ``[M, N]`` is written, the low-rank output ``[M, N]`` is written, and
both are read again to add them. :func:`matmul_lowrank_kernel` computes

    C = P Q + scale * U V        P [M, Kr], Q [Kr, N], U [M, R], V [R, N], R small,

in one pass: each program starts its fp32 accumulator with the rank-``R`` product (one
``tl.dot`` of a ``[BLOCK_M, R]`` by ``[R, BLOCK_N]`` tile, times ``scale``), accumulates its
tile of ``P Q`` over the reduction on top, and stores once. Starting with the low-rank
product rather than adding it after the loop keeps one accumulator alive, not two: at
128x256 tiles on 8 warps, two fp32 accumulators are 256 registers a thread, more than the
255 there are, and ``ptxas`` spilled them to local memory. With ``P = x``, ``Q = W^T``, ``U = x A^T``
and ``V = B^T`` it is the forward; with ``P = dy``, ``Q = W``, ``U = s dy B`` and ``V = A``
it is the backward's ``dx``. The thin products ``x A^T``, ``dy B``, ``A``'s and ``B``'s
gradients stay cuBLAS calls: each is a skinny matmul that reads ``x`` or ``dy`` once.
Strides are arguments, so ``W^T`` is ``W`` read with swapped strides, never copied.

**BGMV** (batched gather matrix-vector, Punica; Chen et al., 2024): one token per request,
each with its own adapter. :func:`bgmv_shrink_kernel` computes ``u_t = A[i_t] x_t`` (``R``
numbers a token), with the reduction over ``K`` split across ``SPLIT`` programs that write
partial sums (no atomics, no zeroing pass); :func:`bgmv_expand_kernel` sums the partials and
adds ``s[i_t] B[i_t] u_t`` to ``y_t`` in place. Each program gathers its token's adapter
by pointer: nothing ``[T, R, K]`` is ever built.

**SGMV** (segmented gather matrix-matrix): a prefill's tokens come in runs that share an
adapter. The same shrink/expand split, but a program owns ``BLOCK_M`` rows of one segment,
so the adapter's tile is loaded once per ``BLOCK_M`` tokens and multiplied on tensor cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import backend

_HOPPER_SHARED_MEMORY = 227 * 1024
GROUP_M = tl.constexpr(8)  # tile rows of a group in the launch order (see matmul_lowrank_kernel)


def _fit_descriptors(nargs: dict) -> None:
    """A TMA copy's box is part of its descriptor, so the descriptors follow the config's tile."""
    if nargs["p_desc"] is not None:
        nargs["p_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["q_desc"].block_shape = ([nargs["BLOCK_N"], nargs["BLOCK_K"]] if nargs["Q_T"]
                                       else [nargs["BLOCK_K"], nargs["BLOCK_N"]])
        if nargs["c_desc"] is not None:
            nargs["c_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


def _matmul_config(bm: int, bn: int, bk: int, warps: int, stages: int, persistent: bool = False,
                   tma_store: bool = False) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PERSISTENT": persistent,
                          "TMA_STORE": tma_store},
                         num_warps=warps, num_stages=stages, pre_hook=_fit_descriptors)


# Hopper tiles in the shapes Triton's own matmul tutorial and the MoE chapter found fast
# (128x256 and 256x128 with 64-wide K steps, 8 warps; persistent programs, one per SM, led
# the MoE chapter's grouped GEMM at large M), plus smaller ones for small M. The persistent
# 128x256 tile runs three stages, as in the matmul chapter's list, where it led at every large
# shape: with four it ran at an eighth of cuBLAS's rate in a scratch sweep on the H200 (not a
# record). The large tiles also come with their output stored by TMA (``TMA_STORE``) from a
# tile in shared memory, as the matmul chapter's persistent kernel and cuBLAS store theirs: the
# H200 record at e1bf01d has the 128x256 tile 6-7% behind cuBLAS at 8192x4096x4096, in the
# forward and in dx alike, storing from registers.
GPU_MATMUL_CONFIGS = [
    _matmul_config(128, 256, 64, 8, 3),
    _matmul_config(128, 256, 64, 8, 4),
    _matmul_config(256, 128, 64, 8, 3),
    _matmul_config(128, 128, 64, 8, 4),
    _matmul_config(64, 256, 64, 4, 4),
    _matmul_config(64, 128, 64, 4, 4),
    _matmul_config(64, 64, 32, 4, 4),
    _matmul_config(128, 256, 64, 8, 3, persistent=True),
    _matmul_config(256, 128, 64, 8, 3, persistent=True),
    _matmul_config(128, 256, 64, 8, 3, tma_store=True),
    _matmul_config(256, 128, 64, 8, 3, tma_store=True),
    _matmul_config(128, 256, 64, 8, 3, persistent=True, tma_store=True),
]


def _matmul_configs() -> list[triton.Config]:
    # One small config under the interpreter: it runs programs one by one, and autotuning
    # would run every config. It is persistent, so the CPU tests walk the tile loop.
    return GPU_MATMUL_CONFIGS if backend.on_gpu() else [_matmul_config(32, 32, 32, 4, 1, persistent=True)]


def shared_memory_bytes(config: triton.Config, element_size: int, rank_block: int) -> int:
    """Shared memory a tile configuration asks for: its pipeline stages of P and Q tiles, the
    low-rank operands' tiles, and with ``TMA_STORE`` the output tile it stores from."""
    bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    out = bm * bn if config.kwargs.get("TMA_STORE") else 0
    return element_size * (config.num_stages * bk * (bm + bn) + rank_block * (bm + bn) + out)


def _fits(configs, named_args, **kwargs):
    """The tiles worth trying: their pipeline stages fit in shared memory at this element size
    (fp32 doubles them), they store by TMA only where the output has a descriptor, and they are no
    larger than the problem needs (a 256-row tile over 37 rows is mostly padding, and each
    config costs a compile)."""
    args = {**named_args, **kwargs}
    size = args["p_ptr"].element_size()
    rows, cols = max(64, triton.next_power_of_2(args["M"])), max(64, triton.next_power_of_2(args["N"]))
    kept = [c for c in configs
            if shared_memory_bytes(c, size, args["BLOCK_R"]) <= _HOPPER_SHARED_MEMORY
            and (args["c_desc"] is not None or not c.kwargs["TMA_STORE"])
            and c.kwargs["BLOCK_M"] <= rows and c.kwargs["BLOCK_N"] <= cols]
    return kept or [c for c in configs if not c.kwargs["TMA_STORE"]][-1:]


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n):
    """Tile ``tile``'s (row, column) in grouped order: ``GROUP_M`` consecutive tiles share a
    column of Q tiles, which then stays in the L2 while they read it."""
    span = GROUP_M * tiles_n
    group = tile // span
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = tile - group * span  # tile % span, written so the interpreter's int tile works too
    return first_m + in_group % group_rows, in_group // group_rows


@triton.autotune(configs=_matmul_configs(), key=["M", "N", "KR", "BLOCK_R", "EXACT_FP32", "TMA", "Q_T"],
                 prune_configs_by={"early_config_prune": _fits})
@triton.jit
def matmul_lowrank_kernel(
    p_ptr, p_desc, q_ptr, q_desc, u_ptr, v_ptr, bias_ptr, c_ptr, c_desc,
    M, N, KR, R,
    stride_pm, stride_pk, stride_qk, stride_qn, stride_um, stride_ur, stride_vr, stride_vn,
    stride_cm, stride_cn,
    scale,
    HAS_BIAS: tl.constexpr, EXACT_FP32: tl.constexpr, TMA: tl.constexpr, Q_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PERSISTENT: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """``C = P Q + scale * U V (+ bias)``, ``[BLOCK_M, BLOCK_N]`` tiles, fp32 accumulation.

    One tile a program, or (``PERSISTENT``) one program per SM walking the tiles, so that
    one tile's epilogue overlaps the next tile's loads. With ``TMA`` the main loop's tiles
    arrive by tensor-memory-accelerator copies (Hopper): ``p_desc`` over ``P`` ``[M, KR]``,
    and ``q_desc`` over ``Q`` ``[KR, N]`` or, if ``Q_T``, over the row-major ``Q^T``
    ``[N, KR]`` (``W`` itself in the forward), whose tile is transposed in registers.
    Out-of-bounds boxes read as zeros, so ragged edges need no mask. With ``TMA_STORE`` (only
    with ``TMA``) the finished tile goes to shared memory and out by one TMA copy through
    ``c_desc``, which drops the rows and columns past the edge; otherwise each thread stores
    its own elements, masked.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    ks = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    step = tl.num_programs(0)
    # The epilogue finds its tile from its own counter, as Triton's persistent-matmul
    # tutorial does: the pipeliner mishandles a value used both before and after the K loop
    # when it flattens the tile loop.
    store_tile = tl.program_id(0) - step
    for tile in tl.range(tl.program_id(0), num_tiles, step, flatten=PERSISTENT):
        tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # The low-rank product starts the accumulator, so the tile holds one [BLOCK_M, BLOCK_N]
        # fp32 accumulator at a time: added after the K loop, it needs a second one beside the
        # first, and at 128x256 over 8 warps the two overflow the 255 registers a thread has.
        u = tl.load(u_ptr + rows.to(tl.int64)[:, None] * stride_um + rs[None, :] * stride_ur,
                    mask=(rows < M)[:, None] & r_ok[None, :], other=0.0)
        v = tl.load(v_ptr + rs[:, None] * stride_vr + cols.to(tl.int64)[None, :] * stride_vn,
                    mask=r_ok[:, None] & (cols < N)[None, :], other=0.0)
        if EXACT_FP32:
            acc = tl.dot(u, v, input_precision="ieee") * scale
        else:
            acc = tl.dot(u, v) * scale
        for k0 in range(0, KR, BLOCK_K):
            if TMA:
                p = p_desc.load([tile_m * BLOCK_M, k0])
                if Q_T:
                    q = q_desc.load([tile_n * BLOCK_N, k0]).T
                else:
                    q = q_desc.load([k0, tile_n * BLOCK_N])
            else:
                k_ok = (k0 + ks) < KR
                p = tl.load(p_ptr + rows.to(tl.int64)[:, None] * stride_pm + (k0 + ks)[None, :] * stride_pk,
                            mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
                q = tl.load(q_ptr + (k0 + ks)[:, None] * stride_qk + cols.to(tl.int64)[None, :] * stride_qn,
                            mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
            if EXACT_FP32:
                acc = tl.dot(p, q, acc, input_precision="ieee")
            else:
                acc = tl.dot(p, q, acc)

        store_tile += step
        tile_m, tile_n = _tile_coords(store_tile, tiles_m, tiles_n)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if TMA_STORE:
            c_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], acc.to(c_ptr.dtype.element_ty))
        else:
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def rank_block(rank: int) -> int:
    """The rank padded to a ``tl.dot`` operand's size: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rank))


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D view TMA can copy from: elements contiguous along the last axis, rows 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


@functools.lru_cache(maxsize=None)
def _device_has_tma(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the interpreter emulates descriptors
    return torch.cuda.get_device_capability(device)[0] >= 9


def matmul_config(block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 1,
                  persistent: bool = False, tma_store: bool = False) -> triton.Config:
    """One tile configuration of :func:`matmul_lowrank_kernel`, for ``matmul_lowrank(config=)``
    (``tma_store`` needs the TMA loads)."""
    return _matmul_config(block_m, block_n, block_k, num_warps, num_stages, persistent, tma_store)


def matmul_lowrank(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scale: float,
                   bias: torch.Tensor | None = None, *, config: triton.Config | None = None,
                   use_tma: bool | None = None) -> torch.Tensor:
    """``p @ q + scale * u @ v (+ bias)`` as a new ``[M, N]`` tensor in ``p``'s dtype (any strides).

    ``p`` and ``q`` (or ``q``'s transpose, when ``q`` is a transposed view) go through TMA
    where the device has it and their rows are 16-byte aligned; otherwise through pointers.
    ``config`` (from :func:`matmul_config`) runs that tile instead of the autotuner's choice,
    and ``use_tma=False`` forces the pointer loads: both for tests and tuning sweeps.
    """
    m, kr = p.shape
    n = q.shape[1]
    rank = u.shape[1]
    out = torch.empty(m, n, dtype=p.dtype, device=p.device)
    q_t = q.stride(0) == 1 and q.stride(1) != 1  # a transposed view of a row-major [N, KR]
    q_storage = q.T if q_t else q
    tma_possible = _device_has_tma(p.device) and _tma_ready(p) and _tma_ready(q_storage)
    if use_tma and not tma_possible:
        raise ValueError("TMA needs a Hopper GPU (or the interpreter) and 16-byte-aligned rows of p and q")
    use_tma = tma_possible if use_tma is None else use_tma
    # The output can be stored by TMA along with the TMA loads when its rows are 16-byte aligned too.
    tma_store = use_tma and _tma_ready(out)
    if config is not None and config.kwargs["TMA_STORE"] and not tma_store:
        raise ValueError("a config with tma_store=True stores by TMA: it needs the TMA loads and output rows "
                         f"of a multiple of 16 bytes (got {n} elements of {out.element_size()} bytes)")
    # Placeholder boxes: _fit_descriptors sizes them for the config that runs.
    p_desc = TensorDescriptor(p, list(p.shape), list(p.stride()), [16, 16]) if use_tma else None
    q_desc = (TensorDescriptor(q_storage, list(q_storage.shape), list(q_storage.stride()), [16, 16])
              if use_tma else None)
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [16, 16]) if tma_store else None

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, backend.sm_count(p.device)) if meta["PERSISTENT"] else tiles,)

    if config is None:
        kernel, meta = matmul_lowrank_kernel, {}
    else:
        kernel, meta = matmul_lowrank_kernel.fn, config.all_kwargs()
        _fit_descriptors({"p_desc": p_desc, "q_desc": q_desc, "c_desc": c_desc, "Q_T": q_t, **config.kwargs})
    kernel[grid](
        p, p_desc, q, q_desc, u, v, bias if bias is not None else out, out, c_desc,
        m, n, kr, rank,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), u.stride(0), u.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        float(scale),
        HAS_BIAS=bias is not None, EXACT_FP32=p.dtype == torch.float32, TMA=use_tma, Q_T=q_t,
        BLOCK_R=rank_block(rank), **meta,
    )
    return out


def compile_matmul_lowrank_sm90(config: triton.Config, dtype: torch.dtype = torch.bfloat16,
                                shape: tuple[int, int, int] = (256, 512, 256), rank: int = 16):
    """Triton's compiled :func:`matmul_lowrank_kernel` for the H200 (``sm_90``) at ``config``,
    as the forward launches it (TMA loads, ``W`` read transposed), without running it: on a
    CPU through labkit's compile-only path, on a GPU through Triton's ``warmup``
    (:func:`labkit.sass.compile_sm90`). Its SASS shows, for one, whether a tile's registers
    spill to local memory."""
    from .. import sass

    m, n, k = shape
    dev = backend.device()
    x, w = torch.empty(m, k, dtype=dtype, device=dev), torch.empty(n, k, dtype=dtype, device=dev)
    u, lora_b = torch.empty(m, rank, dtype=dtype, device=dev), torch.empty(n, rank, dtype=dtype, device=dev)
    out = torch.empty(m, n, dtype=dtype, device=dev)
    cfg = config.kwargs
    p_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    q_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [cfg["BLOCK_M"], cfg["BLOCK_N"]])
    q, v = w.T, lora_b.T
    args = (x, p_desc, q, q_desc, u, v, out, out, c_desc, m, n, k, rank, *x.stride(), *q.stride(), *u.stride(),
            *v.stride(), *out.stride(), 1.0)
    meta = {**config.all_kwargs(), "HAS_BIAS": False, "EXACT_FP32": dtype == torch.float32, "TMA": True,
            "Q_T": True, "BLOCK_R": rank_block(rank)}
    return sass.compile_sm90(matmul_lowrank_kernel.fn, args, meta)


# ---------------------------------------------------------------------------------- BGMV


@triton.jit
def bgmv_shrink_kernel(
    x_ptr, a_ptr, idx_ptr, partial_ptr,
    T, K, R, blocks_per_split,
    stride_xt, stride_al, stride_ar, stride_ps, stride_pt,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Partial ``A[i_t] x_t`` over this program's share of K: program (token t, split s)."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    adapter = tl.load(idx_ptr + t)
    if adapter >= 0:
        rs = tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + adapter.to(tl.int64) * stride_al + rs[:, None] * stride_ar
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        first = split * blocks_per_split * BLOCK_K
        for k0 in range(first, first + blocks_per_split * BLOCK_K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_rows + (k0 + ks)[None, :], mask=(rs < R)[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        tl.store(partial_ptr + split * stride_ps + t.to(tl.int64) * stride_pt + rs, acc, mask=rs < R)


@triton.jit
def bgmv_expand_kernel(
    y_ptr, b_ptr, idx_ptr, scale_ptr, partial_ptr,
    T, N, R,
    stride_yt, stride_bl, stride_bn, stride_ps, stride_pt,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``y_t += s[i_t] B[i_t] u_t`` for one token's block of ``BLOCK_N`` outputs, ``u_t`` the summed partials."""
    t = tl.program_id(0)
    adapter = tl.load(idx_ptr + t)
    if adapter >= 0:
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        u = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            u += tl.load(partial_ptr + s * stride_ps + t.to(tl.int64) * stride_pt + rs, mask=r_ok, other=0.0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        b = tl.load(b_ptr + adapter.to(tl.int64) * stride_bl + cols[:, None] * stride_bn + rs[None, :],
                    mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1) * tl.load(scale_ptr + adapter).to(tl.float32)
        y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + cols
        y = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def bgmv_split(tokens: int, k: int, block_k: int, device: torch.device) -> int:
    """Programs per token for the shrink's K reduction: enough (token x split) programs to
    cover every SM twice, but never more splits than K has blocks."""
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * backend.sm_count(device), tokens)))


def bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         indices: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """Add each token's own adapter ``s[i] B[i] A[i] x_t`` to ``y`` in place; returns ``y``."""
    tokens, k = x.shape
    n = y.shape[1]
    rank = lora_a.shape[1]
    block_k = backend.pick(cpu=32, gpu=256)
    block_n = backend.pick(cpu=32, gpu=128)
    split = bgmv_split(tokens, k, block_k, x.device)
    blocks_per_split = triton.cdiv(triton.cdiv(k, block_k), split)
    split = triton.cdiv(triton.cdiv(k, block_k), blocks_per_split)  # no empty splits
    partial = torch.empty(split, tokens, rank, dtype=torch.float32, device=x.device)
    block_r = rank_block(rank)
    bgmv_shrink_kernel[(tokens, split)](
        x, lora_a, indices, partial, tokens, k, rank, blocks_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_K=block_k, BLOCK_R=block_r)
    bgmv_expand_kernel[(tokens, triton.cdiv(n, block_n))](
        y, lora_b, indices, scalings, partial, tokens, n, rank,
        y.stride(0), lora_b.stride(0), lora_b.stride(1), partial.stride(0), partial.stride(1),
        SPLIT=split, BLOCK_N=block_n, BLOCK_R=block_r)
    return y


# ---------------------------------------------------------------------------------- SGMV


@triton.jit
def _segment_rows(starts_ptr, adapters_ptr, BLOCK_M: tl.constexpr):
    """Program (segment, row block)'s first row, its segment's end, and the segment's adapter
    (negative: the rows have none)."""
    seg = tl.program_id(0)
    end = tl.load(starts_ptr + seg + 1)
    adapter = tl.load(adapters_ptr + seg)
    return tl.load(starts_ptr + seg) + tl.program_id(1) * BLOCK_M, end, adapter


@triton.jit
def sgmv_shrink_kernel(
    x_ptr, a_ptr, starts_ptr, adapters_ptr, u_ptr,
    K, R,
    stride_xt, stride_al, stride_ar, stride_ut,
    EXACT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``u = x A[seg]^T`` for ``BLOCK_M`` rows of one segment: program (segment, row block)."""
    first, end, adapter = _segment_rows(starts_ptr, adapters_ptr, BLOCK_M)
    if first < end and adapter >= 0:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        rs = tl.arange(0, BLOCK_R)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + (k0 + ks)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_t = tl.load(a_ptr + adapter.to(tl.int64) * stride_al + rs[None, :] * stride_ar + (k0 + ks)[:, None],
                          mask=k_ok[:, None] & (rs < R)[None, :], other=0.0)
            if EXACT_FP32:
                acc = tl.dot(x, a_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a_t, acc)
        tl.store(u_ptr + rows.to(tl.int64)[:, None] * stride_ut + rs[None, :], acc,
                 mask=row_ok[:, None] & (rs < R)[None, :])


@triton.jit
def sgmv_expand_kernel(
    y_ptr, b_ptr, starts_ptr, adapters_ptr, scale_ptr, u_ptr,
    N, R,
    stride_yt, stride_bl, stride_bn, stride_ut,
    EXACT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``y += s[seg] u B[seg]^T`` for a ``[BLOCK_M, BLOCK_N]`` tile of one segment, in place."""
    first, end, adapter = _segment_rows(starts_ptr, adapters_ptr, BLOCK_M)
    if first < end and adapter >= 0:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        u = tl.load(u_ptr + rows.to(tl.int64)[:, None] * stride_ut + rs[None, :],
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b_t = tl.load(b_ptr + adapter.to(tl.int64) * stride_bl + cols[None, :] * stride_bn + rs[:, None],
                      mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        # u holds the shrink's fp32 sums; in 16-bit it is rounded to B's dtype for the tensor
        # cores, as peft's x A^T is rounded before B meets it.
        if EXACT_FP32:
            delta = tl.dot(u, b_t, input_precision="ieee")
        else:
            delta = tl.dot(u.to(b_t.dtype), b_t)
        delta = delta * tl.load(scale_ptr + adapter).to(tl.float32)
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         seg_starts: torch.Tensor, seg_adapters: torch.Tensor, scalings: torch.Tensor,
         max_segment: int) -> torch.Tensor:
    """Add ``s[a] B[a] A[a] x_t`` to ``y`` for each segment's rows, ``a`` its adapter; in place."""
    tokens, k = x.shape
    n = y.shape[1]
    rank = lora_a.shape[1]
    segments = seg_adapters.shape[0]
    block_m = backend.pick(cpu=16, gpu=64)
    block_k = backend.pick(cpu=32, gpu=64)
    block_n = backend.pick(cpu=32, gpu=128)
    block_r = rank_block(rank)
    u = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    row_blocks = triton.cdiv(max_segment, block_m)
    sgmv_shrink_kernel[(segments, row_blocks)](
        x, lora_a, seg_starts, seg_adapters, u, k, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), u.stride(0),
        EXACT_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r)
    sgmv_expand_kernel[(segments, row_blocks, triton.cdiv(n, block_n))](
        y, lora_b, seg_starts, seg_adapters, scalings, u, n, rank,
        y.stride(0), lora_b.stride(0), lora_b.stride(1), u.stride(0),
        EXACT_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return y
