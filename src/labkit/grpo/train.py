"""A real GRPO run: a small decoder learns addition from a rule-based reward.

1. A short supervised warm-up teaches the policy the task's format (digits, then eos)
   on a few hundred examples, stopping early so that it answers only some prompts right.
2. GRPO then improves it with no labels at all: for each prompt it samples a group of
   completions, rewards the exactly-correct ones, and pushes each completion's tokens up
   or down by its advantage within the group, held near the warm-up policy by the K3 KL.

The reward on held-out prompts (pairs never trained on) is measured with the same
sampling as training, before and during the run.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..models import Decoder, DecoderConfig
from ..validate import check_tensor
from .loss import group_advantages, grpo_loss, token_logprobs
from .rollout import Rollout, sample_group
from .task import AdditionTask


PASS_AT_K = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class RunConfig:
    """The run's settings; the defaults are the chapter's CPU-scale run."""

    steps: int = 100
    prompts_per_step: int = 64
    group_size: int = 8
    lr: float = 5e-4
    lr_warmup_steps: int = 10
    clip_eps: float = 0.2
    beta: float = 0.02
    normalization: str = "token"
    updates_per_rollout: int = 2
    warmup_steps: int = 400
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    eval_prompts: int = 2000  # every held-out pair of two-digit addition: evaluation is one forward pass
    eval_every: int = 10
    temperature: float = 1.0
    seed: int = 0


def policy_config(task: AdditionTask, hidden: int = 64, layers: int = 2) -> DecoderConfig:
    """A small Qwen3-style decoder over the task's 14 tokens."""
    return DecoderConfig(vocab_size=task.vocab_size, hidden_size=hidden, num_layers=layers, num_heads=4,
                         num_kv_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
                         rope_theta=10_000.0, tie_word_embeddings=True, max_position_embeddings=64)


def supervised_batch(task: AdditionTask, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + correct completion (padded), and the mask of completion tokens to learn."""
    answers = task.answers(pairs)
    width = task.max_answer_tokens
    completions = torch.full((len(pairs), width), task.PAD)
    for i, a in enumerate(answers):
        completions[i, : len(a)] = torch.tensor(a)
    tokens = torch.cat([task.prompts(pairs), completions], dim=1)
    mask = torch.zeros(len(pairs), tokens.shape[1] - 1)
    p = task.prompt_length
    mask[:, p - 1:] = (completions != task.PAD).float()
    return tokens, mask


def warmup(policy: Decoder, task: AdditionTask, cfg: RunConfig, generator: torch.Generator,
           device: torch.device) -> list[float]:
    """Supervised fine-tuning on correct answers for ``cfg.warmup_steps`` steps; the losses."""
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    losses = []
    for _ in range(cfg.warmup_steps):
        pairs = task.sample_pairs(cfg.warmup_batch, "train", generator)
        tokens, mask = supervised_batch(task, pairs)
        tokens, mask = tokens.to(device), mask.to(device)
        logp = token_logprobs(policy(tokens), tokens)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rollout_for(policy: Decoder, task: AdditionTask, pairs: torch.Tensor, group_size: int,
                temperature: float, generator: torch.Generator, device: torch.device) -> tuple[Rollout, torch.Tensor]:
    policy.eval()
    rollout = sample_group(policy, task.prompts(pairs).to(device), group_size=group_size,
                           max_new_tokens=task.max_answer_tokens, eos=task.EOS, pad=task.PAD,
                           temperature=temperature, generator=generator)
    policy.train()
    rewards = task.reward(rollout.completions.cpu(), pairs.repeat_interleave(group_size, dim=0))
    return rollout, rewards


@torch.no_grad()
def answer_probabilities(policy: Decoder, task: AdditionTask, pairs: torch.Tensor, temperature: float,
                         device: torch.device) -> torch.Tensor:
    """Per prompt, the probability that one completion sampled at ``temperature`` earns reward 1.

    The reward is 1 exactly when the sampled tokens are the answer's digits then eos, so that
    probability is the product of the policy's probabilities of those tokens, computed in one
    teacher-forced forward pass: the expected reward itself, with no sampling noise.
    """
    tokens, mask = supervised_batch(task, pairs)
    tokens, mask = tokens.to(device), mask.to(device)
    policy.eval()
    logp = token_logprobs(policy(tokens).float() / temperature, tokens)
    policy.train()
    return (logp * mask).sum(dim=1).exp().cpu()


def pass_at_k(answer_probs: torch.Tensor, ks: tuple[int, ...]) -> dict[int, float]:
    """Mean over prompts of P(at least one of k independent samples is right) = 1 - (1 - p)^k.

    ``answer_probs`` holds each prompt's probability ``p`` that one sample is right (from
    :func:`answer_probabilities`), so the value is exact, not an estimate from samples.
    """
    check_tensor(answer_probs, "answer_probs", ndim=1, dtypes=[torch.float32, torch.float64])
    if any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"every k must be a positive int, got {ks}")
    return {k: float((1 - (1 - answer_probs.double()) ** k).mean()) for k in ks}


def evaluate(policy: Decoder, task: AdditionTask, pairs: torch.Tensor, cfg: RunConfig,
             device: torch.device) -> float:
    """Expected reward on the held-out prompts at the training temperature (exact, no sampling)."""
    return answer_probabilities(policy, task, pairs, cfg.temperature, device).mean().item()


def grpo_optimizer(policy: Decoder, cfg: RunConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW at ``cfg.lr``, its rate ramped up linearly over the first ``cfg.lr_warmup_steps`` steps."""
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Adam's first steps move every weight by about lr whatever its gradient's size (the
    # second-moment estimate is one sample): ramp the rate up over the first GRPO steps.
    ramp = max(cfg.lr_warmup_steps * cfg.updates_per_rollout, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / ramp))
    return opt, schedule


def grpo_update(policy: Decoder, opt: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                rollout: Rollout, advantages: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                cfg: RunConfig, is_weights: torch.Tensor | None = None) -> dict[str, float]:
    """``cfg.updates_per_rollout`` clipped-loss steps on one rollout; the last step's metrics."""
    for _ in range(cfg.updates_per_rollout):
        logp = token_logprobs(policy(rollout.tokens), rollout.tokens)
        loss, metrics = grpo_loss(logp, old_logp, ref_logp, advantages, rollout.mask, clip_eps=cfg.clip_eps,
                                  beta=cfg.beta, normalization=cfg.normalization, is_weights=is_weights)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        schedule.step()
    return metrics


def run(cfg: RunConfig = RunConfig(), *, task: AdditionTask | None = None, device: torch.device | str = "cpu",
        policy_size: tuple[int, int] = (64, 2), progress: bool = True) -> dict:
    """Warm up, then train by GRPO; returns the history (one row per step) and summary."""
    task = task or AdditionTask()
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    policy = Decoder(policy_config(task, *policy_size)).to(device)
    warmup_losses = warmup(policy, task, cfg, gen, device)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    held_out = task.pairs("held_out")[: cfg.eval_prompts]
    opt, schedule = grpo_optimizer(policy, cfg)
    start_probs = answer_probabilities(policy, task, held_out, cfg.temperature, device)
    history = [{"step": 0, "reward": float("nan"), "held_out_reward": start_probs.mean().item(), "kl": 0.0,
                "length": float("nan"), "clip_fraction": 0.0}]
    for step in tqdm(range(1, cfg.steps + 1), desc="GRPO", disable=not progress):
        pairs = task.sample_pairs(cfg.prompts_per_step, "train", gen)
        rollout, rewards = rollout_for(policy, task, pairs, cfg.group_size, cfg.temperature, gen, device)
        adv = group_advantages(rewards, cfg.group_size).to(device)
        with torch.no_grad():
            old_logp = token_logprobs(policy(rollout.tokens), rollout.tokens)
            ref_logp = token_logprobs(reference(rollout.tokens), rollout.tokens)
        metrics = grpo_update(policy, opt, schedule, rollout, adv, old_logp, ref_logp, cfg)
        row = {"step": step, "reward": rewards.mean().item(), "kl": metrics["kl"],
               "length": rollout.lengths.float().mean().item(), "clip_fraction": metrics["clip_fraction"],
               "held_out_reward": float("nan")}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row["held_out_reward"] = evaluate(policy, task, held_out, cfg, device)
        history.append(row)
    final_probs = answer_probabilities(policy, task, held_out, cfg.temperature, device)
    return {"history": history, "warmup_losses": warmup_losses,
            "start_held_out_reward": start_probs.mean().item(), "final_held_out_reward": final_probs.mean().item(),
            "start_pass_at_k": pass_at_k(start_probs, PASS_AT_K), "final_pass_at_k": pass_at_k(final_probs, PASS_AT_K),
            "config": asdict(cfg), "policy": policy}
