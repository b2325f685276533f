"""A Megatron-style SFT loop on the book's model: microbatches, accumulation, schedules, checkpoints.

Megatron's ``pretrain()`` calls ``train_step`` once per global batch; the step hands
``num_microbatches`` microbatches to the forward/backward schedule, which runs forward
and backward on each, adding into the same gradients, and only then does the optimizer
step once. :class:`SFTTrainer` is that step on one device, built from the pieces the book's
plain loop uses (:func:`labkit.models.adamw`, :func:`labkit.models.warmup_cosine`,
:func:`labkit.models.masked_cross_entropy_sum`):

- the loss is *per token of the global batch*: each microbatch contributes its sum of
  target cross-entropies divided by the target count of all microbatches together, so
  accumulating ``k`` microbatches gives the gradient of the one big batch (a mean per
  microbatch would over-weight microbatches with few targets);
- the schedule is warmup + cosine or WSD (warmup, stable, decay);
- :meth:`SFTTrainer.state_dict` holds everything a resumed run needs (weights, AdamW's
  moments, the scheduler, the step), and data are a pure function of the step, as
  Megatron's samplers are of ``consumed_samples``: a run saved at step ``s`` and resumed
  reproduces the uninterrupted one bit for bit on the CPU.

The extension points are Megatron's: what a step's data are (``next_microbatches(step)``),
the loss of one microbatch (``loss_fn``), and the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..models import adamw, masked_cross_entropy_sum, warmup_cosine
from ..validate import check_choice, check_positive_int
from .attention import PackedAttention
from .data import PackedBatch

SCHEDULES = ("cosine", "wsd")


def packed_loss_sum(model: nn.Module, batch: PackedBatch, attention: str = "sdpa") -> torch.Tensor:
    """Sum of target cross-entropies of a packed batch, run as one flat row of documents.

    Row boundaries are document boundaries too (every row starts at position 0), so the
    rows flatten into one sequence; the prediction of flat token ``t + 1`` from ``t`` is a
    target only where ``loss_mask`` says so, and it never does at a document's first token.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    device = model.embed.weight.device
    ids = batch.ids.reshape(1, -1).to(device)
    positions = batch.position_ids.reshape(-1).to(device)
    logits = model(ids, PackedAttention(positions, attention), positions=positions)
    return masked_cross_entropy_sum(logits[0, :-1], ids[0, 1:], batch.loss_mask.reshape(-1)[1:].to(device))


def wsd(step: int, *, steps: int, warmup: int, decay_fraction: float = 0.2, floor: float = 0.0) -> float:
    """Warmup-stable-decay: linear warmup, a flat peak, then a linear decay over the last
    ``decay_fraction`` of the steps (MiniCPM's schedule; a checkpoint from the flat part can
    be decayed later, or training continued from it)."""
    decay_start = steps - int(round(decay_fraction * steps))
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    done = min(1.0, (step - decay_start + 1) / max(1, steps - decay_start))
    return 1.0 - (1.0 - floor) * done


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    warmup: int = 10
    schedule: str = "cosine"
    weight_decay: float = 0.0
    clip: float = 1.0

    def __post_init__(self) -> None:
        check_positive_int(self.steps, "steps")
        check_choice(self.schedule, "schedule", SCHEDULES)
        if self.warmup < 1 or isinstance(self.warmup, bool) or not isinstance(self.warmup, int):
            raise ValueError(f"warmup must be a positive int, got {self.warmup!r}")
        for name in ("lr", "clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    def multiplier(self, step: int) -> float:
        """The learning rate at ``step`` as a fraction of the peak."""
        fn = warmup_cosine if self.schedule == "cosine" else wsd
        return fn(step, steps=self.steps, warmup=self.warmup)


LossFn = Callable[[nn.Module, PackedBatch], torch.Tensor]


class SFTTrainer:
    """One optimizer step per global batch of microbatches (see the module docstring)."""

    def __init__(self, model: nn.Module, config: TrainConfig, loss_fn: LossFn = packed_loss_sum) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        self.model, self.config, self.loss_fn = model, config, loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = adamw(self.params, config.lr, config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.multiplier)
        self.step = 0

    def forward_backward(self, microbatches: list[PackedBatch]) -> float:
        """Gradients of the global batch's per-token loss, one microbatch at a time (what
        Megatron's ``forward_backward_func`` does without pipeline stages); its loss."""
        if not microbatches:
            raise ValueError("a step needs at least one microbatch")
        targets = sum(mb.num_targets for mb in microbatches)
        if targets == 0:
            raise ValueError("the microbatches hold no target token")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in microbatches:
            loss = self.loss_fn(self.model, mb) / targets
            loss.backward()  # gradients add up across microbatches: accumulation
            total += loss.item()
        return total

    def train_step(self, microbatches: list[PackedBatch]) -> float:
        """Forward and backward on every microbatch, one optimizer step; the global batch's loss."""
        total = self.forward_backward(microbatches)
        torch.nn.utils.clip_grad_norm_(self.params, self.config.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return total

    def fit(self, next_microbatches: Callable[[int], list[PackedBatch]], until: int | None = None) -> list[float]:
        """Steps from the current one up to ``until`` (default: the config's ``steps``); their losses."""
        until = self.config.steps if until is None else until
        losses = [self.train_step(next_microbatches(step)) for step in range(self.step, until)]
        self.model.eval()
        return losses

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step, "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != asdict(self.config):
            raise ValueError(f"checkpoint was made with {state.get('config')}, this trainer has {asdict(self.config)}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

    def save(self, path) -> None:
        torch.save(self.state_dict(), path)

    def load(self, path) -> None:
        self.load_state_dict(torch.load(path, weights_only=True))


def tokens_per_second(tokens: int, seconds: float) -> float:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds must be positive and finite, got {seconds}")
    return tokens / seconds
