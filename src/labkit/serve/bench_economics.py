"""Benchmark of chapter ``inference-economics``, on the book's engine (:class:`labkit.serve.LLM`)
with the book's model at the Qwen3-0.6B shape, random weights, bf16 (the tiny model under
the interpreter).

``serve.step_roofline``: engine steps timed by phase and size, a prefill of one sequence by
its tokens and a decode step by its batch, beside their FLOPs and bytes
(:func:`labkit.serve.economics.step_flops_bytes`) and the ceilings measured in the same run.
Engine steps change the engine's state, so they are timed one by one (the device
synchronised before and after each, wall clock), not by :func:`labkit.timing.measure`'s
repetitions; medians over several steps of the same shape.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from .. import backend, ceilings, profiling
from ..benchmarks import Measurement, benchmark
from .bench_batching import timed_s
from .bench_engine import BLOCK_SIZE, DTYPE, MODEL_CONFIG, MODEL_NAME, engine_model
from . import economics
from .engine import LLM
from .sampler import SamplingParams


PREFILL_TOKENS = backend.pick(cpu=[8, 32, 96], gpu=[16, 64, 256, 1024, 4096])
DECODE_BATCHES = backend.pick(cpu=[1, 2, 8], gpu=[1, 4, 16, 64, 256])
DECODE_CONTEXT = backend.pick(cpu=32, gpu=1024)
TIMED_STEPS = backend.pick(cpu=3, gpu=10)


@benchmark("serve.step_roofline", chapter="inference-economics",
           title="Engine steps of the book's model at the Qwen3-0.6B shape: prefill by tokens, decode by batch; "
                 "time, arithmetic intensity and the roofline floor")
@torch.no_grad()
def bench_step_roofline() -> Measurement:
    model = engine_model()
    limits = ceilings.limits()
    gen = torch.Generator().manual_seed(0)
    vocab = MODEL_CONFIG.vocab_size
    rows = []

    def device_ms(step: Callable[[], object]) -> float:
        """The kernels' own time in one more step (a profile): what is left of the step is the host's."""
        return sum(k.us for k in profiling.kernels_run(step)) / 1e3

    def add_row(phase: str, batch: int, new_tokens: int, context: int, seconds: list[float], busy_ms: float) -> None:
        cost = economics.step_flops_bytes(MODEL_CONFIG, batch=batch, new_tokens=new_tokens, context=context,
                                bytes_per_element=torch.finfo(DTYPE).bits // 8)
        step_s = statistics.median(seconds)
        floor_s = economics.floor_s(cost, limits["matmul_bf16_tflops"], limits["read_tbps"])
        rows.append({"phase": phase, "batch": batch, "new_tokens": new_tokens, "context": context,
                     "tokens": batch * new_tokens, "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                     "flops": cost.flops, "bytes": cost.bytes, "intensity": cost.intensity,
                     "tflops": cost.flops / step_s / 1e12, "tbps": cost.bytes / step_s / 1e12,
                     "tokens_per_s": batch * (1 if phase == "decode" else new_tokens) / step_s,
                     "ours/limit": floor_s / step_s, "device_ms": busy_ms,
                     "device/step": busy_ms / (step_s * 1e3)})

    for tokens in PREFILL_TOKENS:
        llm = LLM(model, num_blocks=-(-tokens // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE, max_num_seqs=1,
                  max_model_len=tokens + 1,
                  max_num_batched_tokens=tokens + 1)
        seconds = []
        for rep in range(TIMED_STEPS + 1):
            llm.add_request(torch.randint(0, vocab, (tokens,), generator=gen).tolist(), SamplingParams(max_tokens=1))
            took = timed_s(llm.step)
            if rep:  # the first is a warm-up
                seconds.append(took)
        llm.add_request(torch.randint(0, vocab, (tokens,), generator=gen).tolist(), SamplingParams(max_tokens=1))
        add_row("prefill", 1, tokens, 0, seconds, device_ms(llm.step))
    for batch in DECODE_BATCHES:
        # The prompts prefill in chunks; sequences done early decode meanwhile, so the budget of
        # tokens covers those steps, the warm-up and the timed ones (the timing stops before any finishes).
        chunk = min(batch * DECODE_CONTEXT, backend.pick(cpu=4 * DECODE_CONTEXT, gpu=16384))
        max_tokens = -(-batch * DECODE_CONTEXT // chunk) + TIMED_STEPS + 4
        llm = LLM(model, num_blocks=batch * -(-(DECODE_CONTEXT + max_tokens) // BLOCK_SIZE), block_size=BLOCK_SIZE,
                  max_model_len=DECODE_CONTEXT + max_tokens,
                  max_num_seqs=batch, max_num_batched_tokens=chunk, chunked_prefill=True)
        for _ in range(batch):
            llm.add_request(torch.randint(0, vocab, (DECODE_CONTEXT,), generator=gen).tolist(),
                            SamplingParams(max_tokens=max_tokens))
        while llm.scheduler.waiting or any(s.num_tokens - s.num_cached > 1 for s in llm.scheduler.running):
            llm.step()
        for _ in range(2):
            timed_s(llm.step)  # warm-up decode steps
        context = round(statistics.fmean(s.num_cached for s in llm.scheduler.running))
        seconds = [timed_s(llm.step) for _ in range(TIMED_STEPS)]
        add_row("decode", batch, 1, context, seconds, device_ms(llm.step))
    return Measurement(
        rows=rows, metric="ms per engine step; intensity in FLOP/byte; ours/limit = roofline floor / step time",
        limits=limits,
        config={"model": MODEL_NAME, "model_config": repr(MODEL_CONFIG), "dtype": str(DTYPE).replace("torch.", ""),
                "weights": "random", "block_size": BLOCK_SIZE, "timed_steps": TIMED_STEPS,
                "decode_context": DECODE_CONTEXT,
                "floor": "max(FLOPs / measured bf16 matmul rate, bytes / measured read bandwidth)",
                "step": "LLM.step(): schedule, inputs, forward, sample, update (wall clock, device synchronised)",
                "device_ms": "the kernels' summed time in one further step, under torch.profiler (on a CPU: "
                             "torch operators' CPU time)"},
    )
