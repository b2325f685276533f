"""A small paged LLM inference engine on the book's model, scheduled per iteration.

Each step's scheduled sequences are chosen together (continuous batching's scheduling),
but each still runs its own forward pass in turn: one batched forward over all of a step's
sequences, with a paged attention kernel, is the next thing the Part III chapters build.

>>> from labkit import models, serve
>>> llm = serve.LLM(models.Decoder(models.TINY), num_blocks=64, block_size=8)
>>> outputs = llm.generate([[1, 2, 3], [4, 5]], serve.SamplingParams(max_tokens=8))
>>> outputs[0].tokens                      # the greedy continuation of the first prompt

One module per job, in the order a step runs through them:

- :mod:`~labkit.serve.scheduler`: waiting and running queues; decode-first admission by
  free blocks and step budgets; preemption by recompute or swap; optional chunked prefill.
- :mod:`~labkit.serve.block_manager`: fixed-size KV blocks, reference counts, copy-on-write.
- :mod:`~labkit.serve.paged_cache`: the KV pool and the attention path through a block table.
- :mod:`~labkit.serve.sampler`: greedy, temperature, top-k, top-p; per-request seeds.
- :mod:`~labkit.serve.engine`: the loop and the ``LLM.generate`` API.
- :mod:`~labkit.serve.swap`: the CPU block store that preemption by swap copies to.

Around the engine, for the chapters that measure it:

- :mod:`~labkit.serve.trace`: synthetic request traces (arrivals, lengths, cancellations).
- :mod:`~labkit.serve.driver`: a trace replayed through the public API, continuous or static batching.
- :mod:`~labkit.serve.metrics`: TTFT, TPOT, throughput, per-request timelines.
- :mod:`~labkit.serve.economics`: rooflines, Little's law, cost per token, GPU TCO.

Every public entry point checks its arguments; a request that can never be served
finishes with an error of its own and the engine serves the rest.
"""

from .block_manager import BlockManager, NoFreeBlocks
from .engine import LLM, RequestOutput
from .paged_cache import PagedKVCache, SequenceKV, gather_kv
from .sampler import SamplingParams, sample
from .metrics import RequestTimeline, summarize
from .driver import Replay, replay, static_batch_size
from .scheduler import ScheduledStep, Scheduler, Sequence, Status
from .swap import SwapSpace
from .trace import TraceRequest, synthetic_trace

__all__ = [
    "LLM", "BlockManager", "NoFreeBlocks", "PagedKVCache", "Replay", "RequestOutput", "RequestTimeline",
    "SamplingParams", "ScheduledStep", "Scheduler", "Sequence", "SequenceKV", "Status", "SwapSpace", "TraceRequest",
    "gather_kv", "replay", "sample", "static_batch_size", "summarize", "synthetic_trace",
]
