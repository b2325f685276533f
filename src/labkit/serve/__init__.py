"""A small paged LLM inference engine on the book's model: continuous batching, one forward per step.

Each step's scheduled sequences (prefills, chunks of prefills and decodes together) are
packed into one flat batch and run through the model in one forward pass, attention
reading every sequence's K and V through its block table.

>>> from labkit import models, serve
>>> llm = serve.LLM(models.Decoder(models.TINY), num_blocks=64, block_size=8)
>>> outputs = llm.generate([[1, 2, 3], [4, 5]], serve.SamplingParams(max_tokens=8))
>>> outputs[0].tokens                      # the greedy continuation of the first prompt

One module per job, in the order a step runs through them:

- :mod:`~labkit.serve.scheduler`: waiting and running queues; decode-first admission by
  free blocks and step budgets; preemption by recompute or swap; optional chunked prefill.
- :mod:`~labkit.serve.block_manager`: fixed-size KV blocks, reference counts, copy-on-write.
- :mod:`~labkit.serve.model_runner`: packs a step's tokens, runs the model once, CUDA graphs.
- :mod:`~labkit.serve.piecewise_graphs`: CUDA graphs of everything but attention, for steps with a prefill.
- :mod:`~labkit.serve.paged_cache`: the KV pool; :mod:`~labkit.serve.attention`: attention over it.
- :mod:`~labkit.serve.sampler`: greedy, temperature, top-k, top-p, batched; per-request seeds.
- :mod:`~labkit.serve.memory_budget`: how many KV blocks ``gpu_memory_utilization`` leaves.
- :mod:`~labkit.serve.engine`: the loop (optionally asynchronous: the next step queued before
  the last one's tokens are applied) and the ``LLM.generate`` API.
- :mod:`~labkit.serve.server`: an OpenAI-compatible streaming HTTP endpoint on localhost.
- :mod:`~labkit.serve.swap`: the CPU block store that preemption by swap copies to.
- :mod:`~labkit.serve.lora`: many LoRA adapters at once, each request with its own (BGMV, SGMV).
- :mod:`~labkit.serve.speculative`: draft-then-verify serving at batch 1 (:mod:`labkit.spec`).

Around the engine, for the chapters that measure it:

- :mod:`~labkit.serve.trace`: synthetic request traces (arrivals, lengths, cancellations).
- :mod:`~labkit.serve.driver`: a trace replayed through the public API, continuous or static batching.
- :mod:`~labkit.serve.metrics`: TTFT, TPOT, throughput, per-request timelines.
- :mod:`~labkit.serve.economics`: rooflines, Little's law, cost per token, GPU TCO.

Every public entry point checks its arguments; a request that can never be served
finishes with an error of its own and the engine serves the rest.
"""

from .block_manager import BlockManager, NoFreeBlocks
from .driver import Replay, replay, static_batch_size
from .engine import LLM, RequestOutput, StepTiming
from .memory_budget import MemoryBudget, kv_block_bytes, plan_memory, profile_memory, weight_bytes
from .metrics import RequestTimeline, summarize
from .model_runner import ModelRunner, PackedBatch, PagedBatchKV, capture_sizes
from .paged_cache import PagedKVCache, SequenceKV, gather_kv
from .piecewise_graphs import PiecewiseGraphs, token_sizes
from .sampler import SamplingParams, apply_top_k_top_p, sample, sample_batch, sample_tokens
from .scheduler import ScheduledStep, Scheduler, Sequence, Status
from .server import ByteTokenizer, CompletionServer
from .speculative import SpeculativeLLM
from .swap import SwapSpace
from .trace import TraceRequest, synthetic_trace
from . import server

__all__ = [
    "LLM", "BlockManager", "ByteTokenizer", "CompletionServer", "MemoryBudget", "ModelRunner", "NoFreeBlocks", "PackedBatch", "PagedBatchKV", "PagedKVCache",
    "PiecewiseGraphs", "RequestOutput", "SamplingParams", "ScheduledStep", "Scheduler", "Sequence", "SequenceKV", "SpeculativeLLM", "Status",
    "StepTiming",
    "apply_top_k_top_p", "capture_sizes", "gather_kv", "kv_block_bytes", "plan_memory", "profile_memory",
    "sample", "sample_batch", "sample_tokens", "token_sizes", "weight_bytes",
    "Replay", "RequestTimeline", "SwapSpace", "TraceRequest", "replay", "static_batch_size", "summarize",
    "synthetic_trace",
]
