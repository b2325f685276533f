"""The LoRA family: low-rank adapters, their variants, fused kernels and multi-LoRA serving.

>>> y = lora_linear(x, weight, lora_a, lora_b, scaling)     # x W^T + s (x A^T) B^T, one Triton pass
>>> layer = LoRALinear.from_linear(linear, rank=16, alpha=32, variant="dora")
>>> model = add_lora(models.Decoder(cfg), rank=8, alpha=16)   # adapters on every block's linears
>>> bgmv(y, x, lora_a, lora_b, indices, scalings)           # each token its own adapter, in place
>>> sgmv(y, x, lora_a, lora_b, seg_starts, seg_adapters, scalings)   # runs of tokens per adapter

Shapes follow ``nn.Linear`` and peft: ``weight`` ``[N, K]``, ``lora_a`` ``[r, K]``,
``lora_b`` ``[N, r]``; stacked adapters for serving are ``[L, r, K]`` and ``[L, N, r]``.
The layout is the book's: Triton kernels in :mod:`labkit.lora.kernels`, the autograd
wrapper in :mod:`labkit.lora.autograd`, the plain-torch definitions in
:mod:`labkit.lora.reference`, the modules in :mod:`labkit.lora.layers`, measurements in
:mod:`labkit.lora.bench`; this module checks its inputs and calls them.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_tensor, dtype_name
from . import kernels
from .autograd import LoRALinearFunction
from .layers import VARIANTS, LoRALinear, add_lora, lora_layers, merge_all, trainable_parameters, unmerge_all
from .reference import lora_scaling

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

__all__ = [
    "DTYPES", "VARIANTS", "LoRALinear", "add_lora", "bgmv", "lora_layers", "lora_linear", "lora_scaling",
    "merge_all", "sgmv", "trainable_parameters", "unmerge_all",
]


def _check(t: object, name: str, ndim: int, contiguous: bool = True) -> torch.Tensor:
    return check_tensor(t, name, ndim=ndim, dtypes=DTYPES, device=backend.device(), contiguous=contiguous)


def _check_dtypes(**tensors: torch.Tensor) -> None:
    if len({t.dtype for t in tensors.values()}) > 1:
        listed = ", ".join(f"{n} {dtype_name(t.dtype)}" for n, t in tensors.items())
        raise TypeError(f"tensors must share one dtype, got {listed}")


def _check_scaling(scaling: object) -> float:
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a number (alpha / r), got {type(scaling).__name__}")
    return float(scaling)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + scaling * (x A^T) B^T (+ bias)``, forward and backward through the fused kernel.

    ``x`` ``[..., K]`` contiguous; ``weight`` ``[N, K]``, ``lora_a`` ``[r, K]``, ``lora_b``
    ``[N, r]``, ``bias`` ``[N]`` or ``None``; all one dtype (fp32, fp16, bf16) on
    :func:`labkit.device`. fp32 runs the matmuls in full fp32 (no TF32).
    """
    check_tensor(x, "x", dtypes=DTYPES, device=backend.device(), contiguous=True)
    _check(weight, "weight", 2, contiguous=False)
    _check(lora_a, "lora_a", 2, contiguous=False)
    _check(lora_b, "lora_b", 2, contiguous=False)
    n, k = weight.shape
    rank = lora_a.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but weight [N, K] = {tuple(weight.shape)} expects K = {k}")
    if lora_a.shape[1] != k:
        raise ValueError(f"lora_a must be [r, K = {k}], got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (n, rank):
        raise ValueError(f"lora_b must be [N = {n}, r = {rank}] to match weight and lora_a, got {tuple(lora_b.shape)}")
    tensors = dict(x=x, weight=weight, lora_a=lora_a, lora_b=lora_b)
    if bias is not None:
        _check(bias, "bias", 1)
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [N = {n}], got {tuple(bias.shape)}")
        tensors["bias"] = bias
    _check_dtypes(**tensors)
    return LoRALinearFunction.apply(x, weight, lora_a, lora_b, _check_scaling(scaling), bias)


def _check_stack(y, x, lora_a, lora_b, scalings) -> None:
    _check(y, "y", 2)
    _check(x, "x", 2)
    _check(lora_a, "lora_a", 3)
    _check(lora_b, "lora_b", 3)
    tokens, k = x.shape
    adapters, rank = lora_a.shape[:2]
    n = y.shape[1]
    if y.shape[0] != tokens:
        raise ValueError(f"y must have a row per token of x ({tokens}), got {tuple(y.shape)}")
    if lora_a.shape[2] != k:
        raise ValueError(f"lora_a must be [adapters, r, K = {k}], got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (adapters, n, rank):
        raise ValueError(f"lora_b must be [adapters = {adapters}, N = {n}, r = {rank}], got {tuple(lora_b.shape)}")
    _check_dtypes(y=y, x=x, lora_a=lora_a, lora_b=lora_b)
    check_tensor(scalings, "scalings", ndim=1, dtypes=(torch.float32,), device=backend.device(), contiguous=True)
    if scalings.shape[0] != adapters:
        raise ValueError(f"scalings must hold one float32 per adapter ({adapters}), got {tuple(scalings.shape)}")


def _check_indices(t: object, name: str, length: int, adapters: int) -> torch.Tensor:
    check_tensor(t, name, ndim=1, dtypes=INDEX_DTYPES, device=backend.device(), contiguous=True)
    if t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {t.shape[0]}")
    if int(t.max()) >= adapters:
        raise ValueError(f"{name} must be adapter numbers below {adapters} (or -1 for none), got {int(t.max())}")
    if int(t.min()) < -1:
        raise ValueError(f"{name} must be >= -1 (-1: no adapter), got {int(t.min())}")
    return t


def bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         indices: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """Punica's BGMV: ``y[t] += scalings[i] * B[i] @ A[i] @ x[t]`` with ``i = indices[t]``, in place.

    ``x`` ``[T, K]``, ``y`` ``[T, N]`` (the base layer's output), ``lora_a`` ``[L, r, K]``,
    ``lora_b`` ``[L, N, r]``, ``indices`` ``[T]`` int (``-1``: the base model alone),
    ``scalings`` ``[L]`` float32. Returns ``y``. Checking the indices reads them on the host.
    """
    _check_stack(y, x, lora_a, lora_b, scalings)
    _check_indices(indices, "indices", x.shape[0], lora_a.shape[0])
    return kernels.bgmv(y, x, lora_a, lora_b, indices, scalings)


def sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         seg_starts: torch.Tensor, seg_adapters: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """Punica's SGMV: segment ``g`` (rows ``seg_starts[g]:seg_starts[g+1]``) adds its adapter's
    ``scalings[a] * x A[a]^T B[a]^T`` to ``y``, in place; ``a = seg_adapters[g]`` (``-1``: none).

    Shapes as in :func:`bgmv`; ``seg_starts`` ``[G + 1]`` ascending from 0 to ``T``. Returns ``y``.
    """
    _check_stack(y, x, lora_a, lora_b, scalings)
    segments = check_tensor(seg_adapters, "seg_adapters", ndim=1, dtypes=INDEX_DTYPES, device=backend.device()).shape[0]
    _check_indices(seg_adapters, "seg_adapters", segments, lora_a.shape[0])
    check_tensor(seg_starts, "seg_starts", ndim=1, dtypes=INDEX_DTYPES, device=backend.device(), contiguous=True)
    if seg_starts.shape[0] != segments + 1:
        raise ValueError(f"seg_starts must have one more entry than seg_adapters ({segments + 1}), "
                         f"got {seg_starts.shape[0]}")
    starts = seg_starts.tolist()
    if starts[0] != 0 or starts[-1] != x.shape[0] or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"seg_starts must rise from 0 to T = {x.shape[0]}, got {starts}")
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    if longest == 0:
        return y
    return kernels.sgmv(y, x, lora_a, lora_b, seg_starts, seg_adapters, scalings, longest)
