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
  working on this one) and accumulates its share of ``dw`` in fp32 registers; it writes
  that share once, as one partial row, and torch sums the partial rows (no atomics, so the
  result does not depend on the order programs finish in).
- :func:`rope_kernel`: rotates the two halves of every head by its position's angle, reading
  ``src`` and writing ``dst`` (the same tensor in the forward: in place). The backward is
  the rotation by minus the angle (``SIGN = -1``).
- :func:`swiglu_fwd_kernel`, :func:`swiglu_bwd_kernel`: ``silu(g) * u`` and its two
  gradients; the backward recomputes ``sigmoid(g)`` instead of storing it.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import backend


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


@dataclass(frozen=True)
class FlatTile:
    """A launch of an elementwise kernel: ``block`` elements and ``num_warps`` warps a program."""

    block: int
    num_warps: int


def pick_tile(table, width: int):
    """The tile of the first ``(widest, tile)`` entry with ``width <= widest`` (``None``: any)."""
    return next(tile for widest, tile in table if widest is None or width <= widest)


# The launch tables: (widest row, tile), first match wins. The norms' GPU tiles are the
# fused.tiles sweep's (book/results/nvidia-h200/fused.tiles.json, commit b39e214): per
# width, the candidate whose slowest of 4096, 16384 and 32768 tokens was fastest. The
# backward's register double-buffering (prefetch) came after that sweep: it is left to
# the autotuner, which times it against the plain walk at the first call per width.
# SwiGLU and RoPE ran out of that sweep's time budget: they are autotuned at their first
# call over the four tiles each that earlier records measured (None below). Under the
# interpreter one small tile serves (it only has to be correct, and small enough that the
# tests' odd sizes span several tiles and programs).
GPU_NORM_FORWARD_TILES = ((1024, RowTile(2, 2)), (2048, RowTile(2, 4)), (4096, RowTile(1, 4)),
                          (None, RowTile(1, 8)))
GPU_NORM_BACKWARD_TILES = ((1024, NormBackwardTile(1, 8, 8, 1, None)), (2048, NormBackwardTile(2, 8, 2, 1, None)),
                           (4096, NormBackwardTile(1, 16, 2, 1, None)), (None, NormBackwardTile(2, 32, 1, 1, None)))
GPU_ROPE_TILES = ((None, None),)  # by head_dim
GPU_SWIGLU_TILES = ((None, None),)  # by the width of a row
ROPE_CANDIDATES = (RowTile(16, 4), RowTile(32, 4), RowTile(32, 8), RowTile(64, 8))
SWIGLU_CANDIDATES = (FlatTile(1024, 4), FlatTile(2048, 8), FlatTile(4096, 8), FlatTile(8192, 16))

NORM_FORWARD_TILES = backend.pick(cpu=((None, RowTile(4, 4)),), gpu=GPU_NORM_FORWARD_TILES)
NORM_BACKWARD_TILES = backend.pick(cpu=((None, NormBackwardTile(4, 4, 1, 1, True)),), gpu=GPU_NORM_BACKWARD_TILES)
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
    dy_ptr, dres_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
    HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
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
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0), mask=in_row)


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


# n stays specialised here: when it divides by 16 the mask is constant over 16-element
# groups, and the loads and stores can be vectorised.
@triton.jit
def swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(ACC)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(ACC)
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
                           key=["n_cols", "HAS_RESIDUAL", "BLOCK_ROWS", "NUM_STAGES"])(rms_norm_bwd_kernel)
    for warps in (1, 2, 4, 8, 16, 32)}
# RoPE writes in place in the forward: each timed try must start from the same input.
ROPE_AUTOTUNED = triton.autotune(
    [triton.Config({"BLOCK_ROWS": t.block_rows}, num_warps=t.num_warps) for t in ROPE_CANDIDATES],
    key=["q_heads", "k_heads", "HALF", "SIGN"], restore_value=["q_dst_ptr", "k_dst_ptr"])(rope_kernel)
SWIGLU_FWD_AUTOTUNED, SWIGLU_BWD_AUTOTUNED = (
    triton.autotune([triton.Config({"BLOCK": t.block}, num_warps=t.num_warps) for t in SWIGLU_CANDIDATES],
                    key=["n"])(kernel) for kernel in (swiglu_fwd_kernel, swiglu_bwd_kernel))


def autotuned_choices() -> dict[str, dict[str, str]]:
    """What each autotuner chose so far, by kernel and key (for the benchmarks' records)."""
    tuners = {f"rms_norm_bwd_kernel, {w} warps": t for w, t in NORM_BACKWARD_AUTOTUNED.items()}
    tuners.update({"rope_kernel": ROPE_AUTOTUNED, "swiglu_fwd_kernel": SWIGLU_FWD_AUTOTUNED,
                   "swiglu_bwd_kernel": SWIGLU_BWD_AUTOTUNED})
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in tuners.items() if tuner.cache}


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


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dresidual: torch.Tensor | None = None,
                      tile: NormBackwardTile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (all tensors contiguous, of ``x``'s shape); ``dresidual``, the gradient
    reaching ``x + residual`` along the residual stream, is added into ``dx`` (which is
    then the residual's gradient too)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    tile = tile or pick_tile(NORM_BACKWARD_TILES, n_cols)
    programs, rows_per_program = norm_backward_split(n_rows, tile)
    dx = torch.empty_like(x)
    partial = torch.empty(programs, n_cols, dtype=rstd.dtype, device=x.device)
    args = (dy, dresidual if dresidual is not None else dy, x, weight, rstd, dx, partial,
            n_rows, n_cols, rows_per_program)
    meta = dict(HAS_RESIDUAL=dresidual is not None, ACC=compute_dtype(x.dtype),
                BLOCK_COLS=triton.next_power_of_2(n_cols), BLOCK_ROWS=tile.block_rows, NUM_STAGES=tile.num_stages)
    if tile.prefetch is None:
        NORM_BACKWARD_AUTOTUNED[tile.num_warps][(programs,)](*args, **meta)
    else:
        rms_norm_bwd_kernel[(programs,)](*args, **meta, PREFETCH=tile.prefetch, num_warps=tile.num_warps)
    return dx, partial.sum(0).to(weight.dtype)


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


def _flat_grid(n: int):
    return lambda launch: (triton.cdiv(n, launch["BLOCK"]),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, tile: FlatTile | None = None) -> torch.Tensor:
    tile = tile or pick_tile(SWIGLU_TILES, gate.shape[-1])
    out = torch.empty_like(gate)
    args, n = (gate, up, out, gate.numel()), gate.numel()
    if tile is None:
        SWIGLU_FWD_AUTOTUNED[_flat_grid(n)](*args, ACC=compute_dtype(gate.dtype))
    else:
        swiglu_fwd_kernel[_flat_grid(n)](*args, ACC=compute_dtype(gate.dtype), BLOCK=tile.block,
                                         num_warps=tile.num_warps)
    return out


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
