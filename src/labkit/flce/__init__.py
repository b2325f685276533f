"""Fused linear cross-entropy: chapter "Fused linear cross-entropy".

>>> loss = fused_linear_cross_entropy(hidden, lm_head.weight, target)   # [N, H], [V, H], [N]
>>> loss.backward()      # grads of hidden and weight; no [N, V] logits were ever stored

The loss of a language model's head, ``cross_entropy(hidden @ weight.T, target)``, without
the ``[tokens, vocab]`` logits tensor: tokens are processed ``chunk_tokens`` at a time, and
each chunk's gradients are made in the forward. The layout follows Liger-Kernel's: the
Triton kernel in :mod:`labkit.flce.kernels`, the chunk loop and autograd wrapper in
:mod:`labkit.flce.autograd`, the plain-torch oracle in :mod:`labkit.flce.reference`, the
torch versions of the two chunking schemes in :mod:`labkit.flce.chunked`, measurements in
:mod:`labkit.flce.bench`; this module checks its inputs and calls them.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_choice, check_positive_int, check_tensor, dtype_name
from .autograd import LossWithGradientsFromForward, chunked_loss_and_grads
from .reference import REDUCTIONS, LossOptions

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
# Bytes the chunk's logits may take, which sets the default chunk: 2048 tokens of a
# 128256-word vocabulary in bf16 (501 MiB). The chunk sweep recorded in the chapter
# (flce.chunk_sweep) measured time and memory for chunks around this.
CHUNK_LOGITS_BYTES = 512 * 2**20
CHUNK_MULTIPLE = 256  # whole tiles for cuBLAS in the chunk's token dimension

__all__ = ["CHUNK_LOGITS_BYTES", "DTYPES", "LossOptions", "default_chunk_tokens", "fused_linear_cross_entropy"]


def default_chunk_tokens(n_tokens: int, n_vocab: int, dtype: torch.dtype,
                         budget_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """The most tokens whose logits fit ``budget_bytes`` (a multiple of 256, at least 256),
    or all ``n_tokens`` if they fit."""
    row_bytes = n_vocab * torch.empty((), dtype=dtype).element_size()
    fitting = budget_bytes // row_bytes
    if fitting >= n_tokens:
        return n_tokens
    return max(CHUNK_MULTIPLE, fitting // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def _check_number(value: object, name: str, low: float, high: float, *, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    inside = low <= value < high if high_open else low <= value <= high
    if not inside:
        raise ValueError(f"{name} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}")
    return float(value)


def _check_options(ignore_index, label_smoothing, z_loss, softcap, reduction) -> LossOptions:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    smoothing = _check_number(label_smoothing, "label_smoothing", 0.0, 1.0)
    z = _check_number(z_loss, "z_loss", 0.0, float("inf"), high_open=True)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
        softcap = float(softcap)
    check_choice(reduction, "reduction", REDUCTIONS)
    return LossOptions(ignore_index, smoothing, z, softcap, reduction)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
    ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
    softcap: float | None = None, reduction: str = "mean", chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(softcap(hidden @ weight.T), target) + z_loss * mean(lse**2)``, fused.

    ``hidden``: ``[..., H]``, contiguous; ``weight``: ``[V, H]`` (``nn.Linear``'s layout),
    contiguous, same dtype (fp64/fp32/fp16/bf16); ``target``: ``hidden.shape[:-1]``,
    int64 or int32, each in ``[0, V)`` or equal to ``ignore_index``. Options as in
    :class:`labkit.flce.reference.LossOptions`; ``reduction`` is ``"mean"`` (over tokens not
    ignored; NaN when all are, like ``F.cross_entropy``) or ``"sum"``. ``chunk_tokens``
    defaults to :func:`default_chunk_tokens`. Returns a 0-d tensor in fp32 (fp64 for fp64).
    """
    device = backend.device()
    check_tensor(hidden, "hidden", dtypes=DTYPES, device=device, contiguous=True)
    if hidden.ndim < 2:
        raise ValueError(f"hidden must be [..., H] with at least 2 dimensions, got shape {tuple(hidden.shape)}")
    check_tensor(weight, "weight", ndim=2, dtypes=DTYPES, device=device, contiguous=True)
    check_tensor(target, "target", dtypes=TARGET_DTYPES, device=device, contiguous=True)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}] (nn.Linear's layout), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype, got hidden {dtype_name(hidden.dtype)}, "
                        f"weight {dtype_name(weight.dtype)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    opts = _check_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    n_vocab = weight.shape[0]
    hidden2d, target1d = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    chunk = (default_chunk_tokens(hidden2d.shape[0], n_vocab, hidden.dtype) if chunk_tokens is None
             else check_positive_int(chunk_tokens, "chunk_tokens"))
    labels_outside = _LabelCheck(target1d, n_vocab, opts.ignore_index)

    def loss_and_grads(h, w, **needs):
        return chunked_loss_and_grads(h, w, target1d, opts, chunk, **needs)

    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        # hidden2d is a view: autograd carries its gradient back to hidden's shape.
        loss = LossWithGradientsFromForward.apply(hidden2d, weight, loss_and_grads)
    else:
        loss = loss_and_grads(hidden2d, weight, grad_hidden=False, grad_weight=False)[0]
    labels_outside.raise_if_any()
    return loss


class _LabelCheck:
    """Whether any label lies outside ``[0, V)`` (and is not ``ignore_index``), found without
    making the host wait: a one-byte flag is computed on the device and copied to pinned
    host memory behind an event before the loss's work is queued, and read after it is
    (when the flag arrived long ago). The kernel masks its label reads meanwhile, so a bad
    label costs a wasted loss and a clear error, never a read outside the logits."""

    def __init__(self, target: torch.Tensor, n_vocab: int, ignore_index: int):
        self.target, self.n_vocab, self.ignore_index = target, n_vocab, ignore_index
        self.outside = ((target < 0) | (target >= n_vocab)) & (target != ignore_index)
        flag = self.outside.any()
        if flag.is_cuda:
            self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.flag.copy_(flag, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.flag, self.ready = flag, None

    def raise_if_any(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        if bool(self.flag):
            bad = self.target[self.outside][0].item()
            raise ValueError(f"target values must be in [0, {self.n_vocab}) or ignore_index={self.ignore_index}, "
                             f"got {bad}")
