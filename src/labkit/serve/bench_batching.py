"""Benchmarks of chapter ``continuous-batching``, on the book's engine (:class:`labkit.serve.LLM`)
with the book's model at the Qwen3-0.6B shape, random weights, bf16 (the tiny model under
the interpreter).

- ``serve.batching``: one synthetic trace replayed with continuous and with static batching
  on the same engine, model and KV memory budget (:mod:`labkit.serve.driver`); every
  request's timeline, each step's tokens, and the goals: at least 3x the throughput and a
  lower median TTFT. Steps are timed by the driver, one by one, the device synchronised.
- ``serve.preemption``: the two prices of preempting a sequence of ``n`` tokens, measured:
  recomputing them (the engine's prefill step of ``n`` tokens) against swapping their KV
  blocks to the CPU and back (:class:`~labkit.serve.swap.SwapSpace`), beside the
  host-device copy bandwidth of one contiguous pinned buffer measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .. import backend, ceilings
from ..benchmarks import Measurement, benchmark, progress
from ..results import Goal
from .bench_engine import BLOCK_SIZE, DTYPE, MODEL_CONFIG, MODEL_NAME, engine_model
from .driver import replay, static_batch_size
from .engine import LLM
from .sampler import SamplingParams
from .swap import SwapSpace
from .trace import synthetic_trace

def timed_s(fn: Callable[[], object]) -> float:
    """Seconds of one call, the device idle before and drained after (engine steps change the
    engine's state, so they are timed one by one rather than repeated)."""
    if backend.on_gpu():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if backend.on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# The trace both batchings serve: log-uniform prompts and outputs (a long tail, as in chat
# traces), Poisson arrivals faster than either can serve (so the comparison is of capacity),
# a few requests cancelled by their client. The KV budget is what a static cache needs for
# STATIC_BATCH requests of the worst-case length.
TRACE = backend.pick(
    cpu=dict(num_requests=8, prompt_lens=(4, 16), output_lens=(2, 10), rate_per_s=400.0,
             cancel_fraction=0.05, cancel_after_s=(0.05, 0.2)),
    gpu=dict(num_requests=128, prompt_lens=(16, 1024), output_lens=(8, 384), rate_per_s=200.0,
             cancel_fraction=0.05, cancel_after_s=(1.0, 5.0)),
)
STATIC_BATCH = backend.pick(cpu=3, gpu=16)
CONTINUOUS = dict(max_num_seqs=backend.pick(cpu=16, gpu=256), max_num_batched_tokens=backend.pick(cpu=64, gpu=2048),
                  chunked_prefill=True)


@benchmark("serve.batching", chapter="continuous-batching",
           title="Continuous (iteration-level) against static batching: one trace, one engine, one KV budget")
@torch.no_grad()
def bench_batching() -> Measurement:
    model = engine_model()
    trace = synthetic_trace(vocab_size=MODEL_CONFIG.vocab_size, seed=0, **TRACE)
    max_prompt = TRACE["prompt_lens"][1]
    max_len = max_prompt + TRACE["output_lens"][1]
    num_blocks = STATIC_BATCH * -(-max_len // BLOCK_SIZE)
    assert static_batch_size(num_blocks, BLOCK_SIZE, max_len) == STATIC_BATCH
    engines = {
        "continuous": LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_len, **CONTINUOUS),
        "static": LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_len,
                      max_num_seqs=STATIC_BATCH, max_num_batched_tokens=max(STATIC_BATCH * max_prompt, max_len)),
    }
    # One short warm-up replay each, so neither pays for first-call costs (allocator, kernels' compilation).
    warmup = synthetic_trace(4, vocab_size=MODEL_CONFIG.vocab_size, prompt_lens=(2, max_prompt),
                             output_lens=(2, 4), seed=1)
    rows, summaries, steps = [], {}, {}
    for name, llm in progress(engines.items(), "serve.batching replays"):
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


PREEMPTED_TOKENS = backend.pick(cpu=[16, 40], gpu=[256, 1024, 4096, 16384])
PREEMPTION_REPS = backend.pick(cpu=1, gpu=5)


def _copy_gbps(nbytes: int, to_device: bool) -> float:
    """Host-device copy bandwidth of one contiguous pinned buffer of ``nbytes``, GB/s (median)."""
    pinned = backend.on_gpu()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    device = torch.empty(nbytes, dtype=torch.uint8, device=backend.device())
    copy = (lambda: device.copy_(host, non_blocking=True)) if to_device else (lambda: host.copy_(device, non_blocking=True))
    copy()
    return nbytes / statistics.median(timed_s(copy) for _ in range(PREEMPTION_REPS)) / 1e9


@benchmark("serve.preemption", chapter="continuous-batching",
           title="Preempting n tokens: recompute (a prefill step) against swap (KV blocks to the CPU and back)")
@torch.no_grad()
def bench_preemption() -> Measurement:
    model = engine_model()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in PREEMPTED_TOKENS:
        blocks = -(-tokens // BLOCK_SIZE)
        llm = LLM(model, num_blocks=blocks + 1, block_size=BLOCK_SIZE, max_num_seqs=1, max_num_batched_tokens=tokens + 1,
                  max_model_len=tokens + 1)
        recompute = []
        for rep in range(PREEMPTION_REPS + 1):
            llm.add_request(torch.randint(0, MODEL_CONFIG.vocab_size, (tokens,), generator=gen).tolist(),
                            SamplingParams(max_tokens=1))
            took = timed_s(llm.step)  # the readmitted sequence's prefill: what recompute costs
            if rep:  # the first is a warm-up
                recompute.append(took)
        store = SwapSpace(llm.kv, blocks)
        out_pairs = list(zip(range(blocks), range(blocks)))
        store.swap_out(llm.kv, out_pairs)  # warm-up
        swap_out = statistics.median(timed_s(lambda: store.swap_out(llm.kv, out_pairs)) for _ in range(PREEMPTION_REPS))
        swap_in = statistics.median(timed_s(lambda: store.swap_in(llm.kv, out_pairs)) for _ in range(PREEMPTION_REPS))
        kv_bytes = blocks * BLOCK_SIZE * MODEL_CONFIG.kv_bytes_per_token(torch.finfo(DTYPE).bits // 8)
        h2d, d2h = _copy_gbps(kv_bytes, to_device=True), _copy_gbps(kv_bytes, to_device=False)
        recompute_s = statistics.median(recompute)
        rows.append({"tokens": tokens, "kv_bytes": kv_bytes, "recompute_ms": recompute_s * 1e3,
                     "swap_out_ms": swap_out * 1e3, "swap_in_ms": swap_in * 1e3, "swap_ms": (swap_out + swap_in) * 1e3,
                     "swap_out_gbps": kv_bytes / swap_out / 1e9, "swap_in_gbps": kv_bytes / swap_in / 1e9,
                     "pinned_d2h_gbps": d2h, "pinned_h2d_gbps": h2d,
                     "ours/limit": (kv_bytes / d2h + kv_bytes / h2d) / 1e9 / (swap_out + swap_in),
                     "recompute/swap": recompute_s / (swap_out + swap_in)})
    return Measurement(
        rows=rows, metric="ms to preempt and restore n tokens; ours/limit = the swap's time at the pinned "
                          "copy bandwidth / the swap's time",
        config={"model": MODEL_NAME, "model_config": repr(MODEL_CONFIG), "dtype": str(DTYPE).replace("torch.", ""),
                "block_size": BLOCK_SIZE, "reps": PREEMPTION_REPS,
                "recompute": "LLM.step() of one sequence's n-token prefill (what readmission after recompute runs)",
                "swap": "SwapSpace.swap_out then swap_in of the sequence's blocks (indexed copies, every layer)",
                "limit": "one contiguous pinned host buffer of the same bytes copied each way (non_blocking)"},
    )
