"""The chapter's benchmark: the memory one rank of an ``N``-rank job holds, per ZeRO stage.

One process plays rank 0 of ``N`` on a fake process group (its collectives move nothing,
so the shapes and the memory are a real rank's and the values are not), trains the book's
decoder for two steps with each of our wrappers, and measures the peak bytes held by
parameters, gradients and optimizer state (counted from storage) and, on a GPU, the CUDA
allocator's own peak over the second step, which also sees activations, workspaces and
the optimizer's temporaries. Both are compared with :mod:`labkit.zero.memory`'s formulas.
Mixed precision throughout: bf16 parameters and gradients, fp32 master weights and moments.
"""

from __future__ import annotations

import dataclasses

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..models import TINY
from ..results import Goal
from . import programs

# On the H200: 24 layers of hidden 2048 (SwiGLU 5632, 16 query and 8 KV heads of 128) and an
# 8192-token tied embedding, 1.15 B parameters: 18 GB of training state on one DDP rank. (A
# small vocabulary keeps the embedding's backward temporaries, which no formula counts, small.)
GPU_CONFIG = dataclasses.asdict(TINY) | dict(vocab_size=8192, hidden_size=2048, num_layers=24, num_heads=16,
                                             num_kv_heads=8, head_dim=128, intermediate_size=5632)
# On the CPU: 8 small layers, 1.6 M parameters, so that the transient buckets and units are
# small against the shards as they are in a large model.
CPU_CONFIG = dataclasses.asdict(TINY) | dict(num_layers=8, hidden_size=128, intermediate_size=384, num_heads=4,
                                             num_kv_heads=2, head_dim=32)
WORLD_SIZES = (2, 4, 8)
SEQ = 16  # tokens per step: activations small against the state, as the formulas leave them out
TOLERANCE = 0.10  # the goal: measured peak within 10% of the formula


def measure(config: dict | None = None, world_sizes: tuple[int, ...] = WORLD_SIZES,
            kinds: tuple[str, ...] = programs.WRAPPERS, dtype: str = "bfloat16") -> Measurement:
    config = backend.pick(cpu=CPU_CONFIG, gpu=GPU_CONFIG) if config is None else config
    device = backend.pick(cpu="cpu", gpu="cuda")
    rows = []
    for n in world_sizes:
        for kind in kinds:
            r = programs.simulated_rank_memory(config, n, kind, dtype, device, seq=SEQ)
            formula = r["formula"]["total"]
            row = {"kind": kind, "stage": programs.STAGE_OF[kind], "world_size": n, "num_params": r["num_params"],
                   "formula_bytes": formula, "held_bytes": r["held_peak"]["total"],
                   "held/formula": r["held_peak"]["total"] / formula, "peak_at": r["peak_at"],
                   **{f"held_{k}": r["held_peak"][k] for k in ("params", "grads", "optimizer")},
                   **{f"formula_{k}": r["formula"][k] for k in ("params", "grads", "optimizer")}}
            if r["allocator_peak"] is not None:
                row["allocator_bytes"] = r["allocator_peak"]
                row["allocator/formula"] = r["allocator_peak"] / formula
            rows.append(row)
    goals = [Goal("largest |held / formula - 1| over stages and world sizes",
                  max(abs(row["held/formula"] - 1) for row in rows), "<=", TOLERANCE)]
    if all("allocator/formula" in row for row in rows):
        goals.append(Goal("largest |CUDA allocator peak / formula - 1|",
                          max(abs(row["allocator/formula"] - 1) for row in rows), "<=", TOLERANCE))
    return Measurement(rows=rows, metric="held_bytes", goals=goals,
                       config={"model": config, "dtype": dtype, "device": device, "world_sizes": list(world_sizes),
                               "simulated": "rank 0 on a fake process group (torch.testing fake_pg)"})


@benchmark("zero.memory", chapter="zero-fsdp",
           title="Bytes one rank holds per ZeRO stage, measured on a simulated shard, against the formula")
def zero_memory() -> Measurement:
    return measure()
