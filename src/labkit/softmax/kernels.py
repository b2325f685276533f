"""Softmax over the last dimension of a row-major matrix, as three Triton kernels.

Each kernel reads every input element once from memory and writes every output element
once (the online kernel reads twice; the second read is served by L2 only while the rows
in flight fit there). All arithmetic is in fp32 whatever the storage dtype: ``exp`` of a
bf16 difference would lose the digits the normalisation needs, and registers cost the
same either way. The loads and stores carry no cache or eviction hints: on the H200,
``evict_first`` made the one-pass kernel slower and Liger-Kernel's ``.ca`` / ``.cs``
modifiers left it unchanged.

- :func:`softmax_row_kernel`: one program per row; the whole row is one block, held in
  registers from the load to the store.
- :func:`softmax_rows_kernel`: one program per ``BLOCK_ROWS`` rows, a 2-D tile, for rows
  so short that one row is too little work for a program.
- :func:`softmax_online_kernel`: one program per row, walking the row block by block with
  a running max and a running sum (the online normaliser), for rows too wide for
  registers.

:func:`plan` picks the kernel and its launch settings from the matrix's shape;
:func:`launch` runs a plan. Inputs are checked by :func:`labkit.softmax.softmax`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

VARIANTS = ("row", "rows", "online")

# The widest row kept whole in registers: 32768 values over 16 warps is 64 fp32 values a
# thread, half of the 128 registers a thread may use when a program has 512 threads;
# twice that would spill to local memory, which lives in HBM.
MAX_FUSED_COLS = 32768
# A program should move at least this many bytes: below it, its fixed costs (starting,
# index arithmetic, the reductions' shuffles) and too few bytes in flight per SM cost
# bandwidth. Rows smaller than this are tiled several to a program. On the H200, 4 KiB
# programs of 4 warps ran as fast as any tiling tried, and 1 to 2 KiB ones clearly slower.
MIN_TILE_BYTES = 4096
# The online kernel's step along a row: 8192 values on 16 warps, 16 values a thread.
# Half that step was measurably slower on the H200: fewer bytes in flight per iteration.
ONLINE_BLOCK_COLS = 8192
ELEMENTS_PER_THREAD = 16
WARP_SIZE = 32
MAX_NUM_WARPS = 16


@triton.jit
def softmax_row_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_COLS: tl.constexpr):
    # One program per row. BLOCK_COLS is a power of two >= n_cols (tl.arange needs a
    # power-of-two length), so the lanes past the row's end are masked: they load -inf,
    # which changes neither the max nor (as exp(-inf) = 0) the sum, and are never stored.
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 past 2**31 elements
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=-float("inf")).to(tl.float32)
    # Subtracting the row max makes every exponent <= 0: exp cannot overflow, and the
    # largest term is exactly 1, so the sum is >= 1 and the division is safe.
    numerator = tl.exp(x - tl.max(x, axis=0))
    denominator = tl.sum(numerator, axis=0)
    y = numerator * (1.0 / denominator)  # one division per row, then a multiply per element
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_rows_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    # One program per BLOCK_ROWS rows: a (BLOCK_ROWS, BLOCK_COLS) tile, reduced along
    # axis 1, so each row still gets its own max and sum.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols[None, :] < n_cols
    # The last program's tile can hang past the last row. Those rows re-read row
    # n_rows - 1 (so no lane computes exp(-inf - -inf) = NaN) and their stores are masked.
    src_rows = tl.minimum(rows, n_rows - 1)
    x = tl.load(x_ptr + src_rows[:, None] * x_row_stride + cols[None, :],
                mask=in_row, other=-float("inf")).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=1)[:, None])
    denominator = tl.sum(numerator, axis=1)
    y = numerator * (1.0 / denominator)[:, None]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & in_row)


@triton.jit
def softmax_online_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_COLS: tl.constexpr):
    # One program per row, BLOCK_COLS values at a time. Pass 1 keeps the max of the
    # blocks seen so far and the sum of exp(x - that max); when a block raises the max,
    # the old sum is rescaled by exp(old max - new max), so after the last block it is
    # exactly sum(exp(x - row max)). Pass 2 reads the row again and writes the output.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_COLS)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_COLS):
        in_row = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=in_row, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # At the first block running_max is -inf, exp(-inf) = 0 and the empty sum stays 0.
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    inv_sum = 1.0 / running_sum
    # Pass 2 finds the row in L2 only while the rows in flight fit there: 132 programs on
    # 256 KiB rows are already 33 MiB of the H200's 60, so at the widths this kernel is
    # for, expect both passes to read from HBM (1.5x a one-pass kernel's traffic).
    for start in range(0, n_cols, BLOCK_COLS):
        in_row = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=in_row, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - running_max) * inv_sum
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


def num_warps_for(tile_elements: int) -> int:
    """Warps for a program that holds ``tile_elements`` values in registers.

    About 16 values a thread: enough independent loads in flight per thread (four 16-byte
    vectors of fp32) to cover memory latency, few enough registers that two or more
    programs fit on an SM. Clamped to 4..16 warps. For an 8192-wide row this gives 16
    warps, as Liger-Kernel does. Past 8192 values the threads take more values each
    rather than more warps: on the H200, 32 warps (1024 threads, the hardware's limit)
    was never faster than 16, and in bf16 it was far slower (likely because a program of
    1024 threads waits on its cross-warp reductions with no second program on the SM to
    keep memory busy).
    """
    return max(4, min(MAX_NUM_WARPS, tile_elements // (WARP_SIZE * ELEMENTS_PER_THREAD)))


@dataclass(frozen=True)
class Launch:
    """Which kernel runs, on what tile, with how many warps, over how many programs."""

    variant: str
    block_rows: int
    block_cols: int
    num_warps: int
    grid: int

    @property
    def tile_elements(self) -> int:
        return self.block_rows * self.block_cols

    def __str__(self) -> str:
        tile = (f"{self.block_rows} x {self.block_cols}" if self.variant == "rows"
                else f"{self.block_cols}")
        return f"{self.variant}: {self.grid} programs, block {tile}, {self.num_warps} warps"


def plan(
    n_rows: int,
    n_cols: int,
    itemsize: int,
    variant: str = "auto",
    *,
    num_warps: int | None = None,
    block_rows: int | None = None,
    block_cols: int | None = None,
) -> Launch:
    """The launch for an ``n_rows x n_cols`` softmax of ``itemsize``-byte elements.

    ``variant="auto"`` picks the kernel: rows of less than ``MIN_TILE_BYTES`` go several
    to a program; rows up to ``MAX_FUSED_COLS`` one to a program; wider rows to the
    online kernel. ``block_rows`` (rows only) and ``block_cols`` (online only) override
    the tile, ``num_warps`` the warps; arguments are checked by
    :func:`labkit.softmax.softmax`.
    """
    row_block = triton.next_power_of_2(n_cols)
    if variant == "auto":
        if row_block > MAX_FUSED_COLS:
            variant = "online"
        elif row_block * itemsize < MIN_TILE_BYTES and n_rows > 1:
            variant = "rows"
        else:
            variant = "row"
    if variant == "row":
        if row_block > MAX_FUSED_COLS:
            raise ValueError(
                f"variant 'row' keeps a row in registers, up to {MAX_FUSED_COLS} columns; got "
                f"{n_cols}: use variant 'online' (or 'auto')"
            )
        rows_per_program, cols_per_block, grid = 1, row_block, n_rows
    elif variant == "rows":
        if row_block > MAX_FUSED_COLS:
            raise ValueError(
                f"variant 'rows' keeps its rows in registers, up to {MAX_FUSED_COLS} columns; got "
                f"{n_cols}: use variant 'online' (or 'auto')"
            )
        if block_rows is None:
            block_rows = max(1, MIN_TILE_BYTES // (row_block * itemsize))
            block_rows = min(block_rows, triton.next_power_of_2(n_rows))
        rows_per_program, cols_per_block = block_rows, row_block
        grid = triton.cdiv(n_rows, block_rows)
    else:  # online
        cols_per_block = block_cols if block_cols is not None else min(ONLINE_BLOCK_COLS, row_block)
        rows_per_program, grid = 1, n_rows
    warps = num_warps if num_warps is not None else num_warps_for(rows_per_program * cols_per_block)
    return Launch(variant, rows_per_program, cols_per_block, warps, grid)


def _kernel_and_arguments(p: Launch, x: torch.Tensor, out: torch.Tensor) -> tuple:
    n_rows, n_cols = x.shape
    if p.variant == "row":
        return softmax_row_kernel, (x, out, n_cols, x.stride(0), out.stride(0)), {"BLOCK_COLS": p.block_cols}
    if p.variant == "rows":
        return (softmax_rows_kernel, (x, out, n_rows, n_cols, x.stride(0), out.stride(0)),
                {"BLOCK_ROWS": p.block_rows, "BLOCK_COLS": p.block_cols})
    return softmax_online_kernel, (x, out, n_cols, x.stride(0), out.stride(0)), {"BLOCK_COLS": p.block_cols}


def launch(p: Launch, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Run plan ``p`` on the 2-D ``x`` (unit column stride) into ``out`` of the same shape."""
    kernel, args, constants = _kernel_and_arguments(p, x, out)
    kernel[(p.grid,)](*args, **constants, num_warps=p.num_warps)
    return out


def compiled(p: Launch, x: torch.Tensor, out: torch.Tensor):
    """The compiled kernel plan ``p`` runs on ``x`` (GPU only: registers, spills, shared memory).

    Compiles without launching, with the arguments :func:`launch` passes, so Triton
    specializes it the same way (sizes equal to 1 or divisible by 16 compile variants).
    """
    kernel, args, constants = _kernel_and_arguments(p, x, out)
    return kernel.warmup(*args, **constants, num_warps=p.num_warps, grid=(1,))
