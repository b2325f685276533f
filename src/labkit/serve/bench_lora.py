"""Benchmark of chapter ``lora-family``: many adapters served by the engine at once.

``serve.multi_lora`` serves one trace (the same prompts and output lengths) through
:class:`~labkit.serve.LLM` at the Qwen3-0.6B shape (random weights, bf16; the tiny model
under the interpreter): once by an engine without adapters, then by an engine with
``max_loras`` slots of rank 16 holding that many random adapters, its requests spread over
0 (all on the base model), 1, 8 and 32 of them round-robin. Output tokens per second, each
against the engine without adapters: what serving a batch of many fine-tunes costs over
serving the base model alone (Punica's claim is that it costs little more than one).
"""

from __future__ import annotations

import random

import torch

from .. import backend, timing
from ..benchmarks import Measurement, benchmark
from .bench_engine import BLOCK_SIZE, MODEL_CONFIG, MODEL_NAME, DTYPE, engine_model
from .engine import LLM
from .sampler import SamplingParams

CHAPTER = "lora-family"
RANK = 16
TRACE = backend.pick(cpu=dict(requests=2, prompt=4, output=2, max_loras=2, spreads=(0, 1, 2)),
                     gpu=dict(requests=64, prompt=128, output=64, max_loras=32, spreads=(0, 1, 8, 32)))


def random_adapter(llm: LLM, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Rank-16 weights for every adapted layer of ``llm``, ``A`` and ``B`` small and random (the
    speed does not depend on their values), scale ``alpha / r = 2``."""
    gen = torch.Generator(device=backend.device()).manual_seed(seed)
    weights = {}
    for name, layer in llm.adapters.layers.items():
        out_features, in_features = layer.base.weight.shape
        factory = dict(dtype=layer.base.weight.dtype, device=layer.base.weight.device, generator=gen)
        weights[name] = (torch.randn(RANK, in_features, **factory) * in_features**-0.5,
                         torch.randn(out_features, RANK, **factory) * 0.01, 2.0)
    return weights


@benchmark("serve.multi_lora", chapter=CHAPTER,
           title="Serving many LoRA adapters at once: the engine's output tokens per second with its requests "
                 "spread over 0 to 32 adapters of rank 16, against the engine without adapters (Qwen3-0.6B shape)")
@torch.no_grad()
def bench_multi_lora_engine() -> Measurement:
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL_CONFIG.vocab_size) for _ in range(TRACE["prompt"])]
               for _ in range(TRACE["requests"])]
    params = SamplingParams(max_tokens=TRACE["output"])
    max_model_len = TRACE["prompt"] + TRACE["output"]
    settings = dict(num_blocks=TRACE["requests"] * -(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                    max_num_seqs=TRACE["requests"], max_model_len=max_model_len,
                    attention=backend.pick(cpu="torch", gpu="triton"), cuda_graphs=backend.on_gpu())

    def tokens_per_s(llm: LLM, names: list[str | None]) -> float:
        if backend.on_gpu():
            llm.generate(prompts, params, lora=names)  # warm-up: kernels compile, cuBLAS chooses
        outputs, ms = timing.timed_call(lambda: llm.generate(prompts, params, lora=names))
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise RuntimeError(f"the engine refused benchmark requests: {errors[:2]}")
        return sum(len(o.tokens) for o in outputs) / ms * 1e3

    rows = []
    plain = tokens_per_s(LLM(engine_model(), **settings), [None] * len(prompts))
    rows.append({"engine": "no adapters (max_loras=0)", "adapters_in_batch": 0, "tokens_per_s": plain,
                 "vs_no_adapters": 1.0})
    llm = LLM(engine_model(), max_loras=TRACE["max_loras"], max_lora_rank=RANK, **settings)
    for slot in range(TRACE["max_loras"]):
        llm.add_lora(f"adapter{slot}", random_adapter(llm, seed=slot))
    for spread in TRACE["spreads"]:
        names = [None if spread == 0 else f"adapter{i % spread}" for i in range(len(prompts))]
        rate = tokens_per_s(llm, names)
        rows.append({"engine": f"max_loras={TRACE['max_loras']}", "adapters_in_batch": spread, "tokens_per_s": rate,
                     "vs_no_adapters": rate / plain})
    return Measurement(
        rows=rows, metric="output tokens per second of LLM.generate over the trace (greedy), and the ratio to the "
                          "engine without adapters",
        config={"model": MODEL_NAME, "dtype": str(DTYPE).replace("torch.", ""), "rank": RANK, **TRACE,
                "cuda_graphs": backend.on_gpu(),
                "note": "the engine without adapters stacks its projections (one q/k/v matmul); an engine with "
                        "adapters keeps them separate, so that each can add its own adapters"},
    )
