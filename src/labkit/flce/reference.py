"""The LM head and its cross-entropy in plain torch: the oracle, and the formulas.

:func:`linear_cross_entropy_reference` is what a model does without a fused loss (Hugging
Face's ``ForCausalLMLoss``): the whole ``[tokens, vocab]`` logits tensor, upcast to fp32,
into ``F.cross_entropy``. On float64 inputs it is the exact answer every other version is
checked against; on bf16 inputs it is the "eager" contender of the benchmarks.

:func:`cross_entropy_rows` is the same loss written out per row, with its gradient in
closed form (softmax minus the one-hot target, and what each option adds). It is the
oracle of the Triton kernel, which computes exactly these two things for a chunk of rows,
and the inner step of the torch chunked versions in :mod:`labkit.flce.chunked`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class LossOptions:
    """The options of a language model's cross-entropy, as Liger-Kernel names them.

    - ``ignore_index``: tokens with this target (padding, prompt tokens) add nothing to the
      loss, to its count, or to the gradients.
    - ``label_smoothing`` ``eps``: the target distribution is ``(1-eps)`` on the label plus
      ``eps/V`` everywhere (``F.cross_entropy``'s definition).
    - ``z_loss`` ``lam``: adds ``lam * logsumexp(z)**2`` per token (PaLM's auxiliary loss,
      which keeps the softmax normaliser near 1; Liger's ``lse_square_scale``).
    - ``softcap`` ``c``: logits pass through ``c * tanh(z / c)`` first (Gemma 2's final
      logit soft-capping); ``None`` for none.
    - ``reduction``: ``"mean"`` over the tokens not ignored, or ``"sum"``.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    reduction: str = "mean"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the softmax is computed: fp32 for 16-bit logits, else the logits' own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor,
                            opts: LossOptions = LossOptions()) -> torch.Tensor:
    """The loss of ``logits`` ``[N, V]`` by ``F.cross_entropy`` (plus the z-loss term)."""
    z = soft_cap(logits.to(compute_dtype(logits.dtype)), opts.softcap)
    loss = F.cross_entropy(z, target, ignore_index=opts.ignore_index,
                           label_smoothing=opts.label_smoothing, reduction=opts.reduction)
    if opts.z_loss:
        valid = target != opts.ignore_index
        z_term = (torch.logsumexp(z, dim=-1).square() * valid).sum()
        loss = loss + opts.z_loss * (z_term / valid.sum() if opts.reduction == "mean" else z_term)
    return loss


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   opts: LossOptions = LossOptions()) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, target)``, materialising every logit.

    ``hidden`` ``[N, H]``, ``weight`` ``[V, H]`` (the LM head, as ``nn.Linear`` stores it),
    ``target`` ``[N]``. The matmul runs in the inputs' dtype and the loss in fp32, as in
    Hugging Face's models; autograd keeps the fp32 log-probabilities for the backward.
    """
    return cross_entropy_reference(hidden @ weight.T, target, opts)


def loss_scale(target: torch.Tensor, opts: LossOptions, dtype: torch.dtype) -> torch.Tensor:
    """What each token's loss (and gradient) is multiplied by: 1/(tokens not ignored) for
    ``"mean"``, 1 for ``"sum"``; a one-element tensor of ``dtype`` on the target's device,
    so nothing waits for the GPU to count."""
    if opts.reduction == "sum":
        return torch.ones(1, dtype=dtype, device=target.device)
    return 1.0 / (target != opts.ignore_index).sum(dtype=dtype).reshape(1)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                       scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each row, d(scaled total loss)/d(logits)) for raw logits ``[N, V]``.

    With ``z = cap(logits)``, ``p = softmax(z)``, ``lse = logsumexp(z)``, label ``y``:

    - loss: ``lse - (1-eps) z_y - eps mean(z) + lam lse**2``;
    - dloss/dz_j: ``p_j (1 + 2 lam lse) - eps/V - (1-eps) [j = y]``;
    - through the cap: times ``1 - (z_j/c)**2`` (the derivative of ``c tanh(s/c)``).

    Ignored rows have loss 0 and gradient 0; the gradient is multiplied by ``scale``
    (:func:`loss_scale`). Computed in :func:`compute_dtype`; the gradient comes back in
    the logits' dtype, the losses in the compute dtype (unscaled).
    """
    n_vocab = logits.shape[-1]
    eps, lam = opts.label_smoothing, opts.z_loss
    z = soft_cap(logits.to(compute_dtype(logits.dtype)), opts.softcap)
    valid = target != opts.ignore_index
    label = target.where(valid, 0)
    lse = torch.logsumexp(z, dim=-1)
    z_label = z.gather(-1, label[:, None])[:, 0]
    loss = lse - (1 - eps) * z_label - eps * z.mean(-1) + lam * lse.square()
    grad = torch.exp(z - lse[:, None]) * (1 + 2 * lam * lse[:, None]) - eps / n_vocab
    grad.scatter_add_(-1, label[:, None], torch.full_like(z_label[:, None], -(1 - eps)))
    if opts.softcap is not None:
        grad *= 1 - (z / opts.softcap).square()
    grad *= valid[:, None] * scale
    return loss * valid, grad.to(logits.dtype)
