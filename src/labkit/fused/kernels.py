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
  is a sum over *all* rows; a fixed number of programs each sums its share of rows into
  fp32 partials, and torch adds the few hundred partial rows (no atomics, so the result
  does not depend on the order programs finish in).
- :func:`rope_kernel`: rotates the two halves of every head by its position's angle, reading
  ``src`` and writing ``dst`` (the same tensor in the forward: in place). The backward is
  the rotation by minus the angle (``SIGN = -1``).
- :func:`swiglu_fwd_kernel`, :func:`swiglu_bwd_kernel`: ``silu(g) * u`` and its two
  gradients; the backward recomputes ``sigmoid(g)`` instead of storing it.

The launchers below the kernels allocate outputs and pick grids; inputs are checked by
:mod:`labkit.fused`. On the GPU each kernel is autotuned over a handful of tiles (per
row width and dtype); under the interpreter a single small configuration runs.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import backend

WARP_SIZE = 32
# A thread should hold 8 to 16 values of a tile: fewer leaves too few bytes in flight per
# SM to cover HBM latency, more spills registers in the backward (which holds five rows).
VALUES_PER_THREAD = (8, 16)
MIN_TILE, MAX_TILE = 2048, 16384


def _row_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [triton.Config({"BLOCK_ROWS": 4}, num_warps=4)]
    return [triton.Config({"BLOCK_ROWS": rows}, num_warps=warps)
            for rows in (1, 2, 4, 8, 16) for warps in (4, 8, 16)]


def _prune_row_configs(configs, named_args, **kwargs):
    """Keep the tiles of 2-16K values at 8-16 values a thread (for this row width)."""
    if len(configs) == 1:
        return configs
    cols = {**named_args, **kwargs}["BLOCK_COLS"]

    def fits(c):
        tile = c.kwargs["BLOCK_ROWS"] * cols
        per_thread = tile // (WARP_SIZE * c.num_warps)
        sized = MIN_TILE <= tile <= MAX_TILE or (c.kwargs["BLOCK_ROWS"] == 1 and tile > MAX_TILE)
        return sized and VALUES_PER_THREAD[0] <= per_thread <= VALUES_PER_THREAD[1]

    kept = [c for c in configs if fits(c)]
    # Rows wider than 16 warps x 16 values: one row a program, as many warps as allowed.
    return kept or [triton.Config({"BLOCK_ROWS": 1}, num_warps=16)]


def compute_dtype(dtype: torch.dtype):
    """The precision a kernel computes in: fp64 for fp64 tensors, fp32 for the rest."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.autotune(configs=_row_configs(), key=["n_cols", "HAS_RESIDUAL"],
                 prune_configs_by={"early_config_prune": _prune_row_configs})
@triton.jit
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


@triton.autotune(configs=_row_configs(), key=["n_cols", "HAS_RESIDUAL"],
                 prune_configs_by={"early_config_prune": _prune_row_configs})
@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr, dres_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
    HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # A persistent program: it walks row tiles pid, pid + P, pid + 2P, ... and keeps its
    # share of dw in registers, written once at the end as one partial row.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols < n_cols
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(ACC)
    dw = tl.zeros((BLOCK_COLS,), dtype=ACC)
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    for tile in range(pid, n_tiles, n_programs):
        # int64 before the multiply by n_cols: rows * n_cols passes 2**31 on large inputs.
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        mask = (rows[:, None] < n_rows) & in_row[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(ACC)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        # y = w * xhat: dw gets dy * xhat (xhat rounded as the forward rounded it).
        dw += tl.sum(dy * x_hat.to(dx_ptr.dtype.element_ty).to(ACC), axis=0)
        m = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (m - xhat * mean(m * xhat)); the second term is the
        # gradient through the row's own statistic.
        dx = rstd[:, None] * (m - x_hat * (tl.sum(m * x_hat, axis=1) / n_cols)[:, None])
        if HAS_RESIDUAL:
            dx += tl.load(dres_ptr + offsets, mask=mask, other=0.0).to(ACC)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=in_row)


def _rope_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [triton.Config({"BLOCK_ROWS": 8}, num_warps=4)]
    return [triton.Config({"BLOCK_ROWS": rows}, num_warps=warps)
            for rows, warps in ((16, 4), (32, 4), (32, 8), (64, 8))]


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


@triton.autotune(configs=_rope_configs(), key=["q_heads", "k_heads", "HALF"],
                 restore_value=["q_dst_ptr", "k_dst_ptr"])
@triton.jit
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


def _flat_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [triton.Config({"BLOCK": 256}, num_warps=4)]
    return [triton.Config({"BLOCK": block}, num_warps=warps)
            for block, warps in ((1024, 4), (2048, 8), (4096, 8), (8192, 16))]


@triton.autotune(configs=_flat_configs(), key=["n"])
@triton.jit
def swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(ACC)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(ACC)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_flat_configs(), key=["n"])
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


# ---- launchers: contiguous tensors in, outputs allocated here ----

@lru_cache(maxsize=None)
def backward_programs() -> int:
    """Programs of the persistent norm backward: two per SM on a GPU (4 under the interpreter)."""
    if not backend.on_gpu():
        return 4
    return 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _row_grid(n_rows: int):
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_ROWS"]),)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None):
    """``(y, x + residual or None, rstd)``, normalising the rows of contiguous ``x`` (any
    shape; the last dimension is the row). Outputs have ``x``'s shape (not views)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       device=x.device)
    rms_norm_fwd_kernel[_row_grid(n_rows)](
        x, residual if residual is not None else x, weight, y,
        total if total is not None else y, rstd, n_rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None, ACC=compute_dtype(x.dtype),
        BLOCK_COLS=triton.next_power_of_2(n_cols),
    )
    return y, total, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dresidual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (all tensors contiguous, of ``x``'s shape); ``dresidual``, the gradient
    reaching ``x + residual`` along the residual stream, is added into ``dx`` (which is
    then the residual's gradient too)."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    dx = torch.empty_like(x)
    programs = min(backward_programs(), n_rows)
    partial = torch.empty(programs, n_cols, dtype=rstd.dtype, device=x.device)
    rms_norm_bwd_kernel[(programs,)](
        dy, dresidual if dresidual is not None else dy, x, weight, rstd, dx, partial,
        n_rows, n_cols, HAS_RESIDUAL=dresidual is not None, ACC=compute_dtype(x.dtype),
        BLOCK_COLS=triton.next_power_of_2(n_cols),
    )
    return dx, partial.sum(0).to(weight.dtype)


def rope(q_src: torch.Tensor, k_src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         q_dst: torch.Tensor, k_dst: torch.Tensor, inverse: bool = False) -> None:
    """Rotate ``[B, T, H, D]`` ``q_src``/``k_src`` into ``q_dst``/``k_dst`` (which may be
    the same tensors); ``inverse`` rotates by minus the angles (the backward)."""
    batch, seq_len, q_heads, head_dim = q_src.shape
    k_heads = k_src.shape[2]
    n_q_rows, n_k_rows = batch * seq_len * q_heads, batch * seq_len * k_heads
    half = head_dim // 2

    def grid(meta):
        return (triton.cdiv(n_q_rows, meta["BLOCK_ROWS"]) + triton.cdiv(n_k_rows, meta["BLOCK_ROWS"]),)

    rope_kernel[grid](
        q_src, q_dst, k_src, k_dst, cos, sin, n_q_rows, n_k_rows, q_heads, k_heads, seq_len,
        HALF=half, SIGN=-1.0 if inverse else 1.0, ACC=compute_dtype(q_src.dtype),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


def _flat_grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    swiglu_fwd_kernel[_flat_grid(gate.numel())](gate, up, out, gate.numel(), ACC=compute_dtype(gate.dtype))
    return out


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    swiglu_bwd_kernel[_flat_grid(gate.numel())](dout, gate, up, dgate, dup, gate.numel(),
                                                ACC=compute_dtype(gate.dtype))
    return dgate, dup
