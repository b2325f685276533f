"""Preference runs on the book's small model: DPO, ORPO, KTO and SimPO side by side.

1. The GRPO chapter's policy (a small Qwen3-style decoder) gets the same short supervised
   warm-up (:func:`labkit.grpo.train.warmup`), stopped early so that it often errs.
2. Preference pairs are built once from that policy's own mistakes (:mod:`.data`): an
   offline dataset, as DPO is used in practice.
3. Each method trains a copy of the warmed-up policy on the same pairs in the same order;
   the warmed-up policy is the frozen reference for DPO and KTO.

Two numbers per method, before and after, on held-out prompts never trained on:
*preference accuracy*, the fraction of pairs whose chosen answer the method's own implicit
reward ranks above the rejected one (a tie counts half: DPO's reward is 0 for both at the
start); and *task accuracy*, the probability that one completion sampled at temperature 1
is exactly right (:func:`labkit.grpo.train.answer_probabilities`, exact, no sampling).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace

import torch

from ..grpo import AdditionTask
from ..grpo import RunConfig as GRPOConfig
from ..grpo.train import answer_probabilities, policy_config, warmup
from ..models import Decoder
from ..validate import check_choice, check_positive_int
from . import preference_loss
from .chunked import DEFAULT_BETA, chunked_sequence_logps
from .data import PreferencePairs, build_pairs
from .losses import AVERAGES_TOKENS, USES_REFERENCE, implicit_rewards

RUN_METHODS = ("dpo", "orpo", "kto", "simpo")


@dataclass(frozen=True)
class AlignConfig:
    """Settings of one comparison; the defaults are the CPU-scale run."""

    steps: int = 60
    batch_pairs: int = 32
    lr: float = 1e-3
    train_prompts: int = 512
    eval_prompts: int = 400
    warmup_steps: int = 150
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    samples_per_prompt: int = 4
    chunk_size: int = 8
    simpo_gamma: float = 0.5
    policy_hidden: int = 64
    policy_layers: int = 2
    seed: int = 0


@dataclass
class Setup:
    """What every method starts from: the warmed-up policy and the two datasets."""

    task: AdditionTask
    policy: Decoder
    train: PreferencePairs
    held_out: PreferencePairs


def prepare(cfg: AlignConfig = AlignConfig(), device: torch.device | str = "cpu") -> Setup:
    """Warm the policy up, then build training pairs (train prompts) and held-out pairs."""
    task = AdditionTask()
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    policy = Decoder(policy_config(task, cfg.policy_hidden, cfg.policy_layers), seed=cfg.seed).to(device)
    warmup(policy, task, GRPOConfig(warmup_steps=cfg.warmup_steps, warmup_batch=cfg.warmup_batch,
                                    warmup_lr=cfg.warmup_lr), gen, device)
    train_ops = task.sample_pairs(cfg.train_prompts, "train", gen)
    held_ops = task.pairs("held_out")[: cfg.eval_prompts]
    train = build_pairs(task, train_ops, policy, samples_per_prompt=cfg.samples_per_prompt, generator=gen)
    held = build_pairs(task, held_ops, policy, samples_per_prompt=cfg.samples_per_prompt, generator=gen)
    return Setup(task, policy.eval(), train, held)


def _sequences(model: Decoder, data: PreferencePairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = data.sequences()
    return model(inputs.to(device), hidden_only=True), targets.to(device)


@torch.no_grad()
def preference_accuracy(method: str, policy: Decoder, reference: Decoder, data: PreferencePairs,
                        chunk_size: int = 64) -> float:
    """Fraction of pairs whose chosen completion ``method``'s implicit reward ranks higher (ties: half)."""
    device = next(policy.parameters()).device
    average = AVERAGES_TOKENS[method]
    hidden, targets = _sequences(policy, data, device)
    logps = chunked_sequence_logps(hidden, policy.lm_head.weight, targets, average=average, chunk_rows=chunk_size)
    ref_logps = None
    if USES_REFERENCE[method]:
        ref_hidden, _ = _sequences(reference, data, device)
        ref_logps = chunked_sequence_logps(ref_hidden, reference.lm_head.weight, targets, average=average,
                                           chunk_rows=chunk_size)
    rewards = implicit_rewards(method, logps, ref_logps, DEFAULT_BETA[method])
    chosen, rejected = rewards.chunk(2)
    return ((chosen > rejected).double() + 0.5 * (chosen == rejected).double()).mean().item()


@torch.no_grad()
def mean_logps(policy: Decoder, data: PreferencePairs) -> tuple[float, float]:
    """Mean ``log pi(y|x)`` (summed over tokens) of the chosen and of the rejected completions."""
    device = next(policy.parameters()).device
    hidden, targets = _sequences(policy, data, device)
    logps = chunked_sequence_logps(hidden, policy.lm_head.weight, targets, average=False, chunk_rows=64)
    chosen, rejected = logps.chunk(2)
    return chosen.mean().item(), rejected.mean().item()


def task_accuracy(policy: Decoder, setup: Setup) -> float:
    """Held-out probability that one completion sampled at temperature 1 is exactly right."""
    device = next(policy.parameters()).device
    return answer_probabilities(policy, setup.task, setup.held_out.operands, 1.0, device).mean().item()


@torch.no_grad()
def kto_reference_point(policy: Decoder, reference: Decoder, batch: PreferencePairs, chunk_size: int) -> torch.Tensor:
    """KTO's ``z``: KL(policy || reference) estimated as TRL does, on mismatched pairs (each
    prompt with the next prompt's chosen completion), averaged, clipped at 0, no gradient."""
    mismatched = replace(batch, chosen=batch.chosen.roll(1, dims=0), rejected=batch.chosen.roll(1, dims=0))
    device = next(policy.parameters()).device
    hidden, targets = _sequences(policy, mismatched, device)
    ref_hidden, _ = _sequences(reference, mismatched, device)
    logps = chunked_sequence_logps(hidden, policy.lm_head.weight, targets, average=False, chunk_rows=chunk_size)
    ref = chunked_sequence_logps(ref_hidden, reference.lm_head.weight, targets, average=False, chunk_rows=chunk_size)
    return (logps - ref)[: len(batch)].mean().clamp(min=0)


def train_method(method: str, setup: Setup, cfg: AlignConfig = AlignConfig(), *, eval_every: int = 0) -> dict:
    """Train a copy of the warmed-up policy with ``method``; curves and before/after numbers."""
    check_choice(method, "method", RUN_METHODS)
    check_positive_int(cfg.steps, "steps")
    reference = setup.policy
    policy = copy.deepcopy(reference).train()
    device = next(policy.parameters()).device
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # the same batches for every method
    n = len(setup.train)
    history = [{"step": 0, "loss": None, "held_out_preference_accuracy":
                preference_accuracy(method, policy, reference, setup.held_out)}]
    for step in range(1, cfg.steps + 1):
        batch = setup.train.subset(torch.randint(n, (cfg.batch_pairs,), generator=gen))
        hidden, targets = _sequences(policy, batch, device)
        kwargs: dict = {}
        if USES_REFERENCE[method]:
            with torch.no_grad():
                kwargs["ref_hidden"], _ = _sequences(reference, batch, device)
            kwargs["ref_weight"] = reference.lm_head.weight.detach()
        if method == "kto":  # unpaired: the chosen rows are desirable examples, the rejected ones not
            kwargs["desirable"] = torch.arange(2 * len(batch), device=device) < len(batch)
            kwargs["kl"] = kto_reference_point(policy, reference, batch, cfg.chunk_size)
        if method == "simpo":
            kwargs["gamma"] = cfg.simpo_gamma
        loss = preference_loss(method, hidden, policy.lm_head.weight, targets, chunk_size=cfg.chunk_size, **kwargs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        row = {"step": step, "loss": loss.item(), "held_out_preference_accuracy": None}
        if eval_every and (step % eval_every == 0 or step == cfg.steps):
            row["held_out_preference_accuracy"] = preference_accuracy(method, policy, reference, setup.held_out)
        history.append(row)
    policy.eval()
    return {"method": method, "history": history,
            "preference_accuracy": {"before": history[0]["held_out_preference_accuracy"],
                                    "after": preference_accuracy(method, policy, reference, setup.held_out)},
            "task_accuracy": {"before": task_accuracy(reference, setup), "after": task_accuracy(policy, setup)},
            "held_out_logps": {"before": mean_logps(reference, setup.held_out), "after": mean_logps(policy, setup.held_out)},
            "policy": policy}


def compare(cfg: AlignConfig = AlignConfig(), methods: tuple[str, ...] = RUN_METHODS, *,
            device: torch.device | str = "cpu", eval_every: int = 0) -> dict:
    """One warm-up and dataset, then every method in ``methods`` from the same start."""
    setup = prepare(cfg, device)
    runs = {m: train_method(m, setup, cfg, eval_every=eval_every) for m in methods}
    return {"setup": setup, "runs": runs, "config": asdict(cfg),
            "rejected_from_policy": setup.train.from_policy.float().mean().item()}
