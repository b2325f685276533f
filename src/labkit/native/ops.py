"""The fused RMSNorm of the Qwen3 chapter as a ``torch.library`` custom op: ``labkit::rms_norm``.

:mod:`labkit.fused` exposes its Triton kernels through a ``torch.autograd.Function``, which
eager PyTorch is happy with and the compiler is not: Dynamo traces into the launcher (on
the CPU machine into Triton's interpreter, which it cannot trace at all). A custom op is
the way in. It gives the operator a name and a schema, so that every layer of PyTorch sees
one opaque node instead of Python code:

- the *kernel* (``register_kernel``, or the function ``custom_op`` decorates) runs on real
  tensors; here it calls the fused kernels' launchers;
- the *fake kernel* (``register_fake``) says what the output looks like (shape, dtype,
  device, strides) without computing it, which is all that tracing, ``torch.compile`` and
  the meta device need;
- the *autograd formula* (``register_autograd``) saves what the backward needs and calls
  another op, ``labkit::rms_norm_backward``, itself a custom op with a fake kernel, so the
  backward graph is traceable too.

``torch.library.opcheck`` tests the four registrations against each other
(:func:`check_ops`).
"""

from __future__ import annotations

import torch

from .. import backend
from ..fused import DTYPES, kernels
from ..validate import check_same_shape, check_tensor

NAMESPACE = "labkit"


def _rstd_dtype(dtype: torch.dtype) -> torch.dtype:
    # the kernels keep the statistic in float32, and in float64 for float64 inputs
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: the normalised rows and each row's ``1 / rms`` (kept for the backward)."""
    y, _, rstd = kernels.rms_norm_forward(x, weight, eps)
    return y, rstd


@rms_norm_forward.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=_rstd_dtype(x.dtype))


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` from the output's gradient and the forward's saved tensors."""
    return kernels.rms_norm_backward(dy.contiguous(), x, weight, rstd)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    # rstd is an output only so the backward can reuse it; no gradient flows back through it
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_forward.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``labkit.fused.rms_norm`` through the custom op: the same kernels, now traceable by
    ``torch.compile(fullgraph=True)``. Arguments as :func:`labkit.fused.rms_norm`."""
    check_tensor(x, "x", dtypes=DTYPES, device=backend.device(), contiguous=True)
    check_tensor(weight, "weight", ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have x's last dimension ({x.shape[-1]}) entries, got {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return rms_norm_forward(x, weight, float(eps))[0]


def check_ops(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> dict[str, str]:
    """Run ``torch.library.opcheck`` on both ops at these inputs; ``{test: "SUCCESS" | error}``.

    opcheck runs the op eagerly, under fake tensors (the fake kernel must agree with the
    real one on shape, dtype and strides), through AOTAutograd with dynamic shapes, and
    checks that the schema's mutation and aliasing annotations are honest."""
    check_same_shape(weight=weight, row=x[(0,) * (x.dim() - 1)])
    x = x.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    report = {f"forward {k}": v for k, v in
              torch.library.opcheck(rms_norm_forward, (x, weight, eps), raise_exception=False).items()}
    y, rstd = rms_norm_forward(x.detach(), weight.detach(), eps)
    dy = torch.randn_like(y)
    report.update({f"backward {k}": v for k, v in
                   torch.library.opcheck(rms_norm_backward, (dy, x.detach(), weight.detach(), rstd),
                                         raise_exception=False).items()})
    return report
