"""Triton kernels for the non-matmul parts of a Qwen3 layer, forward and backward.

Each kernel makes one pass over memory: it reads each input element once and writes each
output element once. What they replace is a chain of eager torch operations, each its own
pass (an eager RMSNorm is eight: cast, square, mean, add, rsqrt, multiply, cast, multiply).
All arithmetic is in fp32 (fp64 for fp64 tensors) and rounded once on the store.

- :func:`rms_norm_fwd_kernel`: ``y = w * round(x * rstd)`` with ``rstd = 1/sqrt(mean(x^2) + eps)``
  per row, optionally first adding a residual (``HAS_RESIDUAL``: ``x + r`` is also stored,
  the stream the next layer reads). It saves ``rstd`` (4 bytes a row) for the backward.
- :func:`rms_norm_bwd_kernel`: ``dx = rstd * (m - xhat * mean(m * xhat))`` with
  ``m = dy * w``, plus the incoming residual gradient when the forward added one. ``dw``
  is a sum over *all* rows. Each program takes one contiguous run of rows, walks it a
  tile at a time (optionally double-buffered: ``PREFETCH`` loads the next tile before
  working on this one) and accumulates its share of ``dw`` in fp32 registers. Then either
  it writes that share once, as one partial row, and torch sums the partial rows (no
  atomics, so the result does not depend on the order programs finish in), or
  (``DW_ATOMIC``) it adds the share into one fp32 row with atomics and the last program to
  finish rounds the sum to ``dw``: one launch instead of three, summed in whatever order
  the programs finish.
- :func:`rope_kernel`: rotates the two halves of every head by its position's angle, reading
  ``src`` and writing ``dst`` (the same tensor in the forward: in place). The backward is
  the rotation by minus the angle (``SIGN = -1``).
- :func:`swiglu_fwd_kernel`, :func:`swiglu_bwd_kernel`: ``silu(g) * u`` and its two
  gradients; the backward recomputes ``sigmoid(g)`` instead of storing it. The forward
  also reads ``g`` and ``u`` as the two halves of each row of one tensor (``STRIDED``), the
  output of a single matmul by the stacked gate and up weights, as inference engines run it.
- :func:`qkv_norm_rope_kernel` (inference, no backward): for one token per program, the
  query and key heads of a stacked q/k/v projection's row through their RMSNorms and the
  rotation, and the keys and values stored at the token's row of a store (a paged KV pool's
  slot): what ``q_norm``, ``k_norm``, ``rope_kernel`` and two index copies do one after
  another, with the same roundings, in one launch.

The launchers below the kernels allocate outputs and pick each launch from a table
(:data:`NORM_FORWARD_TILES`, :data:`NORM_BACKWARD_TILES`, :data:`ROPE_TILES`,
:data:`SWIGLU_TILES`) measured on an H200 by the ``fused.tiles`` sweep
(:mod:`labkit.fused.tiles`); where a table leaves a choice open it goes to Triton's
autotuner at the first call (see the tables' comment). Every launcher also takes an
explicit tile, which is how the sweeps try their candidates. Inputs are checked by
:mod:`labkit.fused`. Under the interpreter a small tile runs, so the tests see several
row tiles and programs.

Row counts and the like are runtime values, not compile-time ones (``do_not_specialize``):
one compiled kernel serves every token count. The row width stays specialised: whether it
divides by 16 decides whether Triton may load a row in 16-byte vectors.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing

from .. import backend
from ..matmul import kernels as matmul_kernels  # the split-K matmul's tickets


@dataclass(frozen=True)
class RowTile:
    """A launch of a kernel over rows: ``block_rows`` rows a tile, ``num_warps`` warps a program."""

    block_rows: int
    num_warps: int


@dataclass(frozen=True)
class NormBackwardTile:
    """A launch of the norm backward: its row tile, how many programs per SM share the rows
    (each keeps one fp32 partial of ``dw``), and the software-pipelining depth of the walk
    over a program's tiles (``num_stages`` of :func:`triton.language.range`; 1 is none)."""

    block_rows: int
    num_warps: int
    programs_per_sm: int
    num_stages: int
    prefetch: bool | None = False  # None: the autotuner picks, per row width, at the first call
    # How the programs' shares of dw are summed: False, each writes a partial row and torch
    # sums them (two more launches, deterministic); True, each adds its share into one fp32
    # row with atomics and the last program to finish rounds it (one launch, summed in the
    # order programs finish; the launch tables' choice, except in deterministic mode).
    dw_atomic: bool = False


@dataclass(frozen=True)
class FlatTile:
    """A launch of an elementwise kernel: ``block`` elements and ``num_warps`` warps a program."""

    block: int
    num_warps: int


def pick_tile(table, width: int):
    """The tile of the first ``(widest, tile)`` entry with ``width <= widest`` (``None``: any)."""
    return next(tile for widest, tile in table if widest is None or width <= widest)


# The launch tables: (widest row, tile), first match wins. The norms' GPU tiles come from
# the fused.tiles sweep (book/results/nvidia-h200/fused.tiles.json, commit b39e214): per
# width, the candidate whose slowest of 4096, 16384 and 32768 tokens was fastest. Two
# things came after that sweep. The backward's register double-buffering (prefetch) is
# left to the autotuner where it is None: it times it against the plain walk at the first
# call per width. And the backward sums dw with atomics in its one launch: in the first
# fused.dw_reduction H200 record (commit dbd3445) the best atomic launch beat the best with
# partial rows at all 20 shapes where both were timed (1.02x to 1.55x). Its atomic candidates
# at width 5120 all failed their check there, the race that the last program's barrier
# closed after that run; the GPU tests check each table tile's atomics launch after launch.
# At hidden 1024 and 2560 (the goal shapes) the tiles were then changed, from a sweep of
# atomic tiles on an H100: at the goal's token count each was within 2% of that sweep's
# fastest, with and without a residual (the fastest changed with the residual). That sweep
# was a diagnostic, not a record: the fused.dw_reduction sweep, which times these tiles on
# the H200, decides whether they stay.
# SwiGLU and RoPE ran out of that sweep's time budget: they are autotuned at their first
# call over the four tiles each that earlier records measured (None below). Under the
# interpreter one small tile serves (it only has to be correct, and small enough that the
# tests' odd sizes span several tiles and programs).
GPU_NORM_FORWARD_TILES = ((1024, RowTile(2, 2)), (2048, RowTile(2, 4)), (4096, RowTile(1, 4)),
                          (None, RowTile(1, 8)))
GPU_NORM_BACKWARD_TILES = ((1024, NormBackwardTile(4, 8, 2, 1, True, True)),
                           (2048, NormBackwardTile(2, 8, 2, 1, None, True)),
                           (2560, NormBackwardTile(1, 8, 2, 1, True, True)),
                           (4096, NormBackwardTile(1, 16, 2, 1, None, True)),
                           (None, NormBackwardTile(2, 32, 1, 1, None, True)))
GPU_ROPE_TILES = ((None, None),)  # by head_dim
GPU_SWIGLU_TILES = ((None, None),)  # by the width of a row
ROPE_CANDIDATES = (RowTile(16, 4), RowTile(32, 4), RowTile(32, 8), RowTile(64, 8))
SWIGLU_CANDIDATES = (FlatTile(1024, 4), FlatTile(2048, 8), FlatTile(4096, 8), FlatTile(8192, 16))

NORM_FORWARD_TILES = backend.pick(cpu=((None, RowTile(4, 4)),), gpu=GPU_NORM_FORWARD_TILES)
NORM_BACKWARD_TILES = backend.pick(cpu=((None, NormBackwardTile(4, 4, 1, 1, True, True)),),
                                   gpu=GPU_NORM_BACKWARD_TILES)
ROPE_TILES = backend.pick(cpu=((None, RowTile(8, 4)),), gpu=GPU_ROPE_TILES)
SWIGLU_TILES = backend.pick(cpu=((None, FlatTile(256, 4)),), gpu=GPU_SWIGLU_TILES)


def compute_dtype(dtype: torch.dtype):
    """The precision a kernel computes in: fp64 for fp64 tensors, fp32 for the rest."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit(do_not_specialize=["n_rows", "eps"])
def rms_norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rstd_ptr, n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # A (BLOCK_ROWS, BLOCK_COLS) tile of whole rows: the row's sum of squares is a
    # reduction along axis 1 in registers, so x is read from memory once.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols < n_cols
    mask = (rows[:, None] < n_rows) & in_row[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the storage dtype first, as `x + residual` in torch does: the
        # norm must see the same stream the next residual add will.
        r = tl.load(res_ptr + offsets, mask=mask, other=0.0)
        x = (x.to(ACC) + r.to(ACC)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, x, mask=mask)
    x = x.to(ACC)
    # Masked lanes hold 0: they add nothing to the sum, and the mean divides by n_cols.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_hat = (x * rstd[:, None]).to(y_ptr.dtype.element_ty)  # HF rounds before the weight
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0)
    y = x_hat.to(ACC) * w.to(ACC)[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _load_rows(dy_ptr, dres_ptr, x_ptr, rstd_ptr, start, end, n_cols, cols, in_row,
               HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """A tile's dy, residual gradient (dy again when there is none: unused) and x, in their
    storage dtype, and rstd; rows at or past ``end`` load nothing. All the tile's loads are
    issued here together, so that their latencies overlap."""
    rows = start + tl.arange(0, BLOCK_ROWS)  # int64: rows * n_cols passes 2**31
    in_run = rows < end
    offsets = rows[:, None] * n_cols + cols[None, :]
    mask = in_run[:, None] & in_row[None, :]
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        dres = tl.load(dres_ptr + offsets, mask=mask, other=0.0)
    else:
        dres = dy
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=in_run, other=0.0)
    return dy, dres, x, rstd


@triton.jit
def _rows_backward(dy, dres, x, rstd, w, dw, dx_ptr, start, end, n_cols, cols, in_row,
                   HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Store one tile's dx; return ``dw`` with the tile's rows added."""
    rows = start + tl.arange(0, BLOCK_ROWS)
    offsets = rows[:, None] * n_cols + cols[None, :]
    mask = (rows < end)[:, None] & in_row[None, :]
    dy = dy.to(ACC)
    x_hat = x.to(ACC) * rstd[:, None]
    # y = w * xhat: dw gets dy * xhat (xhat rounded as the forward rounded it).
    dw += dy * x_hat.to(dx_ptr.dtype.element_ty).to(ACC)
    m = dy * w[None, :]
    # d/dx of x * rstd(x): rstd * (m - xhat * mean(m * xhat)); the second term is the
    # gradient through the row's own statistic.
    dx = rstd[:, None] * (m - x_hat * (tl.sum(m * x_hat, axis=1) / n_cols)[:, None])
    if HAS_RESIDUAL:
        dx += dres.to(ACC)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return dw


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def rms_norm_bwd_kernel(
    dy_ptr, dres_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr,
    dw_partial_ptr,  # not DW_ATOMIC: [programs, n_cols] partial rows; DW_ATOMIC: [n_cols], zero between launches
    dw_ptr, ticket_ptr,  # DW_ATOMIC: the rounded dw, and one int32 ticket, zero between launches
    n_rows, n_cols, rows_per_program,
    HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, DW_ATOMIC: tl.constexpr = False,
):
    # Program p owns rows [p * rows_per_program, its end) and walks them a tile at a time.
    # Its share of dw stays in registers as a (BLOCK_ROWS, BLOCK_COLS) fp32 sum, added to
    # elementwise on every tile, reduced over its rows and written once at the end.
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols < n_cols
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(ACC)
    dw = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=ACC)
    if PREFETCH:
        # Double-buffered in registers: the next tile's loads are issued before this tile's
        # arithmetic and stores, so they are in flight while it runs (a program then holds
        # two tiles of bytes in flight at its busiest instead of one).
        dy, dres, x, rstd = _load_rows(dy_ptr, dres_ptr, x_ptr, rstd_ptr, first, end, n_cols, cols, in_row,
                                       HAS_RESIDUAL, BLOCK_ROWS)
        for start in tl.range(first, end, BLOCK_ROWS, num_stages=NUM_STAGES):
            dy_next, dres_next, x_next, rstd_next = _load_rows(
                dy_ptr, dres_ptr, x_ptr, rstd_ptr, start + BLOCK_ROWS, end, n_cols, cols, in_row,
                HAS_RESIDUAL, BLOCK_ROWS)
            dw = _rows_backward(dy, dres, x, rstd, w, dw, dx_ptr, start, end, n_cols, cols, in_row,
                                HAS_RESIDUAL, ACC, BLOCK_ROWS)
            dy, dres, x, rstd = dy_next, dres_next, x_next, rstd_next
    else:
        # num_stages > 1 lets Triton issue the next tiles' loads before this one is done.
        for start in tl.range(first, end, BLOCK_ROWS, num_stages=NUM_STAGES):
            dy, dres, x, rstd = _load_rows(dy_ptr, dres_ptr, x_ptr, rstd_ptr, start, end, n_cols, cols, in_row,
                                           HAS_RESIDUAL, BLOCK_ROWS)
            dw = _rows_backward(dy, dres, x, rstd, w, dw, dx_ptr, start, end, n_cols, cols, in_row,
                                HAS_RESIDUAL, ACC, BLOCK_ROWS)
    dw = tl.sum(dw, axis=0)
    if DW_ATOMIC:
        # The matmul chapter's split-K tickets, with the partials summed as they arrive: each
        # program adds its share into one fp32 row in L2 (relaxed: only the sum matters), every
        # thread's adds are issued before the ticket is taken (the barrier), and the ticket's
        # release / acquire orders them before the last program's loads, which read from L2
        # (.cg), where the atomics were performed. That program rounds the row to dw and
        # leaves it at zero.
        tl.atomic_add(dw_partial_ptr + cols, dw, mask=in_row, sem="relaxed")
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            total = tl.load(dw_partial_ptr + cols, mask=in_row, other=0.0, cache_modifier=".cg")
            tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=in_row)
            # Every thread has read the sum before any thread zeroes it. Triton lays the load
            # and the zeroing store out over the threads independently (at 32 warps and 8192
            # columns, 8 columns a thread for one and 4 for the other), so without the barrier
            # one warp zeroed columns another had not read yet: an H200 run got dw = 0 there.
            tl.debug_barrier()
            tl.store(dw_partial_ptr + cols, tl.zeros_like(total), mask=in_row)
            tl.atomic_xchg(ticket_ptr, 0)  # ready for the next launch
    else:
        tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=in_row)


@triton.jit
def _rotate_rows(src_ptr, dst_ptr, cos_ptr, sin_ptr, tile, n_rows, heads, seq_len,
                 HALF: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr):
    # Rows are (batch, token, head) triples of a [B, T, H, D] tensor; a row's token is
    # (row // heads) % T, and that token's cos/sin row (read mostly from L2: every head of
    # every batch entry reads the same one) gives the angles.
    rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    first = rows[:, None] * (2 * HALF) + cols[None, :]
    token = (rows // heads) % seq_len
    angle = token[:, None] * (2 * HALF) + cols[None, :]  # the first half: both halves are equal
    cos = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(ACC)
    sin = SIGN * tl.load(sin_ptr + angle, mask=mask, other=0.0).to(ACC)
    x1 = tl.load(src_ptr + first, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(src_ptr + first + HALF, mask=mask, other=0.0).to(ACC)
    # [x1, x2] * cos + [-x2, x1] * sin: HF's rotate_half convention.
    tl.store(dst_ptr + first, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + first + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_q_rows", "n_k_rows", "q_heads", "k_heads", "seq_len"])
def rope_kernel(
    q_src_ptr, q_dst_ptr, k_src_ptr, k_dst_ptr, cos_ptr, sin_ptr, n_q_rows, n_k_rows,
    q_heads, k_heads, seq_len,
    HALF: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    # One launch for q and k: the first programs take q's rows, the rest k's.
    pid = tl.program_id(0)
    q_tiles = tl.cdiv(n_q_rows, BLOCK_ROWS)
    if pid < q_tiles:
        _rotate_rows(q_src_ptr, q_dst_ptr, cos_ptr, sin_ptr, pid, n_q_rows, q_heads, seq_len,
                     HALF, SIGN, ACC, BLOCK_HALF, BLOCK_ROWS)
    else:
        _rotate_rows(k_src_ptr, k_dst_ptr, cos_ptr, sin_ptr, pid - q_tiles, n_k_rows, k_heads, seq_len,
                     HALF, SIGN, ACC, BLOCK_HALF, BLOCK_ROWS)


@triton.jit
def _norm_rope_heads(src, dst, w_ptr, heads, cols, n_heads, cos, sin, eps,
                     HALF: tl.constexpr, ACC: tl.constexpr):
    # RMSNorm of each of the n_heads rows of 2 * HALF at src (one token's heads), then the
    # rotation, stored at dst. Rounded where rms_norm_fwd_kernel and rope_kernel round, one
    # after the other: the normalised row before the weight, the norm's output, the rotation.
    mask = (heads[:, None] < n_heads) & (cols[None, :] < HALF)
    first = heads[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(src + first, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(src + first + HALF, mask=mask, other=0.0).to(ACC)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(ACC)
    w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(ACC)
    out_ty = dst.dtype.element_ty
    y1 = ((x1 * rstd[:, None]).to(out_ty).to(ACC) * w1[None, :]).to(out_ty).to(ACC)
    y2 = ((x2 * rstd[:, None]).to(out_ty).to(ACC) * w2[None, :]).to(out_ty).to(ACC)
    tl.store(dst + first, (y1 * cos - y2 * sin).to(out_ty), mask=mask)
    tl.store(dst + first + HALF, (y2 * cos + y1 * sin).to(out_ty), mask=mask)


@triton.jit(do_not_specialize=["eps"])
def qkv_norm_rope_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    eps, stride_qkv, stride_q_out, stride_k_out, stride_v_out,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HAS_SLOTS: tl.constexpr,
    ACC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One token per program: its row of the q/k/v projection holds Q_HEADS query heads, then
    # KV_HEADS key heads, then KV_HEADS value heads, each 2 * HALF wide. Queries and keys are
    # normed (q_norm, k_norm) and rotated; keys and values go to row slot[t] of their stores
    # (a paged pool's flat slots), queries to row t of q_out.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    angle = t * (2 * HALF) + cols  # the first half of the token's cos/sin row: both halves are equal
    cos = tl.load(cos_ptr + angle, mask=cols < HALF, other=0.0).to(ACC)[None, :]
    sin = tl.load(sin_ptr + angle, mask=cols < HALF, other=0.0).to(ACC)[None, :]
    if HAS_SLOTS:
        dest = tl.load(slot_ptr + t).to(tl.int64)
    else:
        dest = t
    row = qkv_ptr + t * stride_qkv
    _norm_rope_heads(row, q_out_ptr + t * stride_q_out, q_weight_ptr, heads, cols, Q_HEADS, cos, sin, eps,
                     HALF, ACC)
    _norm_rope_heads(row + Q_HEADS * 2 * HALF, k_out_ptr + dest * stride_k_out, k_weight_ptr, heads, cols,
                     KV_HEADS, cos, sin, eps, HALF, ACC)
    v_mask = (heads[:, None] < KV_HEADS) & (cols[None, :] < HALF)
    v_first = heads[:, None] * (2 * HALF) + cols[None, :]
    v_src = row + (Q_HEADS + KV_HEADS) * 2 * HALF
    v_dst = v_out_ptr + dest * stride_v_out
    tl.store(v_dst + v_first, tl.load(v_src + v_first, mask=v_mask), mask=v_mask)
    tl.store(v_dst + v_first + HALF, tl.load(v_src + v_first + HALF, mask=v_mask), mask=v_mask)


# n stays specialised here: when it divides by 16 the mask is constant over 16-element
# groups, and the loads and stores can be vectorised.
@triton.jit
def swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, width, in_row_stride, ACC: tl.constexpr, BLOCK: tl.constexpr,
                      STRIDED: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if STRIDED:  # gate and up are rows of `width` in rows of `in_row_stride` (one gate/up matmul's halves)
        in_offsets = (offsets // width) * in_row_stride + offsets % width
    else:
        in_offsets = offsets
    g = tl.load(gate_ptr + in_offsets, mask=mask, other=0.0).to(ACC)
    u = tl.load(up_ptr + in_offsets, mask=mask, other=0.0).to(ACC)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    d = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(ACC)
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(ACC)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(ACC)
    s = tl.sigmoid(g)
    silu = g * s
    # silu'(g) = s + g * s * (1 - s) = s * (1 + g * (1 - s))
    tl.store(dgate_ptr + offsets, (d * u * s * (1.0 + g * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (d * silu).to(dup_ptr.dtype.element_ty), mask=mask)


# ---- autotuned variants, for the table entries that leave a choice to the first call ----

# The norm backward with the tile's warps, PREFETCH chosen by timing both (one per warp count:
# num_warps belongs to an autotuner's configs, not to its caller).
NORM_BACKWARD_AUTOTUNED = {
    warps: triton.autotune([triton.Config({"PREFETCH": p}, num_warps=warps) for p in (False, True)],
                           key=["n_cols", "HAS_RESIDUAL", "BLOCK_ROWS", "NUM_STAGES", "DW_ATOMIC"])(rms_norm_bwd_kernel)
    for warps in (1, 2, 4, 8, 16, 32)}
# RoPE writes in place in the forward: each timed try must start from the same input.
ROPE_AUTOTUNED = triton.autotune(
    [triton.Config({"BLOCK_ROWS": t.block_rows}, num_warps=t.num_warps) for t in ROPE_CANDIDATES],
    key=["q_heads", "k_heads", "HALF", "SIGN"], restore_value=["q_dst_ptr", "k_dst_ptr"])(rope_kernel)
SWIGLU_FWD_AUTOTUNED = triton.autotune(
    [triton.Config({"BLOCK": t.block}, num_warps=t.num_warps) for t in SWIGLU_CANDIDATES],
    key=["n", "STRIDED"])(swiglu_fwd_kernel)
SWIGLU_BWD_AUTOTUNED = triton.autotune(
    [triton.Config({"BLOCK": t.block}, num_warps=t.num_warps) for t in SWIGLU_CANDIDATES],
    key=["n"])(swiglu_bwd_kernel)


def autotuned_choices() -> dict[str, dict[str, str]]:
    """What each autotuner chose so far, by kernel and key (for the benchmarks' records)."""
    tuners = {f"rms_norm_bwd_kernel, {w} warps": t for w, t in NORM_BACKWARD_AUTOTUNED.items()}
    tuners.update({"rope_kernel": ROPE_AUTOTUNED, "swiglu_fwd_kernel": SWIGLU_FWD_AUTOTUNED,
                   "swiglu_bwd_kernel": SWIGLU_BWD_AUTOTUNED})
    choices = {name: {str(key): str(config) for key, config in tuner.cache.items()}
               for name, tuner in tuners.items() if tuner.cache}
    return choices


# ---- launchers: contiguous tensors in, outputs allocated here ----

def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None, tile: RowTile | None = None):
    """``(y, x + residual or None, rstd)``, normalising the rows of contiguous ``x`` (any
    shape; the last dimension is the row). Outputs have ``x``'s shape (not views)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    tile = tile or pick_tile(NORM_FORWARD_TILES, n_cols)
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       device=x.device)
    rms_norm_fwd_kernel[(triton.cdiv(n_rows, tile.block_rows),)](
        x, residual if residual is not None else x, weight, y,
        total if total is not None else y, rstd, n_rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None, ACC=compute_dtype(x.dtype),
        BLOCK_COLS=triton.next_power_of_2(n_cols), BLOCK_ROWS=tile.block_rows, num_warps=tile.num_warps,
    )
    return y, total, rstd


def norm_backward_split(n_rows: int, tile: NormBackwardTile) -> tuple[int, int]:
    """``(programs, rows_per_program)``: ``tile.programs_per_sm`` programs per SM (fewer when
    there are fewer row tiles), each taking a whole number of tiles."""
    programs = max(1, min(tile.programs_per_sm * backend.sm_count(), triton.cdiv(n_rows, tile.block_rows)))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), tile.block_rows) * tile.block_rows
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


@functools.lru_cache(maxsize=None)
def dw_accumulator(device: torch.device, dtype: torch.dtype, n_cols: int) -> torch.Tensor:
    """The row the atomic ``dw`` reduction adds into: zeroed once, and every launch leaves it
    at zero again (its last program zeroes it after reading the sum). One per width and
    device: launches on one stream run one after another, so they never share it at once."""
    return torch.zeros(n_cols, dtype=dtype, device=device)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dresidual: torch.Tensor | None = None,
                      tile: NormBackwardTile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (all tensors contiguous, of ``x``'s shape); ``dresidual``, the gradient
    reaching ``x + residual`` along the residual stream, is added into ``dx`` (which is
    then the residual's gradient too). Under ``torch.use_deterministic_algorithms(True)``
    an atomic ``dw`` reduction gives way to the partial rows, whose sum has one order."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    tile = tile or pick_tile(NORM_BACKWARD_TILES, n_cols)
    if tile.dw_atomic and torch.are_deterministic_algorithms_enabled():
        tile = dataclasses.replace(tile, dw_atomic=False)
    programs, rows_per_program = norm_backward_split(n_rows, tile)
    dx = torch.empty_like(x)
    if tile.dw_atomic:
        partial = dw_accumulator(x.device, rstd.dtype, n_cols)
        dw = torch.empty(n_cols, dtype=weight.dtype, device=x.device)
        ticket = matmul_kernels.tickets(x.device, 1)
    else:
        partial = torch.empty(programs, n_cols, dtype=rstd.dtype, device=x.device)
        dw, ticket = partial, rstd  # never touched: the kernel's DW_ATOMIC removes their uses
    args = (dy, dresidual if dresidual is not None else dy, x, weight, rstd, dx, partial, dw, ticket,
            n_rows, n_cols, rows_per_program)
    meta = dict(HAS_RESIDUAL=dresidual is not None, ACC=compute_dtype(x.dtype),
                BLOCK_COLS=triton.next_power_of_2(n_cols), BLOCK_ROWS=tile.block_rows, NUM_STAGES=tile.num_stages,
                DW_ATOMIC=tile.dw_atomic)
    if tile.prefetch is None:
        NORM_BACKWARD_AUTOTUNED[tile.num_warps][(programs,)](*args, **meta)
    else:
        rms_norm_bwd_kernel[(programs,)](*args, **meta, PREFETCH=tile.prefetch, num_warps=tile.num_warps)
    return dx, dw if tile.dw_atomic else partial.sum(0).to(weight.dtype)


def rope(q_src: torch.Tensor, k_src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         q_dst: torch.Tensor, k_dst: torch.Tensor, inverse: bool = False, tile: RowTile | None = None) -> None:
    """Rotate ``[B, T, H, D]`` ``q_src``/``k_src`` into ``q_dst``/``k_dst`` (which may be
    the same tensors); ``inverse`` rotates by minus the angles (the backward)."""
    batch, seq_len, q_heads, head_dim = q_src.shape
    k_heads = k_src.shape[2]
    n_q_rows, n_k_rows = batch * seq_len * q_heads, batch * seq_len * k_heads
    half = head_dim // 2
    tile = tile or pick_tile(ROPE_TILES, head_dim)
    args = (q_src, q_dst, k_src, k_dst, cos, sin, n_q_rows, n_k_rows, q_heads, k_heads, seq_len)
    meta = dict(HALF=half, SIGN=-1.0 if inverse else 1.0, ACC=compute_dtype(q_src.dtype),
                BLOCK_HALF=triton.next_power_of_2(half))

    def grid(launch):
        return (triton.cdiv(n_q_rows, launch["BLOCK_ROWS"]) + triton.cdiv(n_k_rows, launch["BLOCK_ROWS"]),)

    if tile is None:
        ROPE_AUTOTUNED[grid](*args, **meta)
    else:
        rope_kernel[grid](*args, **meta, BLOCK_ROWS=tile.block_rows, num_warps=tile.num_warps)


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, *, q_out: torch.Tensor, k_out: torch.Tensor,
                  v_out: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
    """Norm and rotate the queries and keys of ``qkv`` ``[N, (Hq + 2 Hk) D]`` into ``q_out``
    ``[N, Hq, D]`` and rows ``slot_mapping`` (``0..N-1`` if None) of ``k_out`` ``[S, Hk, D]``,
    and copy the values into the same rows of ``v_out``. Every row's heads and dims contiguous."""
    q_heads, kv_heads, head_dim = q_out.shape[1], k_out.shape[1], q_out.shape[2]
    half = head_dim // 2
    qkv_norm_rope_kernel[(qkv.shape[0],)](
        qkv, q_weight, k_weight, cos, sin, slot_mapping if slot_mapping is not None else qkv, q_out, k_out, v_out,
        eps, qkv.stride(0), q_out.stride(0), k_out.stride(0), v_out.stride(0),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=half, HAS_SLOTS=slot_mapping is not None,
        ACC=compute_dtype(qkv.dtype), BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )


def _flat_grid(n: int):
    return lambda launch: (triton.cdiv(n, launch["BLOCK"]),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, tile: FlatTile | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of contiguous ``gate`` and ``up``, into a new tensor."""
    out = torch.empty_like(gate)
    _swiglu_launch(gate, up, out, gate.shape[-1], gate.shape[-1], strided=False, tile=tile)
    return out


def swiglu_halves_forward(gate_up: torch.Tensor, tile: FlatTile | None = None) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate`` and ``up`` are the two halves of contiguous
    ``gate_up``'s last dimension (the output of one matmul by the stacked gate and up
    weights): ``[..., 2M]`` in, ``[..., M]`` out, the halves read in place."""
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    _swiglu_launch(gate_up, gate_up[..., width:], out, width, 2 * width, strided=True, tile=tile)
    return out


def _swiglu_launch(gate, up, out, width: int, in_row_stride: int, *, strided: bool, tile: FlatTile | None) -> None:
    tile = tile or pick_tile(SWIGLU_TILES, width)
    args, n = (gate, up, out, out.numel(), width, in_row_stride), out.numel()
    if tile is None:
        SWIGLU_FWD_AUTOTUNED[_flat_grid(n)](*args, ACC=compute_dtype(out.dtype), STRIDED=strided)
    else:
        swiglu_fwd_kernel[_flat_grid(n)](*args, ACC=compute_dtype(out.dtype), BLOCK=tile.block, STRIDED=strided,
                                         num_warps=tile.num_warps)


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    tile: FlatTile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tile = tile or pick_tile(SWIGLU_TILES, gate.shape[-1])
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    args, n = (dout, gate, up, dgate, dup, gate.numel()), gate.numel()
    if tile is None:
        SWIGLU_BWD_AUTOTUNED[_flat_grid(n)](*args, ACC=compute_dtype(gate.dtype))
    else:
        swiglu_bwd_kernel[_flat_grid(n)](*args, ACC=compute_dtype(gate.dtype), BLOCK=tile.block,
                                         num_warps=tile.num_warps)
    return dgate, dup
