"""Softmax over the last dimension, in Triton: chapter "Triton from first principles".

>>> y = softmax(x)                      # any shape; the kernel is picked by row width
>>> y = softmax(x, variant="online")    # or name one: "row", "rows", "online"

The kernels live in :mod:`labkit.softmax.kernels`, the plain-torch versions (the float64
oracle, the naive multi-pass one, the online one) in :mod:`labkit.softmax.reference`,
the measurements in :mod:`labkit.softmax.bench`.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_choice, check_positive_int, check_power_of_two, check_tensor
from . import kernels
from .kernels import VARIANTS, Launch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["DTYPES", "VARIANTS", "Launch", "plan_for", "softmax"]


def _check_options(variant, num_warps, block_rows, block_cols) -> None:
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a string, got {type(variant).__name__}")
    check_choice(variant, "variant", ("auto", *VARIANTS))
    if num_warps is not None:
        check_power_of_two(num_warps, "num_warps")
        if num_warps > 32:
            raise ValueError(f"num_warps must be at most 32 (1024 threads a program), got {num_warps}")
    if block_rows is not None:
        check_power_of_two(block_rows, "block_rows")
        if variant != "rows":
            raise ValueError(f"block_rows applies to variant 'rows' only, got variant {variant!r}")
    if block_cols is not None:
        check_power_of_two(block_cols, "block_cols")
        if variant != "online":
            raise ValueError(
                f"block_cols applies to variant 'online' only (the other kernels hold the whole "
                f"row in one block), got variant {variant!r}"
            )


def plan_for(
    x: torch.Tensor,
    variant: str = "auto",
    *,
    num_warps: int | None = None,
    block_rows: int | None = None,
    block_cols: int | None = None,
) -> Launch:
    """The launch :func:`softmax` would use for ``x``: kernel, tile, warps, programs."""
    check_tensor(x, "x", dtypes=DTYPES)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (softmax runs over the last)")
    _check_options(variant, num_warps, block_rows, block_cols)
    n_cols = x.shape[-1]
    return kernels.plan(x.numel() // n_cols, n_cols, x.element_size(), variant,
                        num_warps=num_warps, block_rows=block_rows, block_cols=block_cols)


def softmax(
    x: torch.Tensor,
    *,
    variant: str = "auto",
    num_warps: int | None = None,
    block_rows: int | None = None,
    block_cols: int | None = None,
) -> torch.Tensor:
    """Softmax of ``x`` over its last dimension, in ``x``'s dtype (computed in fp32).

    ``x``: fp32, fp16 or bf16, on :func:`labkit.device`, with unit stride along the last
    dimension (leading dimensions may be strided). Differentiable: the backward runs in
    torch (see :class:`_Softmax`). ``variant``: ``"auto"`` (by row width),
    ``"row"``, ``"rows"`` or ``"online"``. ``num_warps``, ``block_rows`` (rows) and
    ``block_cols`` (online) override the launch settings; they must be powers of two.
    """
    p = plan_for(x, variant, num_warps=num_warps, block_rows=block_rows, block_cols=block_cols)
    check_tensor(x, "x", device=backend.device())
    if x.stride(-1) != 1:
        raise ValueError(
            f"x must have unit stride along its last dimension, got strides {tuple(x.stride())} "
            f"for shape {tuple(x.shape)}; call .contiguous() first"
        )
    return _Softmax.apply(x, p)


class _Softmax(torch.autograd.Function):
    """The Triton forward; the backward in torch, so training through :func:`softmax` gets
    its gradient rather than a silently detached result: with y = softmax(x) and upstream
    g, dx = y * (g - sum(g * y)) row by row (computed in fp32, returned in x's dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: Launch) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # a view when the leading dimensions allow one
        out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
        kernels.launch(p, x2d, out)
        out = out.view(x.shape)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (y,) = ctx.saved_tensors
        y32, g32 = y.float(), grad_out.float()
        grad_x = y32 * (g32 - (g32 * y32).sum(-1, keepdim=True))
        return grad_x.to(y.dtype), None
