"""A plain next-token training loop for the book's small models (one loop, every chapter's).

Chapters that compare variants of the model on a task (positional encodings, MQA/GQA/MLA,
the LoRA family) train each variant with the same loop, so a difference in quality comes
from the variant, not from the loop:

>>> losses = train_lm(model, lambda step: task.batch(32, generator), steps=300, lr=3e-3)
>>> lm_loss(model, ids, loss_mask)           # mean next-token cross-entropy over masked targets

``next_batch(step)`` returns ``ids`` ``[batch, T]`` or ``(ids, loss_mask)``; the mask
(``[batch, T]``, bool) marks the positions whose *token* is a target, so a task scores only
its answer tokens. AdamW with linear warmup and cosine decay, gradient clipping at 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _split(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids, mask = batch if isinstance(batch, tuple) else (batch, None)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.ndim != 2:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"a batch must be int ids [batch, T] (optionally with a loss mask), got {got}")
    if ids.shape[1] < 2:
        raise ValueError(f"next-token training needs T >= 2, got ids of shape {tuple(ids.shape)}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape or mask.dtype != torch.bool):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"loss_mask must be a bool tensor shaped like ids {tuple(ids.shape)}, got {got}")
    return ids, mask


def masked_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of ``targets`` under ``logits`` where ``mask`` is true (fp32).

    A sum, not a mean: a loop that splits a batch into microbatches divides by the target
    count of the whole batch, so that the accumulated gradient is the big batch's.
    """
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1).float()).sum()


def lm_loss(model: nn.Module, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from the prefix; with ``loss_mask``,
    only over target positions where the mask is true."""
    ids, loss_mask = _split((ids, loss_mask) if loss_mask is not None else ids)
    targets = loss_mask[:, 1:] if loss_mask is not None else torch.ones_like(ids[:, 1:], dtype=torch.bool)
    if not targets.any():
        raise ValueError("loss_mask selects no target position")
    return masked_cross_entropy_sum(model(ids[:, :-1]), ids[:, 1:], targets) / targets.sum()


def adamw(params: list[nn.Parameter], lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The book's optimizer: AdamW with betas (0.9, 0.95), as Megatron and most LLM recipes use."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def warmup_cosine(step: int, *, steps: int, warmup: int, floor: float = 0.1) -> float:
    """The learning-rate multiplier at ``step``: linear warmup, then cosine down to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))


def train_lm(model: nn.Module, next_batch: Callable[[int], Batch], *, steps: int, lr: float,
             warmup: int | None = None, weight_decay: float = 0.0, progress: bool = True,
             desc: str = "train", loss_fn: Callable[..., torch.Tensor] = lm_loss) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps on ``next_batch(step)``; the loss of every step.

    ``loss_fn(model, ids, loss_mask)`` is the objective, :func:`lm_loss` by default (a
    distillation loss replaces it: :func:`labkit.spec.distillation_loss`)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, ids, loss_mask), got {type(loss_fn).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    warmup = max(1, steps // 10) if warmup is None else warmup
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    opt = adamw(params, lr, weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, steps=steps, warmup=warmup))
    model.train()
    losses = []
    for step in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        loss = loss_fn(model, *_split(next_batch(step)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses
