"""The chapter's benchmark: the bytes each strategy put on a rank's links in one training step,
counted on gloo ranks, against :mod:`labkit.parallel.planner`'s formulas.

It runs on the CPU on any machine (gloo): the issue asks for the communication volume per
step measured on the CPU runs. Bytes do not depend on the machine, so the goal is exact
agreement. Multi-GPU timings belong to the multi-GPU chapters.
"""

from __future__ import annotations

import dataclasses

from ..benchmarks import Measurement, benchmark
from ..collectives import launch
from ..models import TINY, DecoderConfig
from ..results import Goal
from . import planner, programs

# TINY's shapes with 4 layers (a pipeline stage each) and 4 K/V heads (a TP rank each).
MODEL = dataclasses.asdict(dataclasses.replace(TINY, num_layers=4, num_kv_heads=4))
WORLD_SIZE, ROWS, SEQ, MICROBATCHES, CHUNKS = 4, 2, 16, 8, 2
RING = dict(rows=2, heads=TINY.num_heads, kv_heads=TINY.num_kv_heads, seq=32, head_dim=TINY.head_dim)
FP32 = 4


def measure() -> Measurement:
    """One step of each strategy on :data:`WORLD_SIZE` gloo ranks; bytes per rank (pipelines: all ranks)."""
    calls = [("tensor_parallel_step", (MODEL, ROWS, SEQ, False)), ("tensor_parallel_step", (MODEL, ROWS, SEQ, True)),
             ("pipeline_step", (MODEL, "1f1b", MICROBATCHES, 1, ROWS, SEQ)),
             ("pipeline_step", (dict(MODEL, num_layers=4 * CHUNKS), "interleaved", MICROBATCHES, CHUNKS, ROWS, SEQ)),
             ("ring_attention_check", (*RING.values(), "zigzag")), ("data_parallel_step", (MODEL, ROWS, SEQ))]
    per_rank = launch.run(programs.run_many, WORLD_SIZE, args=(calls,), backend_name="gloo", timeout_s=300)
    tp, sp, one_f_one_b, interleaved, ring, dp = ([r[i] for r in per_rank] for i in range(len(calls)))
    shape, tokens, n = planner.ModelShape.of(DecoderConfig(**MODEL)), ROWS * SEQ, WORLD_SIZE
    ring_shape = planner.ModelShape(1, 1, RING["heads"], RING["kv_heads"], RING["head_dim"], 1, 1)
    checks = [
        ("TP", "activation all-reduces", max(r["activation_link_bytes"] for r in tp),
         planner.tensor_parallel_bytes(shape, tokens, n, FP32)),
        ("TP", "partial q/k-norm gradients", max(r["grad_sync_link_bytes"] for r in tp),
         planner.tensor_parallel_partial_grad_bytes(shape, n, False, FP32)),
        ("TP + SP", "all-gathers and reduce-scatters", max(r["activation_link_bytes"] for r in sp),
         planner.tensor_parallel_bytes(shape, tokens, n, FP32)),
        ("TP + SP", "replicated parameters' gradients", max(r["grad_sync_link_bytes"] for r in sp),
         planner.tensor_parallel_partial_grad_bytes(shape, n, True, FP32)),
        ("PP 1F1B", "activations and gradients (sum of ranks)", sum(r["p2p_link_bytes"] for r in one_f_one_b),
         planner.pipeline_bytes(shape, tokens, MICROBATCHES, n, 1, FP32)),
        (f"PP interleaved x{CHUNKS}", "activations and gradients (sum of ranks)",
         sum(r["p2p_link_bytes"] for r in interleaved), planner.pipeline_bytes(shape, tokens, MICROBATCHES, n, CHUNKS, FP32)),
        ("CP", "ring attention K/V, forward of one layer", max(r["link_bytes"] for r in ring),
         planner.ring_attention_forward_bytes(ring_shape, RING["rows"] * RING["seq"], n, FP32)),
        ("DP", "gradient all-reduce (labkit.ddp buckets)", max(r["link_bytes"] for r in dp),
         planner.data_parallel_bytes(dp[0]["params"], n, FP32)),
    ]
    rows = [{"strategy": s, "traffic": what, "measured_bytes": got, "formula_bytes": want, "measured/formula": got / want}
            for s, what, got, want in checks]
    worst = max(abs(row["measured/formula"] - 1) for row in rows)
    config = {"model": MODEL, "world_size": n, "backend": "gloo", "rows": ROWS, "seq": SEQ,
              "microbatches": MICROBATCHES, "chunks": CHUNKS, "ring": RING, "bytes_per_element": FP32}
    return Measurement(rows=rows, metric="measured/formula", config=config,
                       goals=[Goal("largest |measured / formula - 1| over the strategies", worst, "<=", 1e-9)])


@benchmark("parallel.traffic", chapter="parallelism-strategies",
           title="Bytes per rank per training step of TP, TP+SP, PP, CP and DP on 4 gloo ranks, against the formulas")
def parallel_traffic() -> Measurement:
    return measure()
