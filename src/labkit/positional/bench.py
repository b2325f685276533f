"""The length-extrapolation experiment as a benchmark: what the chapter plots and records.

Not a speed benchmark: the numbers it records are held-out next-byte losses by position,
for every scheme, evaluation length and seed, measured by training and reading the
models. Its goal is the claim the chapter leans on: that YaRN, applied at inference to
the RoPE-trained model, reads four times the trained length with a lower loss past the
trained length than RoPE as trained.
"""

from __future__ import annotations

import time

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..models import DecoderConfig
from ..models.text import VOCAB_SIZE
from ..results import Goal
from .extrapolation import ExtrapolationRun, run_extrapolation, summarize

# Small enough for the CPU: two layers of 4 query and 2 KV heads of 16, a few seconds per scheme.
CPU_RUN = ExtrapolationRun(
    model=DecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=176, rope_theta=10_000.0, tie_word_embeddings=True),
    train_length=32, steps=150, batch=16, lr=3e-3, seeds=(0,), eval_windows=16, bucket=4, finetune_steps=20,
)
# About three million weights: 4 layers of 8 query and 4 KV heads of 32, trained on 64
# windows of 256 bytes per step, three seeds per scheme; the RoPE model's fine-tunes at
# 1024 take a sixth as many steps on a quarter as many windows.
GPU_RUN = ExtrapolationRun(
    model=DecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                        head_dim=32, intermediate_size=704, rope_theta=10_000.0, tie_word_embeddings=True),
    train_length=256, steps=300, batch=64, lr=3e-3, seeds=(0, 1, 2), eval_windows=64, bucket=64,
    finetune_steps=50, finetune_batch=16,
)


@benchmark("positional.extrapolation", chapter="positional-encodings",
           title="Held-out loss by position when reading 1x, 2x and 4x the trained length, per position scheme")
def extrapolation() -> Measurement:
    run = backend.pick(cpu=CPU_RUN, gpu=GPU_RUN)
    t0 = time.perf_counter()
    out = run_extrapolation(run, device=backend.device())
    seconds = time.perf_counter() - t0
    longest = max(run.eval_lengths)
    at_longest = {s["scheme"]: s for s in summarize(out["rows"], run.train_length) if s["eval_length"] == longest}
    goals = []
    if {"rope", "yarn"} <= set(at_longest) and longest > run.train_length:
        ratio = at_longest["yarn"]["loss_beyond_train"] / at_longest["rope"]["loss_beyond_train"]
        goals.append(Goal(f"YaRN / RoPE held-out loss past the trained length, reading {longest // run.train_length}x",
                          ratio, "<=", 1.0))
    return Measurement(
        rows=out["rows"],
        metric="held-out next-byte cross-entropy (nats), mean over the windows, by position bucket",
        goals=goals,
        config={"run": run.to_dict(), "final_train_loss": out["final_train_loss"],
                "corpus_bytes": out["corpus_bytes"], "seconds": {**out["seconds"], "total": seconds}},
    )
