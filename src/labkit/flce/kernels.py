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

On the GPU the launch is autotuned over a few (columns per step, warps, loop stages)
configurations, once per vocabulary size, on the first call. The kernel overwrites its
input, so the tuner restores the chunk after every trial (Triton's ``restore_value``): that
first call holds one extra copy of the chunk's logits. Why the choice matters: a program
reads its row twice, and when few enough rows are in flight at once (one program of 32 warps per SM:
132 rows of 256 KB at V = 128256 in bf16, 34 MB) the second read can come from the L2 (60 MiB,
63 MB, on the H200) instead of HBM; more programs per SM hide latency better but evict the rows sooner.
Some configurations also tell the L2 which lines to keep (``L2_HINTS``): the first pass's
loads ask to be evicted last, the second pass's loads and the gradient's stores first, so
that the lines written and the lines already read twice leave before the rows still waiting
for their second read. The benchmark ``flce.kernel`` times every configuration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend
from .reference import LossOptions

# (columns one program handles per step, warps, loop stages, L2 hints) tried on the GPU: 8 to
# 32 values a thread, from 4 to 1 program per SM. Liger's cross-entropy uses 32768 over 32
# warps. Each pass over the row runs plainly (1 stage: a block's loads are waited for in its
# own step) or software-pipelined (tl.range's num_stages: the next blocks' loads are
# asynchronous copies into shared memory, issued while this block is reduced); the pipelined
# ones are those whose sm_90 code (Triton 3.6) keeps every value in registers, without
# spills. The hinted ones are the plain ones with one or two programs per SM, the fewest rows
# in flight: where the second read has a chance in the L2 at all.
# Under the interpreter, which pays per element, one small configuration.
GPU_CONFIGS = ((4096, 8, 1, False), (8192, 16, 1, False), (8192, 32, 1, False), (16384, 32, 1, False),
               (32768, 32, 1, False),
               (4096, 8, 3, False), (8192, 16, 3, False), (8192, 32, 3, False), (16384, 32, 3, False),
               (8192, 16, 1, True), (8192, 32, 1, True), (16384, 32, 1, True), (32768, 32, 1, True))
CPU_BLOCK, CPU_WARPS = 1024, 4


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
    LOOP_STAGES: tl.constexpr = 1,  # software-pipeline each pass over the row this deep (tl.range's num_stages)
    L2_HINTS: tl.constexpr = False,  # keep the row in the L2 for its second read (evict the rest first)
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
    # A kernel's num_stages pipelines only loads that feed a tl.dot; a pass asks for its own
    # loads to be issued LOOP_STAGES - 1 blocks ahead, as asynchronous copies into shared memory.
    FIRST_READ: tl.constexpr = "evict_last" if L2_HINTS else ""
    DONE_WITH: tl.constexpr = "evict_first" if L2_HINTS else ""
    for start in tl.range(0, n_vocab, BLOCK, num_stages=LOOP_STAGES):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < n_vocab
        z = _capped(tl.load(row_ptr + cols, mask=in_row, other=0.0, eviction_policy=FIRST_READ).to(acc_dtype),
                    softcap, HAS_SOFTCAP)
        z = tl.where(in_row, z, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
        logit_sum += tl.sum(tl.where(in_row, z, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    # A label outside [0, V) is reported by labkit.flce after the launch (without waiting for
    # the GPU); the mask keeps the kernel from reading outside its row meanwhile.
    label_ok = (label >= 0) & (label < n_vocab)
    z_label = _capped(tl.load(row_ptr + label, mask=label_ok, other=0.0).to(acc_dtype), softcap, HAS_SOFTCAP)
    loss = lse - (1.0 - label_smoothing) * z_label - label_smoothing * logit_sum / n_vocab + z_loss * lse * lse
    tl.store(loss_ptr + row, loss)

    # Pass 2: dloss/dz = p (1 + 2 lam lse) - eps/V - (1 - eps)[j = label], times the cap's
    # derivative, times the reduction's scale; stored over the logits.
    if WRITE_GRAD:
        for start in tl.range(0, n_vocab, BLOCK, num_stages=LOOP_STAGES):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_vocab
            z = _capped(tl.load(row_ptr + cols, mask=in_row, other=0.0, eviction_policy=DONE_WITH).to(acc_dtype),
                        softcap, HAS_SOFTCAP)
            grad = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / n_vocab
            grad = tl.where(cols == label, grad - (1.0 - label_smoothing), grad)
            if HAS_SOFTCAP:
                grad = grad * (1.0 - (z / softcap) * (z / softcap))
            tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=in_row,
                     eviction_policy=DONE_WITH)


def _configs() -> list[triton.Config]:
    launches = backend.pick(cpu=((CPU_BLOCK, CPU_WARPS, 1, False),), gpu=GPU_CONFIGS)
    return [triton.Config({"BLOCK": block, "LOOP_STAGES": stages, "L2_HINTS": hints}, num_warps=warps)
            for block, warps, stages, hints in launches]


def _prune_wide_blocks(configs, named_args, **kwargs):
    """Drop blocks wider than the row (all but the narrowest such), which only add masked lanes."""
    n_vocab = {**named_args, **kwargs}["n_vocab"]
    fitting = [c for c in configs if c.kwargs["BLOCK"] <= triton.next_power_of_2(n_vocab)]
    return fitting or [min(configs, key=lambda c: c.kwargs["BLOCK"])]


tuned_cross_entropy_grad_kernel = triton.autotune(
    configs=_configs(), key=["n_vocab", "HAS_SOFTCAP", "WRITE_GRAD"], restore_value=["logits_ptr"],
    prune_configs_by={"early_config_prune": _prune_wide_blocks},
)(cross_entropy_grad_kernel)


def kernel_params(opts: LossOptions, scale: torch.Tensor) -> torch.Tensor:
    """``[scale, label_smoothing, z_loss, softcap]`` in ``scale``'s dtype and device: what
    the kernel reads for its options (``scale`` from :func:`labkit.flce.reference.loss_scale`).
    Filled on the device: a copy from pageable host memory could wait for the GPU."""
    params = torch.empty(4, dtype=scale.dtype, device=scale.device)
    params[:1].copy_(scale)
    for i, value in enumerate((opts.label_smoothing, opts.z_loss, opts.softcap or 1.0), start=1):
        params[i].fill_(value)
    return params


@triton.jit
def scale_unless_one_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """``x *= scale`` in place, unless ``scale`` (one element in memory) is exactly 1, when
    every program returns at once. The host never needs to read the scale."""
    scale = tl.load(scale_ptr)  # the loss's dtype: fp32, or fp64 for fp64 inputs
    if scale != 1.0:
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_range = offsets < n
            x = tl.load(x_ptr + offsets, mask=in_range).to(scale.dtype)
            tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=in_range)


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Multiply contiguous ``x`` in place by the one-element tensor ``scale`` unless it is 1:
    the backward of a loss gets exactly 1 when the loss ends the graph, and asking the GPU
    whether it did would make the host wait for the whole forward."""
    block = backend.pick(cpu=1024, gpu=4096)
    # A few programs per SM, each looping over blocks: when the scale is 1 they all return at
    # once, where one program per block would launch hundreds of thousands that do nothing.
    resident = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = min(triton.cdiv(x.numel(), block), resident)
    scale_unless_one_kernel[(programs,)](x, scale, x.numel(), BLOCK=block, num_warps=4)
    return x


def cross_entropy_grad_(logits: torch.Tensor, target: torch.Tensor, loss_rows: torch.Tensor,
                        params: torch.Tensor, opts: LossOptions, *, write_grad: bool = True,
                        block: int | None = None, num_warps: int | None = None, loop_stages: int = 1,
                        l2_hints: bool = False) -> None:
    """Write each row's loss into ``loss_rows`` and (with ``write_grad``) overwrite
    ``logits`` ``[rows, V]`` (unit stride along V) with the gradient of the scaled loss.

    ``loss_rows``: ``[rows]`` fp32 (fp64 for fp64 logits); ``params``: :func:`kernel_params`
    in ``loss_rows``'s dtype. ``block`` (with ``num_warps``, ``loop_stages`` and ``l2_hints``)
    fixes the configuration instead of the tuned one. Inputs are checked by :mod:`labkit.flce`.
    """
    n_rows, n_vocab = logits.shape
    args = (logits, logits.stride(0), target, loss_rows, params, n_vocab, opts.ignore_index)
    flags = dict(HAS_SOFTCAP=opts.softcap is not None, WRITE_GRAD=write_grad)
    if block is None:
        tuned_cross_entropy_grad_kernel[(n_rows,)](*args, **flags)
    else:
        cross_entropy_grad_kernel[(n_rows,)](*args, **flags, BLOCK=block, LOOP_STAGES=loop_stages,
                                             L2_HINTS=l2_hints, num_warps=num_warps or CPU_WARPS)
