"""A target model and its draft, trained in the project on the byte corpus of :mod:`labkit.models.text`.

The target is the book's architecture at Qwen3-0.6B's shape (28 layers, hidden 1024, 16
query and 8 KV heads of 128, SwiGLU 3072) with a byte vocabulary; the draft is the same
family, two layers of hidden 512. Both train with the book's loop
(:func:`labkit.models.train_lm`): the target on next-byte prediction, the draft by
*distillation*, matching the target's whole next-token distribution at every position
(``KL(p_target || q_draft)``, Hinton et al.'s soft targets) rather than the one byte the
text has. The acceptance rate is ``sum_x min(p, q)``, highest when ``q`` is close to ``p``
everywhere, so the draft is taught the target's distribution, not the text's.

On a GPU each model trains for a time budget (the number of steps is set from a timed
first few), in bfloat16 autocast; on the CPU, tiny versions train for a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import backend
from ..models import Decoder, DecoderConfig, lm_loss, random_windows, train_lm

TARGET_GPU = DecoderConfig(vocab_size=256, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                           head_dim=128, intermediate_size=3072, rope_theta=10_000.0, tie_word_embeddings=True)
DRAFT_GPU = DecoderConfig(vocab_size=256, hidden_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=128, intermediate_size=1536, rope_theta=10_000.0, tie_word_embeddings=True)
TARGET_CPU = DecoderConfig(vocab_size=256, hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                           head_dim=24, intermediate_size=256, rope_theta=10_000.0, tie_word_embeddings=True)
DRAFT_CPU = DecoderConfig(vocab_size=256, hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                          head_dim=24, intermediate_size=128, rope_theta=10_000.0, tie_word_embeddings=True)


@dataclass(frozen=True)
class TrainPlan:
    """How one model trains: ``seconds`` of budget (or a fixed ``steps`` when seconds is None)."""

    batch: int
    length: int
    lr: float
    steps: int | None = None
    seconds: float | None = None


TARGET_PLAN = backend.pick(cpu=TrainPlan(batch=16, length=64, lr=3e-3, steps=80),
                           gpu=TrainPlan(batch=64, length=256, lr=1e-3, seconds=60.0))
DRAFT_PLAN = backend.pick(cpu=TrainPlan(batch=16, length=64, lr=3e-3, steps=80),
                          gpu=TrainPlan(batch=64, length=256, lr=2e-3, seconds=20.0))


def distillation_loss(teacher: Decoder) -> Callable[..., torch.Tensor]:
    """A :func:`labkit.models.train_lm` objective: the mean over positions of ``KL(p_teacher || q_student)``
    on the next token (the text's own next token is not used)."""
    if not isinstance(teacher, Decoder):
        raise TypeError(f"teacher must be a labkit Decoder, got {type(teacher).__name__}")

    def loss(student: Decoder, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        context = ids[:, :-1]
        with torch.no_grad():
            teacher_logp = teacher(context).float().log_softmax(-1)
        student_logp = student(context).float().log_softmax(-1)
        kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="none").sum(-1)
        if loss_mask is None:
            return kl.mean()
        targets = loss_mask[:, 1:].float()
        return (kl * targets).sum() / targets.sum()

    return loss


def _sync(model: torch.nn.Module) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def _steps_for(model: torch.nn.Module, plan: TrainPlan, batch: Callable[[int], torch.Tensor],
               loss_fn: Callable[..., torch.Tensor]) -> int:
    """``plan.steps``, or as many steps as fit ``plan.seconds`` at the rate of three timed ones."""
    if plan.seconds is None:
        return plan.steps
    def one() -> None:
        loss_fn(model, batch(0)).backward()
    one()  # warm-up: allocations, cuBLAS algorithm choice
    _sync(model)
    t0 = time.perf_counter()
    for _ in range(3):
        one()
    _sync(model)
    model.zero_grad(set_to_none=True)
    per_step = (time.perf_counter() - t0) / 3 * 1.1  # the optimizer step and the schedule on top
    return max(10, int(plan.seconds / per_step))


def train_model(model: torch.nn.Module, text: torch.Tensor, plan: TrainPlan, *, seed: int,
                loss_fn: Callable[..., torch.Tensor] = lm_loss, desc: str = "train", bf16: bool | None = None) -> dict:
    """Train ``model`` on random windows of ``text`` (uint8 bytes) under ``plan``; a summary dict
    (steps, seconds, the losses of the first and last tenth of the steps). ``model`` is a Decoder,
    or any module that ``loss_fn(model, ids, loss_mask)`` trains (draft heads on a frozen target).
    ``bf16``: each forward in bfloat16 autocast (the default on a GPU)."""
    device = next(model.parameters()).device
    bf16 = device.type == "cuda" if bf16 is None else bf16
    gen = torch.Generator().manual_seed(seed)

    def batch(step: int) -> torch.Tensor:
        return random_windows(text, plan.batch, plan.length + 1, gen).to(device, non_blocking=True)

    def loss_in_bf16(*args) -> torch.Tensor:
        # Autocast around each forward, never around the loop: autocast keeps its bf16 copy of
        # every weight until its context exits, so a context held across optimizer steps runs
        # every forward on the first step's weights (on the H200 the target trained that way
        # scored far worse held out than in training, and no drafted token was ever accepted).
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return loss_fn(*args)

    steps = _steps_for(model, plan, batch, loss_in_bf16)
    t0 = time.perf_counter()
    losses = train_lm(model, batch, steps=steps, lr=plan.lr, progress=False, desc=desc, loss_fn=loss_in_bf16)
    tenth = max(1, steps // 10)
    return {"steps": steps, "seconds": time.perf_counter() - t0, "batch": plan.batch, "length": plan.length,
            "lr": plan.lr, "loss_first": sum(losses[:tenth]) / tenth, "loss_last": sum(losses[-tenth:]) / tenth}


@torch.no_grad()
def held_out_loss(model: Decoder, text: torch.Tensor, *, windows: int = 32, length: int = 256, seed: int = 1) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` on random windows of held-out ``text``."""
    device = model.embed.weight.device
    ids = random_windows(text, windows, length + 1, torch.Generator().manual_seed(seed)).to(device)
    return float(lm_loss(model, ids))


def as_dtype(model: Decoder, dtype: torch.dtype, *, fused: bool = False) -> Decoder:
    """A copy of ``model`` with its weights in ``dtype`` (built fresh: the rotary table stays fp32),
    for inference; ``fused`` runs it with :mod:`labkit.fused`'s kernels (fewer launches per step)."""
    w = model.embed.weight
    copy = Decoder(model.config, dtype=dtype, device=w.device, fused=fused)
    copy.load_state_dict(model.state_dict())
    return copy.eval()
