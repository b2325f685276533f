"""Matmul ``C = A @ B`` as Triton kernels, from one output row a program to Hopper's TMA.

``A`` is ``[M, K]``, ``B`` is ``[K, N]`` (any strides for the pointer kernels), ``C`` is
``[M, N]``; products accumulate in fp32 and are stored in ``C``'s dtype.

- :func:`naive_matmul_kernel`: one program per ``BLOCK_N`` columns of one output row. No
  reuse: each program reads its whole slab of ``B``, so ``B`` is read ``M`` times, and the
  products run on the CUDA cores (a row times a slab is no matrix product for the tensor
  cores).
- :func:`tiled_matmul_kernel`: one program per ``BLOCK_M x BLOCK_N`` output tile, walking
  ``K`` in ``BLOCK_K`` steps with ``tl.dot`` (tensor cores). Each element of ``A`` it loads
  serves ``BLOCK_N`` products, each of ``B`` ``BLOCK_M``. Programs are numbered in groups
  of ``GROUP_M`` tile rows (:func:`tile_coordinates`) so the programs running together share
  rows of ``A`` and columns of ``B`` in L2. With ``SPLIT_K > 1`` a second grid axis splits
  ``K`` too: the skinny-``M`` case, where the output has too few tiles to fill the GPU. Each
  split writes its fp32 partial tile to a workspace and takes a ticket; the last split of a
  tile to arrive adds the partials in split order (the same sum every run) and stores ``C``,
  all in the one launch.
- :func:`persistent_matmul_kernel`: one program per SM looping over tiles, operands read
  through tensor descriptors made on the device (``tl.make_tensor_descriptor``): on Hopper
  one thread starts a TMA copy of a whole tile into shared memory, out-of-bounds parts
  zero-filled on load and clipped on store, so no masks and no per-element addresses.
- :func:`fp8_matmul_kernel`: the persistent TMA kernel on FP8 E4M3 operands, ``A`` ``[M, K]``
  and ``W`` ``[N, K]`` (both K-major, as Hopper's FP8 wgmma requires), one fp32 scale per
  row of each applied to the fp32 accumulator before the store.

Launchers pick the grid and, on a GPU, autotune over :data:`TILED_CONFIGS`,
:data:`SPLIT_K_CONFIGS`, :data:`PERSISTENT_CONFIGS` and :data:`FP8_CONFIGS`. Arguments are
checked by :mod:`labkit.matmul`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import backend

# Programs a persistent kernel runs under the interpreter, which has no SMs: a few, so that
# each still loops over several tiles.
_INTERPRETER_PROGRAMS = 3
HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a program may opt in to on sm_90


@triton.jit
def tile_coordinates(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program ``tile`` in grouped order.

    Tiles are numbered down a band of ``GROUP_M`` tile rows, column after column, then the
    next band. Consecutive programs therefore share a few columns of ``B`` and a band of
    ``A`` instead of sweeping a whole row of ``B`` tiles each. ``GROUP_M = 1`` is plain
    row-major order. Works elementwise on a block of tile numbers as well.
    """
    tiles_per_band = GROUP_M * num_tiles_n
    band = tile // tiles_per_band
    first_row = band * GROUP_M
    band_rows = tl.minimum(num_tiles_m - first_row, GROUP_M)  # the last band may be short
    in_band = tile % tiles_per_band
    return first_row + in_band % band_rows, in_band // band_rows


@triton.jit
def tile_order_kernel(out_ptr, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr, BLOCK: tl.constexpr):
    # The order :func:`tile_coordinates` gives, written out for figures and tests.
    tiles = tl.arange(0, BLOCK)
    valid = tiles < num_tiles_m * num_tiles_n
    # lanes past the last tile compute tile 0's coordinates (past it a band has no rows to divide by)
    tile_m, tile_n = tile_coordinates(tl.where(valid, tiles, 0), num_tiles_m, num_tiles_n, GROUP_M)
    tl.store(out_ptr + 2 * tiles, tile_m, mask=valid)
    tl.store(out_ptr + 2 * tiles + 1, tile_n, mask=valid)


@triton.jit
def naive_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + row * stride_am + k * stride_ak, mask=k < K, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k < K)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None] * b, axis=0)  # a row times a slab: CUDA-core FMAs
    tl.store(c_ptr + row * stride_cm + cols * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def tiled_matmul_kernel(
    a_ptr, b_ptr, c_ptr, partials_ptr, tickets_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EXACT_FP32: tl.constexpr,
):
    tile_m, tile_n = tile_coordinates(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap around to valid ones: every load stays in bounds
    # with no row or column mask (only K is masked), and the wrapped results are not stored.
    a_rows = (rows % M).to(tl.int64)
    b_cols = (cols % N).to(tl.int64)
    # This split's share of K, in whole BLOCK_K steps (SPLIT_K = 1: all of it).
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    ks = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + b_cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # tl.range lets the compiler pipeline the loop: num_stages loads in flight ahead of the dot.
    for k0 in tl.range(k_start, k_end, BLOCK_K):
        in_k = tl.arange(0, BLOCK_K) < k_end - k0
        a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None], other=0.0)
        if EXACT_FP32:  # fp32 inputs are for checking: exact products, not tf32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    in_c = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_c)
    else:
        # partials: [SPLIT_K, M, N] fp32; tickets: one int32 a tile, zero between launches.
        tile_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        slice_size = tl.cast(M, tl.int64) * N  # tl.cast: M == 1 arrives as a Python int (specialized)
        tl.store(partials_ptr + tl.program_id(1) * slice_size + tile_offsets, acc, mask=in_c)
        # Every thread's partial is stored before the ticket is taken (the barrier), and the
        # ticket's release / acquire orders those stores before the last split's loads.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in split order, whichever arrived last
                total += tl.load(partials_ptr + split * slice_size + tile_offsets, mask=in_c, other=0.0,
                                 cache_modifier=".cg")  # from L2, where the other SMs' stores are
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=in_c)
            tl.atomic_xchg(tickets_ptr + tl.program_id(0), 0)  # ready for the next launch


@triton.jit
def persistent_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EXACT_FP32: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
):
    # Descriptors made on the device (they need a scratch allocator, set by the launcher):
    # shape, strides and the box one copy moves. A, B, C row-major and contiguous.
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_tiles_m = tl.cdiv(M, BLOCK_M)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # The store finds its tile from its own counter, as Triton's persistent-matmul tutorial
    # does, so that the flattened loop's epilogue does not wait on the next tile's prologue.
    store_tile = tl.program_id(0) - NUM_PROGRAMS
    # FLATTEN merges the tile and K loops into one pipelined loop, so the next tile's loads
    # start while this one's epilogue runs. WARP_SPECIALIZE instead splits the program into
    # a producer warp that issues the TMA loads and consumer warpgroups that run wgmma
    # (Triton 3.5+ on Hopper; it does not combine with FLATTEN there).
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        tile_m, tile_n = tile_coordinates(tile, num_tiles_m, num_tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([tile_m * BLOCK_M, k0])
            b = b_desc.load([k0, tile_n * BLOCK_N])
            if EXACT_FP32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        store_tile += NUM_PROGRAMS
        tile_m, tile_n = tile_coordinates(store_tile, num_tiles_m, num_tiles_n, GROUP_M)
        c_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def fp8_matmul_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, c_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_tiles_m = tl.cdiv(M, BLOCK_M)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    store_tile = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=True):
        tile_m, tile_n = tile_coordinates(tile, num_tiles_m, num_tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([tile_m * BLOCK_M, k0])
            w = w_desc.load([tile_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc)  # E4M3 x E4M3 -> fp32 on the tensor cores
        store_tile += NUM_PROGRAMS
        tile_m, tile_n = tile_coordinates(store_tile, num_tiles_m, num_tiles_n, GROUP_M)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # The scales are per row of A and per row of W (a column of C): they factor out of
        # the sum over K, so one multiply per output element applies them after it.
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
        c_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], acc.to(c_ptr.dtype.element_ty))


def config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, *,
           group_m: int = 8, split_k: int | None = None) -> triton.Config:
    """One tile configuration (pass it to a launcher's ``cfg=``); ``split_k`` for the split-K launch."""
    kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m}
    if split_k is not None:
        kwargs["SPLIT_K"] = split_k
    return triton.Config(kwargs, num_warps=num_warps, num_stages=num_stages)


def config_name(cfg: triton.Config) -> str:
    """``cfg`` as a short label, e.g. ``128x256x64 g8 w8 s3``."""
    kw = cfg.kwargs
    split = f" split{kw['SPLIT_K']}" if "SPLIT_K" in kw else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} g{kw['GROUP_M']} w{cfg.num_warps} s{cfg.num_stages}{split}"


def shared_memory_bytes(cfg: triton.Config, element_size: int, out_element_size: int = 0) -> int:
    """Shared memory ``cfg``'s pipeline needs: ``num_stages`` A and B tiles, plus a C tile
    for a TMA store (``out_element_size`` > 0)."""
    kw = cfg.kwargs
    stage = element_size * kw["BLOCK_K"] * (kw["BLOCK_M"] + kw["BLOCK_N"])
    return cfg.num_stages * stage + out_element_size * kw["BLOCK_M"] * kw["BLOCK_N"]


# Configurations known to be good on H100/H200, after Triton's matmul tutorials
# (03-matrix-multiplication's CUDA list and 09-persistent-matmul's TMA list: 128-row tiles,
# 128- or 256-wide, K steps of 64 or 128, 3-4 stages, 8 warps = two warpgroups for wgmma),
# trimmed to those whose stages fit in 227 KB of shared memory. Each costs a compile and a
# timing per shape, so the lists stay short.
TILED_CONFIGS = [
    config(128, 256, 64, 8, 3),
    config(128, 128, 64, 8, 4),
    config(64, 128, 64, 4, 4),
]
# The persistent list once held 128x128x128 w8 s3 and 128x128x64 w4 s4 too. At 8192^3 the
# autotuner's one pass over the list picked the second (matmul.bf16 at 75c08e5: 0.889 of
# cuBLAS), where the tile sweep of the same commit (matmul.tiles) ran 128x256x64 s3 at 743
# TFLOP/s, about that run's cuBLAS. A scratch sweep of every candidate at 4096^3 and 8192^3
# (three alternated rounds, not a record) found neither tile within 5% of the best, and
# every rate, cuBLAS's too, falling from the first round to the later ones at 8192^3: a
# one-pass autotuner can misjudge there. The last entry stays: its stages fit shared memory
# with fp32 operands.
PERSISTENT_CONFIGS = [
    config(128, 256, 64, 8, 3),
    config(256, 128, 64, 8, 3),
    config(128, 128, 64, 8, 4),
    config(64, 128, 64, 4, 4),
]
# Skinny M: short tiles in M, and K split 1 to 8 ways to give the 132 SMs enough programs
# (the autotuner may find one split, no split, best). Tiles 64 wide as well as 128 double the
# programs where N is small too: a decode step's linear layers (M = 1 to 64 sequences) at
# Qwen3-0.6B's shape have N = 1024 for the output and down projections, 8 tiles of 128.
# _prune_split_k drops the candidates that cannot help a launch.
SPLIT_K_CONFIGS = [
    config(bm, bn, 64, 4, 4, split_k=s) for bm in (64, 128) for bn in (64, 128) for s in (1, 2, 4, 8)
]
FP8_CONFIGS = [
    config(128, 256, 128, 8, 3),
    config(128, 256, 64, 8, 4),
    config(128, 128, 128, 8, 4),
    config(128, 128, 128, 4, 4),
    config(64, 128, 128, 4, 4),
]
# The interpreter runs one small tile: it runs programs one after another, and autotuning
# would run every configuration.
INTERPRETER_CONFIG = config(16, 32, 32, 4, 1, group_m=2)
INTERPRETER_SPLIT_K_CONFIG = config(16, 32, 32, 4, 1, group_m=2, split_k=3)


def _fits(configs: list[triton.Config], element_size: int, out_element_size: int) -> list[triton.Config]:
    return [c for c in configs if shared_memory_bytes(c, element_size, out_element_size) <= HOPPER_SHARED_MEMORY]


def _prune_tiled(configs, named_args, **kwargs):
    return _fits(configs, named_args["a_ptr"].element_size(), 0) or configs[-1:]


def _prune_split_k(configs, named_args, **kwargs):
    """The split-K candidates worth timing for this launch: 128-row tiles only past 64 rows
    (below, the 64-row tile holds every row and the taller one only adds padding), and no
    more splits than ``K`` has steps (a split without a step of its own would only add its
    zeros to the sum)."""
    M, K = named_args["M"], named_args["K"]
    useful = [c for c in configs
              if (c.kwargs["BLOCK_M"] <= 64 or M > 64) and c.kwargs["SPLIT_K"] <= triton.cdiv(K, c.kwargs["BLOCK_K"])]
    return _prune_tiled(useful or configs[-1:], named_args)


def _prune_tma(configs, named_args, **kwargs):
    return _fits(configs, named_args["a_ptr"].element_size(), named_args["c_ptr"].element_size()) or configs[-1:]


def _autotuned(fn, configs, prune, key=("M", "N", "K", "EXACT_FP32"), **extra):
    # The dtype is part of the key too: Triton's autotuner adds the arguments' dtypes.
    tuner = triton.autotune(configs=configs, key=list(key), prune_configs_by={"early_config_prune": prune},
                            **extra)(fn)
    _keep_timings(tuner)
    return tuner


def _keep_timings(tuner) -> None:
    """Keep every key's candidate timings in ``tuner.timings_by_key``: Triton's autotuner keeps
    only the last tuning's (``configs_timings``), so a benchmark over several shapes could not
    say why it chose as it did at any but the last."""
    tuner.timings_by_key = {}
    run = tuner.run

    def run_and_keep(*args, **kwargs):
        known, before = set(tuner.cache), getattr(tuner, "configs_timings", None)
        out = run(*args, **kwargs)
        timings = getattr(tuner, "configs_timings", None)
        new_keys = set(tuner.cache) - known
        if timings is not None and timings is not before and len(new_keys) == 1:
            # Each timing is the quantiles the autotuner asked for, the median first.
            tuner.timings_by_key[new_keys.pop()] = {
                config_name(cfg): float(t[0] if isinstance(t, (list, tuple)) else t) for cfg, t in timings.items()}
        return out

    tuner.run = run_and_keep


tiled_matmul_autotuned = _autotuned(tiled_matmul_kernel, TILED_CONFIGS, _prune_tiled)
# Up to 16 candidates for every (M, N, K): a decode step's few shapes at each of its CUDA
# graphs' batch sizes is some forty keys, so each candidate is timed over 25 ms, not 100.
split_k_matmul_autotuned = _autotuned(
    tiled_matmul_kernel, SPLIT_K_CONFIGS, _prune_split_k,
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=10, rep=25, quantiles=quantiles))
persistent_matmul_autotuned = _autotuned(persistent_matmul_kernel, PERSISTENT_CONFIGS, _prune_tma,
                                         key=("M", "N", "K", "EXACT_FP32", "WARP_SPECIALIZE"))
fp8_matmul_autotuned = _autotuned(fp8_matmul_kernel, FP8_CONFIGS, _prune_tma, key=("M", "N", "K"))
_AUTOTUNED = {"tiled": tiled_matmul_autotuned, "split_k": split_k_matmul_autotuned,
              "persistent": persistent_matmul_autotuned, "fp8": fp8_matmul_autotuned}


def num_sms(device: torch.device) -> int:
    """Programs a persistent kernel launches: one per SM (a few under the interpreter)."""
    return backend.sm_count(device, interpreter=_INTERPRETER_PROGRAMS)


def _kernel_and_meta(autotuned, cfg: triton.Config | None, interpreter_cfg: triton.Config):
    """The kernel to launch and its tile: the autotuner on a GPU, one fixed tile under the
    interpreter, or ``cfg`` wherever it is given."""
    if cfg is None and not backend.on_gpu():
        cfg = interpreter_cfg
    if cfg is None:
        return autotuned, {}
    return autotuned.fn, cfg.all_kwargs()


def _grid_tiles(M: int, N: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta.get("SPLIT_K", 1))


def _strides(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[int, ...]:
    return (*a.stride(), *b.stride(), *c.stride())


def naive_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, block_n: int = 64,
                 block_k: int = 64) -> torch.Tensor:
    (M, K), N = a.shape, b.shape[1]
    naive_matmul_kernel[(M, triton.cdiv(N, block_n))](a, b, c, M, N, K, *_strides(a, b, c),
                                                     BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return c


def tiled_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, cfg: triton.Config | None = None
                 ) -> torch.Tensor:
    (M, K), N = a.shape, b.shape[1]
    kernel, meta = _kernel_and_meta(tiled_matmul_autotuned, cfg, INTERPRETER_CONFIG)
    # SPLIT_K = 1 never touches the workspace or the tickets: c stands in for both.
    kernel[_grid_tiles(M, N)](a, b, c, c, c, M, N, K, *_strides(a, b, c),
                              EXACT_FP32=a.dtype == torch.float32, **({"SPLIT_K": 1} | meta))
    return c


MAX_SPLIT_K = 8


@functools.lru_cache(maxsize=None)
def tickets(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 tickets on ``device`` for a kernel whose programs reduce in one launch
    (the last to take a ticket does the reduction and resets it): zeroed once, and every
    launch leaves each ticket at zero again. One buffer per size: launches on one stream run
    one after another, so they never share it at once."""
    return torch.zeros(count, dtype=torch.int32, device=device)


def split_k_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, cfg: triton.Config | None = None
                   ) -> torch.Tensor:
    """``c = a @ b`` with ``K`` split across programs, reduced in the same launch."""
    (M, K), N = a.shape, b.shape[1]
    kernel, meta = _kernel_and_meta(split_k_matmul_autotuned, cfg, INTERPRETER_SPLIT_K_CONFIG)
    # The configurations this launch may run (the autotuner tries them all on the same
    # buffers): room for the most splits, and a ticket for every tile of the smallest tile.
    candidates = [triton.Config(meta)] if meta else SPLIT_K_CONFIGS
    splits = max(c.kwargs.get("SPLIT_K", 1) for c in candidates)
    if splits > MAX_SPLIT_K:
        raise ValueError(f"split_k must be at most {MAX_SPLIT_K}, got {splits}")
    tiles = max(triton.cdiv(M, c.kwargs["BLOCK_M"]) * triton.cdiv(N, c.kwargs["BLOCK_N"]) for c in candidates)
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=a.device) if splits > 1 else c
    kernel[_grid_tiles(M, N)](a, b, c, partials, tickets(a.device, tiles), M, N, K, *_strides(a, b, c),
                              EXACT_FP32=a.dtype == torch.float32, **meta)
    return c


def persistent_launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, cfg: triton.Config | None = None,
                      warp_specialize: bool = False) -> torch.Tensor:
    (M, K), N = a.shape, b.shape[1]
    backend.allow_device_descriptors()
    kernel, meta = _kernel_and_meta(persistent_matmul_autotuned, cfg, INTERPRETER_CONFIG)
    programs = num_sms(a.device)
    grid = lambda meta: (min(programs, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)  # noqa: E731
    kernel[grid](a, b, c, M, N, K, NUM_PROGRAMS=programs, EXACT_FP32=a.dtype == torch.float32,
                 WARP_SPECIALIZE=warp_specialize, FLATTEN=not warp_specialize, **meta)
    return c


def fp8_launch(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, c: torch.Tensor,
               *, cfg: triton.Config | None = None) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    backend.allow_device_descriptors()
    kernel, meta = _kernel_and_meta(fp8_matmul_autotuned, cfg, INTERPRETER_CONFIG)
    programs = num_sms(a.device)
    grid = lambda meta: (min(programs, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)  # noqa: E731
    kernel[grid](a, w, a_scale, w_scale, c, M, N, K, NUM_PROGRAMS=programs, **meta)
    return c


def tile_order(num_tiles_m: int, num_tiles_n: int, group_m: int) -> torch.Tensor:
    """``[tiles, 2]``: the (tile row, tile column) program ``i`` computes, from :func:`tile_coordinates`."""
    tiles = num_tiles_m * num_tiles_n
    out = torch.empty(tiles, 2, dtype=torch.int32, device=backend.device())
    tile_order_kernel[(1,)](out, num_tiles_m, num_tiles_n, GROUP_M=group_m, BLOCK=triton.next_power_of_2(tiles))
    return out.cpu()


def best_config(kernel_name: str) -> dict[tuple, str]:
    """What the autotuner chose for each (M, N, K, ...) key so far, by label."""
    autotuned = _AUTOTUNED[kernel_name]
    return {key: config_name(cfg) for key, cfg in autotuned.cache.items()}


def tuning_timings(kernel_name: str) -> dict[tuple, dict[str, float]]:
    """For each key the autotuner tuned so far: every candidate's median time (ms) in its tuning."""
    return dict(_AUTOTUNED[kernel_name].timings_by_key)
