"""Benchmarks of Part III's serving chapters, on the book's engine (:class:`labkit.serve.LLM`)
with the book's model at the Qwen3-0.6B shape, random weights, bf16 (the tiny model under
the interpreter).

- ``serve.batching`` (chapter ``continuous-batching``): one synthetic trace replayed with
  continuous and with static batching on the same engine, model and KV memory budget;
  every request's timeline, and the goals: at least 3x the throughput, a lower median TTFT.
- ``serve.step_roofline`` (chapter ``inference-economics``): engine steps timed by phase
  and size, a prefill of one sequence by its tokens and a decode step by its batch, beside
  their FLOPs and bytes (:func:`labkit.serve.economics.step_flops_bytes`) and the
  ceilings measured in the same run.

Engine steps change the engine's state, so they are timed one by one (the device
synchronised before and after each, wall clock), not by :func:`labkit.timing.measure`'s
repetitions; medians over several steps of the same shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import backend, ceilings, models
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from .economics import step_flops_bytes
from .engine import LLM
from .driver import replay, static_batch_size
from .sampler import SamplingParams
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
    gpu=dict(num_requests=128, prompt_lens=(16, 1024), output_lens=(8, 384), rate_per_s=64.0,
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


def _timed_step(llm: LLM) -> float:
    """One engine step's wall time in seconds, the device idle before and after."""
    if backend.on_gpu():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.step()
    if backend.on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


PREFILL_TOKENS = backend.pick(cpu=[8, 32, 96], gpu=[16, 64, 256, 1024, 4096])
DECODE_BATCHES = backend.pick(cpu=[1, 2, 8], gpu=[1, 4, 16, 64, 256])
DECODE_CONTEXT = backend.pick(cpu=32, gpu=1024)
TIMED_STEPS = backend.pick(cpu=3, gpu=10)


@benchmark("serve.step_roofline", chapter="inference-economics",
           title="Engine steps of the book's model at the Qwen3-0.6B shape: prefill by tokens, decode by batch; "
                 "time, arithmetic intensity and the roofline floor")
@torch.no_grad()
def bench_step_roofline() -> Measurement:
    model = serving_model()
    limits = ceilings.limits()
    gen = torch.Generator().manual_seed(0)
    vocab = MODEL_CONFIG.vocab_size
    rows = []

    def add_row(phase: str, batch: int, new_tokens: int, context: int, seconds: list[float]) -> None:
        cost = step_flops_bytes(MODEL_CONFIG, batch=batch, new_tokens=new_tokens, context=context,
                                bytes_per_element=torch.finfo(DTYPE).bits // 8)
        step_s = statistics.median(seconds)
        floor_s = cost.floor_s(limits["matmul_bf16_tflops"], limits["read_tbps"])
        rows.append({"phase": phase, "batch": batch, "new_tokens": new_tokens, "context": context,
                     "tokens": batch * new_tokens, "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                     "flops": cost.flops, "bytes": cost.bytes, "intensity": cost.intensity,
                     "tflops": cost.flops / step_s / 1e12, "tbps": cost.bytes / step_s / 1e12,
                     "tokens_per_s": batch * (1 if phase == "decode" else new_tokens) / step_s,
                     "ours/limit": floor_s / step_s})

    for tokens in PREFILL_TOKENS:
        llm = LLM(model, num_blocks=-(-tokens // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE, max_num_seqs=1,
                  max_num_batched_tokens=tokens + 1)
        seconds = []
        for rep in range(TIMED_STEPS + 1):
            llm.add_request(torch.randint(0, vocab, (tokens,), generator=gen).tolist(), SamplingParams(max_tokens=1))
            took = _timed_step(llm)
            if rep:  # the first is a warm-up
                seconds.append(took)
        add_row("prefill", 1, tokens, 0, seconds)
    for batch in DECODE_BATCHES:
        # The prompts prefill in chunks; sequences done early decode meanwhile, so the budget of
        # tokens covers those steps, the warm-up and the timed ones (the timing stops before any finishes).
        chunk = min(batch * DECODE_CONTEXT, backend.pick(cpu=4 * DECODE_CONTEXT, gpu=16384))
        max_tokens = -(-batch * DECODE_CONTEXT // chunk) + TIMED_STEPS + 4
        llm = LLM(model, num_blocks=batch * -(-(DECODE_CONTEXT + max_tokens) // BLOCK_SIZE), block_size=BLOCK_SIZE,
                  max_num_seqs=batch, max_num_batched_tokens=chunk, chunked_prefill=True)
        for _ in range(batch):
            llm.add_request(torch.randint(0, vocab, (DECODE_CONTEXT,), generator=gen).tolist(),
                            SamplingParams(max_tokens=max_tokens))
        while llm.scheduler.waiting or any(len(s.tokens) - s.num_cached > 1 for s in llm.scheduler.running):
            llm.step()
        for _ in range(2):
            _timed_step(llm)  # warm-up decode steps
        context = round(statistics.fmean(s.num_cached for s in llm.scheduler.running))
        seconds = [_timed_step(llm) for _ in range(TIMED_STEPS)]
        add_row("decode", batch, 1, context, seconds)
    return Measurement(
        rows=rows, metric="ms per engine step; intensity in FLOP/byte; ours/limit = roofline floor / step time",
        limits=limits,
        config={"model": MODEL_NAME, "model_config": repr(MODEL_CONFIG), "dtype": str(DTYPE).replace("torch.", ""),
                "weights": "random", "block_size": BLOCK_SIZE, "timed_steps": TIMED_STEPS,
                "decode_context": DECODE_CONTEXT,
                "floor": "max(FLOPs / measured bf16 matmul rate, bytes / measured read bandwidth)",
                "step": "LLM.step(): schedule, inputs, forward, sample, update (wall clock, device synchronised)"},
    )
