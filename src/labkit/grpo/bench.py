"""The GRPO run as a benchmark: its curves are what the chapter plots and records.

It is not a speed benchmark: the numbers it records are rewards, KL and lengths over
training steps, and pass@k on the held-out prompts before and after, measured by running
the code, with the goal the chapter is held to (held-out reward up by at least 10 points
on the CPU run, 30 on the GPU run).
"""

from __future__ import annotations

import math
import time

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from .task import AdditionTask
from .train import RunConfig, run

CPU_RUN = RunConfig()
GPU_RUN = RunConfig(steps=500, group_size=16, eval_every=25)
CPU_POLICY, GPU_POLICY = (64, 2), (128, 4)


def rise_goal() -> float:
    return backend.pick(cpu=0.10, gpu=0.30)


@benchmark("grpo.run", chapter="grpo", title="GRPO on two-digit addition: reward, KL and length over steps")
def grpo_run() -> Measurement:
    cfg = backend.pick(cpu=CPU_RUN, gpu=GPU_RUN)
    size = backend.pick(cpu=CPU_POLICY, gpu=GPU_POLICY)
    t0 = time.perf_counter()
    out = run(cfg, task=AdditionTask(digits=2), device=backend.device(), policy_size=size)
    seconds = time.perf_counter() - t0
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in out["history"]]
    rise = out["final_held_out_reward"] - out["start_held_out_reward"]
    return Measurement(
        rows=rows,
        metric="reward (fraction of exactly-correct completions), KL (nats/token), length (tokens)",
        goals=[Goal("held-out reward rise over the warm-up policy (points/100)", rise, ">=", rise_goal())],
        config={**out["config"], "policy_hidden": size[0], "policy_layers": size[1],
                "start_held_out_reward": out["start_held_out_reward"],
                "final_held_out_reward": out["final_held_out_reward"],
                "held_out_pass_at_k": {f"pass@{k}": {"start": out["start_pass_at_k"][k], "final": out["final_pass_at_k"][k]}
                                       for k in out["start_pass_at_k"]},
                "warmup_final_loss": out["warmup_losses"][-1], "wall_seconds": seconds},
    )
