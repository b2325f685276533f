"""The alignment runs as a benchmark: DPO, ORPO, KTO and SimPO from one warm-up, over seeds.

Not a speed benchmark: it records held-out preference accuracy (each method's implicit
reward ranking the chosen answer first) and task accuracy before and after each run, for
several seeds, and holds every method to the chapter's goal: the *worst* seed's rise in
preference accuracy is at least 15 points. It runs on the CPU too
(``python -m labkit.bench align.runs``).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import IGNORE_INDEX, preference_loss
from .runs import RUN_METHODS, AlignConfig, compare

RUN = AlignConfig(warmup_steps=300, steps=80, train_prompts=1024, samples_per_prompt=8)
SEEDS = (0, 1, 2)
RISE_GOAL = 0.15


@benchmark("align.runs", chapter="alignment", title="DPO, ORPO, KTO and SimPO on two-digit addition: held-out accuracy")
def align_runs() -> Measurement:
    rows = []
    t0 = time.perf_counter()
    for seed in SEEDS:
        out = compare(AlignConfig(**{**asdict(RUN), "seed": seed}), device=backend.device())
        for method, r in out["runs"].items():
            rows.append({"method": method, "seed": seed,
                         "preference_accuracy_before": r["preference_accuracy"]["before"],
                         "preference_accuracy_after": r["preference_accuracy"]["after"],
                         "task_accuracy_before": r["task_accuracy"]["before"],
                         "task_accuracy_after": r["task_accuracy"]["after"],
                         "rejected_from_policy": out["rejected_from_policy"]})
    goals = [Goal(f"{m}: worst-seed rise of held-out preference accuracy (points/100)",
                  min(r["preference_accuracy_after"] - r["preference_accuracy_before"] for r in rows if r["method"] == m),
                  ">=", RISE_GOAL) for m in RUN_METHODS]
    return Measurement(rows=rows, metric="held-out accuracy (fraction of pairs / expected exact-answer rate)",
                       goals=goals, config={**asdict(RUN), "seeds": list(SEEDS), "torch_threads": torch.get_num_threads(),
                                            "wall_seconds": time.perf_counter() - t0})


MEMORY_VARIANTS = ("whole batch", "chunk loop", "fused chunks")


@benchmark("align.memory", chapter="alignment",
           title="Memory a DPO loss keeps for backward: whole batch, chunk loop, fused chunks")
def align_memory() -> Measurement:
    """Bytes autograd holds between forward and backward (not a timing), per batch and vocabulary.

    Liger-Kernel is not in this table: its chunk step runs under ``torch.func.grad_and_value``,
    which refuses to run inside ``saved_tensors_hooks`` (torch raises that functorch
    transforms "don't yet support saved tensor hooks"), so this way of counting cannot see it.
    """
    from .chunked import autograd_saved_bytes

    length, width = backend.pick(cpu=(64, 64), gpu=(1024, 1024))
    vocabs = backend.pick(cpu=(1024, 4096, 16384, 32768), gpu=(8192, 32768, 151936))
    device = backend.device()
    rows = []
    for pairs in (1, 2, 4):
        for vocab in vocabs:
            g = torch.Generator(device=device).manual_seed(vocab + pairs)
            hidden = torch.randn(2 * pairs, length, width, generator=g, device=device, requires_grad=True)
            weight = (0.02 * torch.randn(vocab, width, generator=g, device=device)).requires_grad_()
            targets = torch.randint(vocab, (2 * pairs, length), generator=g, device=device)
            targets[:, : length // 4] = IGNORE_INDEX  # the prompt
            ref_hidden, ref_weight = hidden.detach() * 0.9, weight.detach() * 1.1
            ref = dict(ref_hidden=ref_hidden, ref_weight=ref_weight, beta=0.1)
            losses = {
                "whole batch": lambda: preference_loss("dpo", hidden, weight, targets, chunk_size=pairs,
                                                       fuse_backward=False, **ref),
                "chunk loop": lambda: preference_loss("dpo", hidden, weight, targets, chunk_size=1,
                                                      fuse_backward=False, **ref),
                "fused chunks": lambda: preference_loss("dpo", hidden, weight, targets, chunk_size=1, **ref),
            }
            row = {"pairs": pairs, "vocab": vocab, "length": length, "hidden": width,
                   "logits_mb": 2 * pairs * length * vocab * 4 / 1e6}
            for name in MEMORY_VARIANTS:
                row[f"{name} MB"] = autograd_saved_bytes(losses[name]) / 1e6
            rows.append(row)
    largest = rows[-1]
    return Measurement(rows=rows, metric="MB kept by autograd for backward (saved_tensors_hooks), float32",
                       goals=[Goal("fused chunks / whole batch at the largest batch and vocabulary",
                                   largest["fused chunks MB"] / largest["whole batch MB"], "<=", 0.25)],
                       config={"method": "dpo", "dtype": "float32", "chunk_pairs": 1})
