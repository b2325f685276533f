"""The fused linear cross-entropy's chunk loop and its autograd wrapper.

The gradient of a scalar loss is known as soon as the loss is: the backward of the last
op of a training step receives ``dloss/dloss = 1`` (or the scale of a loss-scaled or
gradient-accumulated step). So the forward computes ``grad_hidden`` and ``grad_weight``
while the chunk's logits are still in memory, and the backward only multiplies them by
that scalar (Liger-Kernel's design). The alternative, keeping one logsumexp per token and
recomputing the logits in the backward (Cut Cross-Entropy's), costs a fourth matmul as
large as the other three.

Per chunk of ``chunk_tokens`` rows of ``hidden`` (``x``), with one reused logits buffer:

1. ``logits = x @ W.T`` (cuBLAS, into the buffer),
2. the Triton kernel: row losses, and the buffer overwritten by ``dloss/dlogits``,
3. ``grad_hidden[chunk] = dlogits @ W`` (cuBLAS, into the output),
4. ``grad_weight (+)= dlogits.T @ x`` (cuBLAS; the first chunk writes, later ones add).

``grad_weight`` is accumulated in the weight's dtype: an fp32 accumulator for a 128k x 4k
bf16 head would be 2.1 GB of extra memory, more than everything else together. Each
chunk's product is summed in fp32 inside cuBLAS and rounded once per chunk, so a bf16
``grad_weight`` carries a few roundings (one per chunk) instead of one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernels import cross_entropy_grad_, kernel_params, scale_unless_one_
from .reference import LossOptions, compute_dtype, loss_scale

Gradients = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def chunked_loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           opts: LossOptions, chunk_tokens: int, *, grad_hidden: bool = True,
                           grad_weight: bool = True) -> Gradients:
    """(loss, dloss/dhidden or None, dloss/dweight or None), never holding more than
    ``chunk_tokens`` rows of logits. Inputs checked by :func:`labkit.flce.fused_linear_cross_entropy`."""
    n_tokens, n_vocab = hidden.shape[0], weight.shape[0]
    write_grad = grad_hidden or grad_weight
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = torch.empty_like(weight) if grad_weight else None
    logits_buffer = torch.empty(min(chunk_tokens, n_tokens), n_vocab, dtype=hidden.dtype, device=hidden.device)
    loss_rows = torch.empty(n_tokens, dtype=compute_dtype(hidden.dtype), device=hidden.device)
    scale = loss_scale(target, opts, loss_rows.dtype)
    params = kernel_params(opts, scale)
    for start in range(0, n_tokens, chunk_tokens):
        stop = min(start + chunk_tokens, n_tokens)
        x = hidden[start:stop]
        logits = logits_buffer[: stop - start]
        torch.mm(x, weight.T, out=logits)
        cross_entropy_grad_(logits, target[start:stop], loss_rows[start:stop], params, opts,
                            write_grad=write_grad)
        if d_hidden is not None:
            torch.mm(logits, weight, out=d_hidden[start:stop])
        if d_weight is not None:
            if start == 0:
                torch.mm(logits.T, x, out=d_weight)
            else:
                d_weight.addmm_(logits.T, x)
    loss = loss_rows.sum() * scale
    return loss[0], d_hidden, d_weight


class LossWithGradientsFromForward(torch.autograd.Function):
    """A loss whose gradients with respect to ``hidden`` and ``weight`` its forward already
    computed (by ``loss_and_grads(hidden, weight, grad_hidden=..., grad_weight=...)``);
    the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor,
                loss_and_grads: Callable[..., Gradients]) -> torch.Tensor:
        loss, d_hidden, d_weight = loss_and_grads(hidden, weight, grad_hidden=ctx.needs_input_grad[0],
                                                  grad_weight=ctx.needs_input_grad[1])
        ctx.grads = (d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        d_hidden, d_weight = ctx.grads
        del ctx.grads  # a second backward has nothing left to give (like a freed graph)
        # The common case, a loss that ends the graph, gets exactly 1 and then the kernel
        # returns at once; otherwise it scales the gradients in place (they are ours).
        scale = grad_loss.reshape(1)
        for grad in (d_hidden, d_weight):
            if grad is not None:
                scale_unless_one_(grad, scale)
        return d_hidden, d_weight, None
