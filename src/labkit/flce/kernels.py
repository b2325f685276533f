"""The Triton kernel of the fused linear cross-entropy: one chunk's loss and logit gradient.

:func:`cross_entropy_grad_kernel` takes a chunk of raw logits ``[rows, V]`` (what cuBLAS
just wrote) and, one program per row, makes two passes over the row:

1. an online logsumexp (running maximum, running sum of exponentials rescaled when the
   maximum grows; the softmax chapter's trick), the label's logit, and the row's sum for
   label smoothing; from these the row's loss;
2. the gradient of the (scaled) loss with respect to each raw logit, written **over the
   logits in place**: ``softmax - one_hot`` plus what each option adds (see
   :func:`labkit.flce.reference.cross_entropy_rows`, its oracle).

Writing in place is what keeps the memory down: the chunk's logits buffer becomes its
gradient buffer, which the next two matmuls read. Arithmetic is fp32 (fp64 for fp64
logits); the gradient is rounded once, to the logits' dtype, on the store.

No autotuning: the kernel overwrites its input, so trying several configurations on the
same data would need a copy of the chunk each time (Triton's ``restore_value``), and the
kernel is a small share of the time beside the three matmuls around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend
from .reference import LossOptions

# Columns one program handles per step, and its warps: 8192 values over 16 warps is 16 a
# thread (Liger's cross-entropy uses 32768 over 32). Smaller under the interpreter, which
# pays per element.
GPU_BLOCK, GPU_WARPS = 8192, 16
CPU_BLOCK = 1024


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(x / softcap)``, with tanh written through exp (1 - 2/(e^2u + 1))
    because the interpreter and every backend have exp; it saturates cleanly to +-1."""
    if HAS_SOFTCAP:
        x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
    return x


@triton.jit
def cross_entropy_grad_kernel(
    logits_ptr, stride_row, target_ptr, loss_ptr, params_ptr, n_vocab, ignore_index,
    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    label = tl.load(target_ptr + row)
    acc_dtype = loss_ptr.dtype.element_ty  # fp32, or fp64 for fp64 logits
    # The options come from memory in acc_dtype (see kernel_params), not as Python floats,
    # which Triton passes as fp32: 0.1 in fp32 would put fp64 results off by 1e-9.
    scale = tl.load(params_ptr)
    label_smoothing = tl.load(params_ptr + 1)
    z_loss = tl.load(params_ptr + 2)
    softcap = tl.load(params_ptr + 3)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(row_ptr + cols, tl.zeros((BLOCK,), logits_ptr.dtype.element_ty), mask=cols < n_vocab)
        return

    # Pass 1: online logsumexp of the capped logits, and their sum (for label smoothing).
    running_max = tl.full((), -float("inf"), acc_dtype)
    running_sum = tl.full((), 0.0, acc_dtype)
    logit_sum = tl.full((), 0.0, acc_dtype)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < n_vocab
        z = _capped(tl.load(row_ptr + cols, mask=in_row, other=0.0).to(acc_dtype), softcap, HAS_SOFTCAP)
        z = tl.where(in_row, z, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
        logit_sum += tl.sum(tl.where(in_row, z, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    z_label = _capped(tl.load(row_ptr + label).to(acc_dtype), softcap, HAS_SOFTCAP)
    loss = lse - (1.0 - label_smoothing) * z_label - label_smoothing * logit_sum / n_vocab + z_loss * lse * lse
    tl.store(loss_ptr + row, loss)

    # Pass 2: dloss/dz = p (1 + 2 lam lse) - eps/V - (1 - eps)[j = label], times the cap's
    # derivative, times the reduction's scale; stored over the logits.
    if WRITE_GRAD:
        for start in range(0, n_vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_vocab
            z = _capped(tl.load(row_ptr + cols, mask=in_row, other=0.0).to(acc_dtype), softcap, HAS_SOFTCAP)
            grad = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / n_vocab
            grad = tl.where(cols == label, grad - (1.0 - label_smoothing), grad)
            if HAS_SOFTCAP:
                grad = grad * (1.0 - (z / softcap) * (z / softcap))
            tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=in_row)


def kernel_params(opts: LossOptions, scale: torch.Tensor) -> torch.Tensor:
    """``[scale, label_smoothing, z_loss, softcap]`` in ``scale``'s dtype and device: what
    the kernel reads for its options (``scale`` from :func:`labkit.flce.reference.loss_scale`)."""
    options = torch.tensor([opts.label_smoothing, opts.z_loss, opts.softcap or 1.0], dtype=scale.dtype)
    return torch.cat([scale, options.to(scale.device)])


def cross_entropy_grad_(logits: torch.Tensor, target: torch.Tensor, loss_rows: torch.Tensor,
                        params: torch.Tensor, opts: LossOptions, *, write_grad: bool = True,
                        block: int | None = None) -> None:
    """Write each row's loss into ``loss_rows`` and (with ``write_grad``) overwrite
    ``logits`` ``[rows, V]`` (unit stride along V) with the gradient of the scaled loss.

    ``loss_rows``: ``[rows]`` fp32 (fp64 for fp64 logits); ``params``: :func:`kernel_params`
    in ``loss_rows``'s dtype. Inputs are checked by :mod:`labkit.flce`.
    """
    n_rows, n_vocab = logits.shape
    block = block or min(backend.pick(cpu=CPU_BLOCK, gpu=GPU_BLOCK), triton.next_power_of_2(n_vocab))
    cross_entropy_grad_kernel[(n_rows,)](
        logits, logits.stride(0), target, loss_rows, params, n_vocab, opts.ignore_index,
        HAS_SOFTCAP=opts.softcap is not None, WRITE_GRAD=write_grad, BLOCK=block,
        num_warps=backend.pick(cpu=4, gpu=GPU_WARPS),
    )
