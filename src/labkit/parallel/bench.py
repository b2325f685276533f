"""The chapter's benchmark: one training step of each strategy on gloo ranks, checked against one
process (our TP also against torch's ``parallelize_module``, our 1F1B against torch's
``Schedule1F1B``), and the bytes each put on a rank's links against :mod:`labkit.parallel.planner`'s formulas.

It runs on the CPU on any machine (gloo): the issue asks for the communication volume per
step measured on the CPU runs. Bytes do not depend on the machine, so the goal is exact
agreement; the correctness checks (:mod:`labkit.parallel.verify`) raise if any loss,
gradient or output is off. The record keeps, besides the traffic rows, each check's
largest relative error, the micro-batches each pipeline rank stashed, the wall-clock
timeline each rank ran, the causal work of each ring-attention rank, and the activations
saved for backward. Multi-GPU timings belong to the multi-GPU chapters.
"""

from __future__ import annotations

import dataclasses

from ..benchmarks import Measurement, benchmark
from ..collectives import launch
from ..models import TINY, Decoder, DecoderConfig, lm_loss
from ..results import Goal
from . import planner, programs, verify

# TINY's shapes with 4 layers (a pipeline stage each) and 4 K/V heads (a TP rank each);
# the interleaved pipeline gets 8 layers, two chunks of one layer per rank.
MODEL = dataclasses.asdict(dataclasses.replace(TINY, num_layers=4, num_kv_heads=4))
WORLD_SIZE, ROWS, SEQ, MICROBATCHES, CHUNKS = 4, 2, 12, 4, 2
INTERLEAVED_MODEL = dict(MODEL, num_layers=4 * CHUNKS)
RING = dict(rows=2, heads=TINY.num_heads, kv_heads=TINY.num_kv_heads, seq=24, head_dim=TINY.head_dim)
FP32 = 4
PIPELINES = (("gpipe", MODEL, 1), ("1f1b", MODEL, 1), ("interleaved", INTERLEAVED_MODEL, CHUNKS))
LAYOUTS = ("contiguous", "zigzag")


def _calls() -> list[tuple[str, tuple]]:
    calls = [("tensor_parallel_step", (MODEL, ROWS, SEQ, sp)) for sp in (False, True)]
    calls += [("pipeline_step", (config, name, MICROBATCHES, chunks, ROWS, SEQ)) for name, config, chunks in PIPELINES]
    calls += [("ring_attention_check", (*RING.values(), layout)) for layout in LAYOUTS]
    return calls + [("data_parallel_step", (MODEL, ROWS, SEQ)), ("torch_tensor_parallel_step", (MODEL, ROWS, SEQ)),
                    ("torch_pipeline_step", (MODEL, MICROBATCHES, ROWS, SEQ))]


def measure() -> Measurement:
    per_rank = launch.run(programs.run_many, WORLD_SIZE, args=(_calls(),), backend_name="gloo", timeout_s=300)
    results = [[r[i] for r in per_rank] for i in range(len(per_rank[0]))]
    tp, sp, gpipe, one_f_one_b, interleaved, ring_contiguous, ring_zigzag, dp, torch_tp, torch_pp = results
    n, tokens = WORLD_SIZE, ROWS * SEQ
    shape = planner.ModelShape.of(DecoderConfig(**MODEL))

    checks = {"TP": verify.tensor_parallel(tp, MODEL, ROWS, SEQ), "TP + SP": verify.tensor_parallel(sp, MODEL, ROWS, SEQ),
              "TP vs torch parallelize_module": verify.against_torch(tp, torch_tp)}
    events = {}
    for (name, config, chunks), ranks in zip(PIPELINES, (gpipe, one_f_one_b, interleaved)):
        checks[f"PP {name}"] = verify.pipeline(ranks, config, name, MICROBATCHES, chunks, ROWS, SEQ)
        events[name] = [r["events"] for r in ranks]
    checks["PP 1f1b vs torch Schedule1F1B"] = verify.against_torch_pipeline(one_f_one_b, torch_pp)
    for layout, ranks in zip(LAYOUTS, (ring_contiguous, ring_zigzag)):
        checks[f"CP {layout}"] = verify.ring(ranks, *RING.values(), layout)

    ring_shape = planner.ModelShape(1, 1, RING["heads"], RING["kv_heads"], RING["head_dim"], 1, 1)
    traffic = [
        ("TP", "activation all-reduces", max(r["activation_link_bytes"] for r in tp),
         planner.tensor_parallel_bytes(shape, tokens, n, FP32)),
        ("TP", "partial q/k-norm gradients", max(r["grad_sync_link_bytes"] for r in tp),
         planner.tensor_parallel_partial_grad_bytes(shape, n, False, FP32)),
        ("TP + SP", "all-gathers and reduce-scatters", max(r["activation_link_bytes"] for r in sp),
         planner.tensor_parallel_bytes(shape, tokens, n, FP32)),
        ("TP + SP", "replicated parameters' gradients", max(r["grad_sync_link_bytes"] for r in sp),
         planner.tensor_parallel_partial_grad_bytes(shape, n, True, FP32)),
    ]
    for (name, config, chunks), ranks in zip(PIPELINES, (gpipe, one_f_one_b, interleaved)):
        traffic.append((f"PP {name}", "activations and gradients, sum of ranks", sum(r["p2p_link_bytes"] for r in ranks),
                        planner.pipeline_bytes(planner.ModelShape.of(DecoderConfig(**config)), tokens, MICROBATCHES, n,
                                               chunks, FP32)))
    traffic += [
        ("CP", "ring attention K/V, forward of one layer", max(r["link_bytes"] for r in ring_zigzag),
         planner.ring_attention_forward_bytes(ring_shape, RING["rows"] * RING["seq"], n, FP32)),
        ("DP", "gradient all-reduce (labkit.ddp buckets)", max(r["link_bytes"] for r in dp),
         planner.data_parallel_bytes(dp[0]["params"], n, FP32)),
    ]
    rows = [{"strategy": s, "traffic": what, "measured_bytes": got, "formula_bytes": want, "measured/formula": got / want}
            for s, what, got, want in traffic]

    single = Decoder(DecoderConfig(**MODEL), seed=0, init_std=0.1)
    _, single_saved = programs.saved_activation_bytes(lm_loss, single, programs.batch(MODEL["vocab_size"], ROWS, SEQ, 0))
    config = {"model": MODEL, "world_size": n, "backend": "gloo", "rows": ROWS, "seq": SEQ,
              "microbatches": MICROBATCHES, "chunks": CHUNKS, "ring": RING, "bytes_per_element": FP32,
              "checks": checks, "pipeline_events": events,
              "saved_bytes": {"one process": single_saved, "TP": tp[0]["saved_bytes"], "TP + SP": sp[0]["saved_bytes"]},
              "tp_calls": {"TP": tp[0]["calls"], "TP + SP": sp[0]["calls"]}}
    worst_bytes = max(abs(row["measured/formula"] - 1) for row in rows)
    worst_grad = max(c.get("grad_rel_error", c.get("out_rel_error", 0.0)) for c in checks.values())
    return Measurement(rows=rows, metric="measured/formula", config=config,
                       goals=[Goal("largest |measured / formula - 1| of the bytes per step", worst_bytes, "<=", 1e-9),
                              Goal("largest relative error of a gradient or output against one process", worst_grad,
                                   "<=", 1e-5)])


@benchmark("parallel.strategies", chapter="parallelism-strategies",
           title="One step of TP, TP+SP, PP (GPipe, 1F1B, interleaved), CP and DP on 4 gloo ranks: "
                 "checked against one process, bytes per rank against the formulas")
def parallel_strategies() -> Measurement:
    return measure()
