"""Benchmark of chapter ``continuous-batching``, on the book's engine (:class:`labkit.serve.LLM`)
with the book's model at the Qwen3-0.6B shape, random weights, bf16 (the tiny model under
the interpreter).

``serve.batching``: one synthetic trace replayed with continuous and with static batching
on the same engine, model and KV memory budget (:mod:`labkit.serve.driver`); every
request's timeline, each step's tokens, and the goals: at least 3x the throughput and a
lower median TTFT. Steps are timed by the driver, one by one, the device synchronised.
"""

from __future__ import annotations

import torch

from .. import backend, ceilings, models
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from .driver import replay, static_batch_size
from .engine import LLM
from .trace import synthetic_trace

MODEL_NAME = backend.pick(cpu="TINY", gpu="Qwen3-0.6B")
MODEL_CONFIG = backend.pick(cpu=models.TINY, gpu=models.QWEN3_SIZES["Qwen3-0.6B"])
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
BLOCK_SIZE = 16


def serving_model() -> models.Decoder:
    """The benchmarks' model: random weights (speed does not depend on their values)."""
    return models.Decoder(MODEL_CONFIG, dtype=DTYPE, device=backend.device(), seed=0)


# The trace both batchings serve: log-uniform prompts and outputs (a long tail, as in chat
# traces), Poisson arrivals faster than either can serve (so the comparison is of capacity),
# a few requests cancelled by their client. The KV budget is what a static cache needs for
# STATIC_BATCH requests of the worst-case length.
TRACE = backend.pick(
    cpu=dict(num_requests=24, prompt_lens=(4, 40), output_lens=(2, 32), rate_per_s=400.0,
             cancel_fraction=0.05, cancel_after_s=(0.05, 0.2)),
    gpu=dict(num_requests=256, prompt_lens=(16, 1024), output_lens=(8, 384), rate_per_s=200.0,
             cancel_fraction=0.05, cancel_after_s=(1.0, 5.0)),
)
STATIC_BATCH = backend.pick(cpu=3, gpu=16)
CONTINUOUS = dict(max_num_seqs=backend.pick(cpu=16, gpu=256), max_num_batched_tokens=backend.pick(cpu=64, gpu=2048),
                  chunked_prefill=True)


@benchmark("serve.batching", chapter="continuous-batching",
           title="Continuous (iteration-level) against static batching: one trace, one engine, one KV budget")
@torch.no_grad()
def bench_batching() -> Measurement:
    model = serving_model()
    trace = synthetic_trace(vocab_size=MODEL_CONFIG.vocab_size, seed=0, **TRACE)
    max_prompt = TRACE["prompt_lens"][1]
    max_len = max_prompt + TRACE["output_lens"][1]
    num_blocks = STATIC_BATCH * -(-max_len // BLOCK_SIZE)
    assert static_batch_size(num_blocks, BLOCK_SIZE, max_len) == STATIC_BATCH
    engines = {
        "continuous": LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, **CONTINUOUS),
        "static": LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=STATIC_BATCH,
                      max_num_batched_tokens=max(STATIC_BATCH * max_prompt, max_len)),
    }
    # One short warm-up replay each, so neither pays for first-call costs (allocator, kernels' compilation).
    warmup = synthetic_trace(4, vocab_size=MODEL_CONFIG.vocab_size, prompt_lens=(2, max_prompt),
                             output_lens=(2, 4), seed=1)
    rows, summaries, steps = [], {}, {}
    for name, llm in engines.items():
        kwargs = dict(batching="static", static_batch_size=STATIC_BATCH) if name == "static" else {}
        replay(llm, warmup, **kwargs)
        result = replay(llm, trace, **kwargs)
        summaries[name] = result.summary() | {"mean_in_system": result.mean_in_system()}
        rows += [{"batching": name, **t.row()} for t in result.timelines]
        steps[name] = {"end_s": [s.end_s for s in result.steps],
                       "prefill_tokens": [s.prefill_tokens for s in result.steps],
                       "decode_tokens": [s.decode_tokens for s in result.steps],
                       "output_tokens": [s.output_tokens for s in result.steps],
                       "in_system": [s.in_system for s in result.steps],
                       "preempted": [s.preempted for s in result.steps]}
    speedup = summaries["continuous"]["throughput_tok_s"] / summaries["static"]["throughput_tok_s"]
    ttft_ratio = summaries["continuous"]["ttft_p50_s"] / summaries["static"]["ttft_p50_s"]
    return Measurement(
        rows=rows, metric="seconds on the replay's clock (engine steps' measured wall time); tokens per second",
        limits=ceilings.limits(),
        # "Lower median TTFT": the ratio must be below one (Goal has no strict "<").
        goals=[Goal("throughput, continuous / static", speedup, ">=", 3.0),
               Goal("median TTFT, continuous / static", ttft_ratio, "<=", 0.999)],
        config={"model": MODEL_NAME, "model_config": repr(MODEL_CONFIG), "dtype": str(DTYPE).replace("torch.", ""),
                "weights": "random", "trace": {k: list(v) if isinstance(v, tuple) else v for k, v in TRACE.items()},
                "trace_seed": 0, "block_size": BLOCK_SIZE, "num_blocks": num_blocks,
                "kv_budget_tokens": num_blocks * BLOCK_SIZE, "static_batch_size": STATIC_BATCH,
                "static_reserves_tokens": max_len, "continuous": CONTINUOUS,
                "summaries": summaries, "steps": steps},
    )
