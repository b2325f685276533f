"""The chapter's SFT run: the book's model learns addition chats, packed, in microbatches.

:func:`run` is what the notebook, the test that the run learns, and the ``sft.throughput``
benchmark share: build the model, make each step's microbatches from the step number
(so a resumed run sees the same data), train with :class:`~labkit.sft.SFTTrainer`, and
measure the held-out loss and exact-match accuracy before and after, and the training
tokens per second (real tokens, padding excluded).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..grpo.task import AdditionTask
from ..models import TINY, Decoder, DecoderConfig
from .data import PackedBatch, pack
from .loop import SFTTrainer, TrainConfig, packed_loss_sum
from .task import addition_chats, held_out_accuracy, template_for


@dataclass(frozen=True)
class RunConfig:
    digits: int = 1
    steps: int = 150
    lr: float = 1e-2
    warmup: int = 10
    schedule: str = "cosine"
    chats_per_microbatch: int = 16
    microbatches: int = 2
    seq_len: int = 64
    seed: int = 0


def step_data(task: AdditionTask, cfg: RunConfig, step: int) -> list[PackedBatch]:
    """The microbatches of ``step``: a pure function of (seed, step), like Megatron's
    samplers of ``consumed_samples``, so a resumed run reads what the straight one read."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    pad_id = template_for(task).pad_id
    return [pack(addition_chats(task, cfg.chats_per_microbatch, gen), cfg.seq_len, pad_id)
            for _ in range(cfg.microbatches)]


@torch.no_grad()
def held_out_loss(model: Decoder, task: AdditionTask, cfg: RunConfig, chats: int = 64) -> float:
    """Mean cross-entropy per target token on held-out chats (nats)."""
    batch = pack(addition_chats(task, chats, torch.Generator().manual_seed(7), split="held_out"),
                 cfg.seq_len, template_for(task).pad_id)
    return packed_loss_sum(model, batch).item() / batch.num_targets


def run(cfg: RunConfig = RunConfig(), model_config: DecoderConfig = TINY, device: str = "cpu") -> dict:
    """Train from scratch; losses per step, held-out loss and accuracy before/after, tokens/s."""
    task = AdditionTask(digits=cfg.digits)
    model = Decoder(model_config, seed=cfg.seed, device=device)
    trainer = SFTTrainer(model, TrainConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, schedule=cfg.schedule))
    before = held_out_loss(model, task, cfg), held_out_accuracy(model, task)
    data = [step_data(task, cfg, step) for step in range(cfg.steps)]  # made before the clock starts
    start = time.perf_counter()
    losses = trainer.fit(lambda step: data[step])
    seconds = time.perf_counter() - start
    real_tokens = sum(mb.real_tokens for step in data for mb in step)
    slots = sum(mb.ids.numel() for step in data for mb in step)
    return {"config": asdict(cfg), "losses": losses, "seconds": seconds, "tokens_per_second": real_tokens / seconds,
            "packing_efficiency": real_tokens / slots,
            "held_out_loss": {"before": before[0], "after": held_out_loss(model, task, cfg)},
            "held_out_accuracy": {"before": before[1], "after": held_out_accuracy(model, task)},
            "model": model}
