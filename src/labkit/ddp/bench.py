"""The chapter's benchmark: training steps with the bucket all-reduces overlapped with
backward, against the same buckets all-reduced after backward, and against torch's own
DDP (its C++ reducer, same buckets), on two gloo processes.

It runs on the CPU on any machine (gloo), so its record is a CPU record: the issue asks
for the ratio on the CPU run. Multi-GPU numbers belong to the multi-GPU chapters.
"""

from __future__ import annotations

import statistics

from ..benchmarks import Measurement, benchmark
from ..collectives import launch
from ..results import Goal
from . import programs

# The book's decoder at a size where the all-reduce is a visible part of a step on gloo:
# 4 layers, hidden 256, a 4096-token vocabulary (tied), about 16 MiB of fp32 gradients.
TIMED_CONFIG = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                    intermediate_size=768, tie_word_embeddings=True)
WORLD_SIZE = 2
STEPS_PER_MODE = 6
BATCH, SEQ = 2, 64
BUCKET_CAP_MB = 2.0  # the default caps make two buckets of this model, the second nearly all of it


def measure(steps: int = STEPS_PER_MODE, bucket_cap_mb: float = BUCKET_CAP_MB) -> Measurement:
    """Time both modes on :data:`WORLD_SIZE` gloo ranks; a step's time is its slowest rank's."""
    per_rank = launch.run(programs.time_steps, WORLD_SIZE,
                          args=(TIMED_CONFIG, steps, BATCH, SEQ, bucket_cap_mb), backend_name="gloo")
    rows = []
    for mode in ("overlap", "after", "torch"):
        step_s = [max(r["times"][mode][i] for r in per_rank) for i in range(steps)]
        trace = per_rank[0]["traces"].get(mode)  # torch's reducer is not traced
        rows.append({"mode": mode, "step_ms": 1e3 * statistics.median(step_s),
                     "steps_ms": [1e3 * s for s in step_s],
                     "backward_ms": None if trace is None else 1e3 * trace["backward_end"],
                     "exposed_comm_ms": None if trace is None else 1e3 * (trace["synced"] - trace["backward_end"])})
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    config = {"model": TIMED_CONFIG, "world_size": WORLD_SIZE, "backend": "gloo", "batch": BATCH, "seq": SEQ,
              "bucket_cap_mb": bucket_cap_mb, "steps_per_mode": steps,
              "bucket_bytes": per_rank[0]["bucket_bytes"], "bucket_indices": per_rank[0]["bucket_indices"],
              "traces": per_rank[0]["traces"]}
    return Measurement(rows=rows, metric="step_ms", config=config,
                       goals=[Goal("step time after backward / overlapped (median, slowest rank)", ratio, ">=", 1.0)])


@benchmark("ddp.overlap", chapter="ddp",
           title="DDP step: bucket all-reduces overlapped with backward vs after it, and torch's DDP (2 gloo ranks)")
def ddp_overlap() -> Measurement:
    return measure()
