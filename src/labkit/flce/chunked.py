"""The two ways around the logits wall, in plain torch (the chapter's middle stages).

- :func:`token_chunked_linear_cross_entropy` (Liger-Kernel's way): split the *tokens* into
  chunks; each chunk's logits are complete rows, so its softmax, loss and gradients are
  final at once, and the gradients for ``hidden`` and ``weight`` are computed in the
  forward. Memory: one chunk of logits, ``chunk x V``.
- :func:`vocab_chunked_linear_cross_entropy` (Cut Cross-Entropy's way): split the
  *vocabulary*; no chunk sees a whole row, so the forward keeps a running logsumexp per
  token (the online softmax), saves only that (``N`` numbers), and the backward recomputes
  each vocabulary chunk's logits to form its gradient. Memory: ``N x chunk``; cost: the
  logits matmul twice.

Both call the row formulas of :mod:`labkit.flce.reference` and are checked against the
float64 oracle; the Triton version (:mod:`labkit.flce.autograd`) is the first with the
row formulas in a kernel that works in place.
"""

from __future__ import annotations

import torch

from .autograd import Gradients, LossWithGradientsFromForward
from .reference import LossOptions, compute_dtype, cross_entropy_rows, loss_scale, soft_cap


def token_chunked_loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 opts: LossOptions, chunk_tokens: int, *, grad_hidden: bool = True,
                                 grad_weight: bool = True) -> Gradients:
    """(loss, dloss/dhidden, dloss/dweight), ``chunk_tokens`` rows of logits at a time."""
    scale = loss_scale(target, opts, compute_dtype(hidden.dtype))
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = torch.zeros_like(weight) if grad_weight else None
    total = torch.zeros((), dtype=compute_dtype(hidden.dtype), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        x = hidden[start:start + chunk_tokens]
        loss_rows, d_logits = cross_entropy_rows(x @ weight.T, target[start:start + chunk_tokens], opts, scale)
        total += loss_rows.sum()
        if d_hidden is not None:
            d_hidden[start:start + chunk_tokens] = d_logits @ weight
        if d_weight is not None:
            d_weight += d_logits.T @ x
    return total * scale[0], d_hidden, d_weight


def token_chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                       opts: LossOptions = LossOptions(), chunk_tokens: int = 1024) -> torch.Tensor:
    """The loss, differentiable in ``hidden`` and ``weight``; gradients made in the forward."""
    def loss_and_grads(h, w, **needs):
        return token_chunked_loss_and_grads(h, w, target, opts, chunk_tokens, **needs)
    return LossWithGradientsFromForward.apply(hidden, weight, loss_and_grads)


def _vocab_chunk_logits(hidden, weight, start, stop, opts):
    return soft_cap((hidden @ weight[start:stop].T).to(compute_dtype(hidden.dtype)), opts.softcap)


def _label_in_chunk(target, valid, start, stop):
    """Rows whose label lies in vocabulary columns [start, stop), and its column there."""
    hit = valid & (target >= start) & (target < stop)
    return hit, (target - start).clamp(0, stop - start - 1)


class VocabChunkedCrossEntropy(torch.autograd.Function):
    """Cut Cross-Entropy's schedule in torch: online logsumexp forward, recomputing backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, opts: LossOptions, chunk_vocab: int):
        n_tokens, n_vocab = hidden.shape[0], weight.shape[0]
        acc = compute_dtype(hidden.dtype)
        valid = target != opts.ignore_index
        running_max = torch.full((n_tokens,), -torch.inf, dtype=acc, device=hidden.device)
        running_sum = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
        logit_sum = torch.zeros_like(running_sum)
        z_label = torch.zeros_like(running_sum)
        for start in range(0, n_vocab, chunk_vocab):
            stop = min(start + chunk_vocab, n_vocab)
            z = _vocab_chunk_logits(hidden, weight, start, stop, opts)
            new_max = torch.maximum(running_max, z.amax(-1))
            running_sum = running_sum * torch.exp(running_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
            running_max = new_max
            logit_sum += z.sum(-1)
            hit, col = _label_in_chunk(target, valid, start, stop)
            z_label += torch.where(hit, z.gather(-1, col[:, None])[:, 0], 0.0)
        lse = running_max + torch.log(running_sum)
        eps, lam = opts.label_smoothing, opts.z_loss
        loss_rows = (lse - (1 - eps) * z_label - eps * logit_sum / n_vocab + lam * lse.square()) * valid
        scale = loss_scale(target, opts, acc)
        ctx.save_for_backward(hidden, weight, target, lse, scale)
        ctx.opts, ctx.chunk_vocab = opts, chunk_vocab
        return loss_rows.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, lse, scale = ctx.saved_tensors
        opts, n_vocab = ctx.opts, weight.shape[0]
        eps, lam = opts.label_smoothing, opts.z_loss
        valid = target != opts.ignore_index
        row_factor = (valid * scale * grad_loss.to(scale.dtype))[:, None]
        d_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
        d_weight = torch.empty_like(weight)
        for start in range(0, n_vocab, ctx.chunk_vocab):
            stop = min(start + ctx.chunk_vocab, n_vocab)
            z = _vocab_chunk_logits(hidden, weight, start, stop, opts)  # the recomputation
            grad = torch.exp(z - lse[:, None]) * (1 + 2 * lam * lse[:, None]) - eps / n_vocab
            hit, col = _label_in_chunk(target, valid, start, stop)
            grad.scatter_add_(-1, col[:, None], -(1 - eps) * hit[:, None].to(grad.dtype))
            if opts.softcap is not None:
                grad *= 1 - (z / opts.softcap).square()
            grad = (grad * row_factor).to(hidden.dtype)
            d_hidden += (grad @ weight[start:stop]).to(d_hidden.dtype)
            d_weight[start:stop] = grad.T @ hidden
        return d_hidden.to(hidden.dtype), d_weight, None, None, None


def vocab_chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                       opts: LossOptions = LossOptions(), chunk_vocab: int = 8192) -> torch.Tensor:
    """The loss, differentiable in ``hidden`` and ``weight``, ``chunk_vocab`` columns at a time."""
    return VocabChunkedCrossEntropy.apply(hidden, weight, target, opts, chunk_vocab)
