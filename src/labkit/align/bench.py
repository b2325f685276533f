"""The alignment runs as a benchmark: DPO, ORPO, KTO and SimPO from one warm-up, over seeds.

Not a speed benchmark: it records held-out preference accuracy (each method's implicit
reward ranking the chosen answer first) and task accuracy before and after each run, for
several seeds, and holds every method to the chapter's goal: the *worst* seed's rise in
preference accuracy is at least 15 points. It runs on the CPU too
(``python -m labkit.bench align.runs``, about two minutes on one thread).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..results import Goal
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
