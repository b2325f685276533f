"""The controller: the main loop of an RL system around GRPO.

One step, as verl's ``RayPPOTrainer.fit`` and Miles'/slime's ``train.py`` run it:

1. **rollout**: the rollout worker (:class:`~labkit.rl.rollout.RolloutWorker`, an engine)
   samples ``G`` completions for each prompt of the batch, with their log-probs;
2. **reward**: a rule scores each completion (the addition task's exact match);
3. **train**: group-relative advantages; the trainer recomputes the old and reference
   log-probs, weighs each token by its truncated importance weight (:mod:`~labkit.rl.tis`)
   and takes the GRPO steps (:func:`labkit.grpo.train.grpo_update`);
4. **sync**: the new weights go into the engine (:mod:`~labkit.rl.sync`).

:class:`SystemConfig` holds what this chapter adds to the GRPO chapter's
:class:`~labkit.grpo.RunConfig`: which sampler rolls out, in which dtype, the TIS cap,
dynamic sampling, and how stale rollouts may be (``staleness=1`` is one-step off-policy:
the batch trained on at step ``t`` was sampled by the weights of step ``t - 1``, so the
rollout of the next batch can run while the trainer trains on this one).
Each phase is timed (synchronised on a GPU), so the history says where a step's time went.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..grpo import AdditionTask, Rollout, RunConfig, group_advantages, token_logprobs
from ..grpo.train import evaluate, grpo_optimizer, grpo_update, policy_config, rollout_for, warmup
from ..models import Decoder
from ..validate import check_choice
from .dynamic import group_rows, informative_groups
from .rollout import RolloutBatch, RolloutWorker
from .tis import mismatch, tis_weights

ROLLOUTS = ("engine", "plain")
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PHASES = ("rollout", "reward", "train", "sync")


@dataclass(frozen=True)
class SystemConfig:
    """How the system around GRPO runs (the defaults: an fp32 engine, TIS at cap 2, on-policy).

    ``rollout``: ``"engine"`` (:class:`RolloutWorker`) or ``"plain"`` (the GRPO chapter's
    sampling loop on the trainer's own model, which needs no sync and has no mismatch).
    ``tis_cap``: ``None`` trains without the correction. ``dynamic_sampling``: keep only
    groups with differing rewards, sampling up to ``max_sampling_rounds`` batches to fill one.
    """

    rollout: str = "engine"
    engine_dtype: str = "float32"
    tis_cap: float | None = 2.0
    tis_level: str = "token"
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    staleness: int = 0

    def __post_init__(self) -> None:
        check_choice(self.rollout, "rollout", ROLLOUTS)
        check_choice(self.engine_dtype, "engine_dtype", tuple(ENGINE_DTYPES))
        if not isinstance(self.staleness, int) or isinstance(self.staleness, bool) or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if self.rollout == "plain" and self.staleness:
            raise ValueError("the plain sampler is the trainer's own model: it cannot sample with stale weights")


class PhaseTimer:
    """Seconds spent per phase, synchronising the GPU at each boundary so that a phase's
    queued kernels are charged to it and not to the next."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[name] += time.perf_counter() - start


def warmed_policy(cfg: RunConfig, task: AdditionTask, device: torch.device | str = "cpu",
                  policy_size: tuple[int, int] = (64, 2)) -> Decoder:
    """A fresh policy after the GRPO chapter's supervised warm-up (seeded by ``cfg.seed``)."""
    torch.manual_seed(cfg.seed)
    policy = Decoder(policy_config(task, *policy_size)).to(device)
    warmup(policy, task, cfg, torch.Generator().manual_seed(cfg.seed), torch.device(device))
    return policy


def concat_batches(batches: list[tuple[RolloutBatch, torch.Tensor]], pad: int) -> tuple[RolloutBatch, torch.Tensor]:
    """Rollouts (and their rewards) stacked into one, shorter ones padded to the longest."""
    width = max(b.rollout.tokens.shape[1] for b, _ in batches)

    def widen(t: torch.Tensor, columns: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, columns - t.shape[1]), value=value)

    tokens = torch.cat([widen(b.rollout.tokens, width, pad) for b, _ in batches])
    mask = torch.cat([widen(b.rollout.mask, width - 1, 0.0) for b, _ in batches])
    logp = torch.cat([widen(b.rollout_logp, width - 1, 0.0) for b, _ in batches])
    rewards = torch.cat([r for _, r in batches])
    return RolloutBatch(Rollout(tokens, mask, batches[0][0].rollout.prompt_length), logp), rewards


def select_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    r = batch.rollout
    return RolloutBatch(Rollout(r.tokens[rows], r.mask[rows], r.prompt_length), batch.rollout_logp[rows])


def run(cfg: RunConfig = RunConfig(), system: SystemConfig = SystemConfig(), *, task: AdditionTask | None = None,
        device: torch.device | str = "cpu", start: Decoder | None = None, policy_size: tuple[int, int] = (64, 2),
        progress: bool = True) -> dict:
    """GRPO through the system: rollouts from ``system.rollout``, then train, then sync.

    ``start`` is a warmed-up policy to begin from (copied; see :func:`warmed_policy`), so
    that several systems can be compared from one warm-up; by default one is made here.
    Returns one history row per step (rewards, KL, the mismatch, importance weights, the
    fraction of groups kept, and seconds per phase) and a summary.
    """
    if not isinstance(system, SystemConfig):
        raise TypeError(f"system must be a SystemConfig, got {type(system).__name__}")
    task = task or AdditionTask()
    device = torch.device(device)
    policy = copy.deepcopy(start) if start is not None else warmed_policy(cfg, task, device, policy_size)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    held_out = task.pairs("held_out")[: cfg.eval_prompts]
    opt, schedule = grpo_optimizer(policy, cfg)
    G, B = cfg.group_size, cfg.prompts_per_step
    worker = None
    if system.rollout == "engine":
        worker = RolloutWorker(policy, max_num_seqs=B * G, max_model_len=task.prompt_length + task.max_answer_tokens,
                               dtype=ENGINE_DTYPES[system.engine_dtype])
    timer = PhaseTimer(device)
    rollout_seeds = iter(range(cfg.seed * 10**9, cfg.seed * 10**9 + 10**9, B * G))

    def sample() -> tuple[RolloutBatch, torch.Tensor]:
        pairs = task.sample_pairs(B, "train", gen)
        with timer.phase("rollout"):
            if worker is not None:
                batch = worker.generate(task.prompts(pairs).to(device), group_size=G,
                                        max_new_tokens=task.max_answer_tokens, eos=task.EOS, pad=task.PAD,
                                        temperature=cfg.temperature, seed=next(rollout_seeds))
            else:
                rollout, _ = rollout_for(policy, task, pairs, G, cfg.temperature, gen, device)
                with torch.no_grad():  # the sampler is the trainer's model: its log-probs are the trainer's
                    batch = RolloutBatch(rollout, token_logprobs(policy(rollout.tokens), rollout.tokens) * rollout.mask)
        with timer.phase("reward"):
            rewards = task.reward(batch.rollout.completions.cpu(), pairs.repeat_interleave(G, dim=0))
        return batch, rewards

    def collect() -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """One training batch: a sampled batch, or with dynamic sampling informative groups
        from up to ``max_sampling_rounds`` sampled batches."""
        batch, rewards = sample()
        stats = {"reward": rewards.mean().item(), "groups_kept": 1.0, "samples_generated": float(len(rewards))}
        if not system.dynamic_sampling:
            return batch, rewards, stats
        kept, groups, generated = [], 0, 0
        for round_ in range(system.max_sampling_rounds):
            if round_:
                batch, rewards = sample()
            generated += len(rewards)
            keep = informative_groups(rewards, G)
            rows = group_rows(keep, G)
            kept.append((select_rows(batch, rows.to(batch.rollout.tokens.device)), rewards[rows]))
            groups += int(keep.sum())
            if groups >= B:
                break
        stats.update(groups_kept=groups / (generated // G), samples_generated=float(generated))
        if groups == 0:  # nothing to learn from: train on the last batch, all advantages 0
            return batch, rewards, stats
        batch, rewards = concat_batches(kept, task.PAD)
        rows = torch.arange(min(groups, B) * G)
        return select_rows(batch, rows.to(batch.rollout.tokens.device)), rewards[rows], stats

    start_reward = evaluate(policy, task, held_out, cfg, device)
    history = [{"step": 0, "held_out_reward": start_reward}]
    pending: deque = deque()
    for step in tqdm(range(1, cfg.steps + 1), desc=f"RL ({system.rollout})", disable=not progress):
        timer.seconds = dict.fromkeys(PHASES, 0.0)
        while len(pending) < system.staleness + 1:
            pending.append(collect())
        batch, rewards, stats = pending.popleft()
        rollout = batch.rollout
        with timer.phase("train"):
            adv = group_advantages(rewards, G).to(device)
            with torch.no_grad():
                old_logp = token_logprobs(policy(rollout.tokens), rollout.tokens)
                ref_logp = token_logprobs(reference(rollout.tokens), rollout.tokens)
            gap = mismatch(old_logp, batch.rollout_logp, rollout.mask)
            weights = None
            if system.tis_cap is not None:
                weights = tis_weights(old_logp, batch.rollout_logp, rollout.mask, cap=system.tis_cap,
                                      level=system.tis_level)
            metrics = grpo_update(policy, opt, schedule, rollout, adv, old_logp, ref_logp, cfg, is_weights=weights)
        sync_bytes = 0
        if worker is not None:
            with timer.phase("sync"):
                sync_bytes = worker.load_weights(policy).bytes
        counted = rollout.mask.sum().clamp(min=1)
        row = {"step": step, **stats, "kl": metrics["kl"], "clip_fraction": metrics["clip_fraction"],
               "length": rollout.lengths.float().mean().item(), "mismatch_kl": gap["kl"],
               "mismatch_max_abs": gap["max_abs"],
               "tis_weight_mean": float(weights.sum() / counted) if weights is not None else 1.0,
               "tis_truncated": float(((weights >= system.tis_cap) & (rollout.mask > 0)).sum() / counted)
               if weights is not None else 0.0,
               "sync_bytes": sync_bytes, "held_out_reward": float("nan"),
               **{f"{name}_s": s for name, s in timer.seconds.items()}}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row["held_out_reward"] = evaluate(policy, task, held_out, cfg, device)
        history.append(row)
    final = evaluate(policy, task, held_out, cfg, device)
    return {"history": history, "start_held_out_reward": start_reward, "final_held_out_reward": final,
            "config": asdict(cfg), "system": asdict(system), "policy": policy, "worker": worker}
