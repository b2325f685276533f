"""How many KV blocks fit: the memory budget, computed the way vLLM v1 computes it.

``gpu_memory_utilization`` is a fraction of the device's *total* memory, not of what is
free: the engine may use ``total * utilization`` bytes in all. Out of that come

- the weights (what loading the model allocated),
- the activation peak of a profiling run: one forward pass over the largest step the
  scheduler may ever form (``max_num_batched_tokens`` tokens over ``max_num_seqs``
  sequences) plus the sampler over ``max_num_seqs`` logits rows, measured as the rise of
  the allocator's peak,
- memory the process holds outside torch's allocator that grew meanwhile (CUDA
  context pieces, library workspaces; NCCL in a multi-GPU engine),

and the KV cache gets the rest, in whole blocks of ``2 * layers * block_size * kv_heads *
head_dim * dtype bytes`` each. This is vLLM's ``Worker.determine_available_memory`` with
its ``memory_profiling`` helper: ``requested_memory - (weights + torch_peak_increase +
non_torch_increase)``, and then ``available // page_size // num_layers`` blocks.
CUDA graphs are captured after the pool is allocated and are not in the sum: their
memory comes out of the ``1 - utilization`` left over. The piecewise graphs of steps with
a prefill keep the activations of a ``max_num_batched_tokens`` step in their own pool, which
can approach the profiling run's activation peak (not measured here).

:func:`plan_memory` is the arithmetic, on numbers given to it (the tests inject them);
:func:`profile_memory` measures them on a GPU and calls it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ..models import Decoder
from ..models.config import DecoderConfig
from ..validate import check_positive_int
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .sampler import SamplingParams, sample_batch
from .scheduler import Sequence


def kv_block_bytes(config: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: K and V of ``block_size`` tokens per layer."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    check_positive_int(block_size, "block_size")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


@dataclass(frozen=True)
class MemoryBudget:
    """The budget's terms, in bytes, and the blocks it leaves for the KV cache."""

    total: int
    gpu_memory_utilization: float
    weights: int
    activation_peak: int
    non_torch: int
    block_bytes: int

    @property
    def requested(self) -> int:
        """What the engine may use in all: ``total * gpu_memory_utilization``."""
        return int(self.total * self.gpu_memory_utilization)

    @property
    def non_kv_cache(self) -> int:
        return self.weights + self.activation_peak + self.non_torch

    @property
    def kv_cache(self) -> int:
        """Bytes left for the KV cache (what vLLM logs as 'Available KV cache memory')."""
        return self.requested - self.non_kv_cache

    @property
    def num_blocks(self) -> int:
        return self.kv_cache // self.block_bytes

    def table(self) -> list[tuple[str, int]]:
        """The budget as (term, bytes) rows, in the order it is computed."""
        return [("total", self.total), ("requested (total x utilization)", self.requested),
                ("weights", self.weights), ("activation peak", self.activation_peak),
                ("non-torch increase", self.non_torch), ("KV cache", self.kv_cache),
                ("KV cache used by whole blocks", self.num_blocks * self.block_bytes)]


def plan_memory(*, total: int, gpu_memory_utilization: float, weights: int, activation_peak: int,
                non_torch: int, block_bytes: int) -> MemoryBudget:
    """The budget for these measured terms; raises if it leaves no room for one block."""
    if (isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float))
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
    check_positive_int(total, "total")
    check_positive_int(block_bytes, "block_bytes")
    for name, value in (("weights", weights), ("activation_peak", activation_peak), ("non_torch", non_torch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    budget = MemoryBudget(total, float(gpu_memory_utilization), weights, activation_peak, non_torch, block_bytes)
    if budget.num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {gpu_memory_utilization} x {total} bytes = {budget.requested} requested, "
            f"but weights ({weights}), the activation peak ({activation_peak}) and non-torch memory "
            f"({non_torch}) take {budget.non_kv_cache}, leaving less than one block of {block_bytes} bytes; "
            f"raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights share one)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _non_torch_bytes(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) - torch.cuda.memory_reserved(device)


@torch.no_grad()
def profile_memory(model: Decoder, *, gpu_memory_utilization: float, block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int) -> MemoryBudget:
    """Measure the budget's terms on the model's GPU with a profiling run, then :func:`plan_memory`.

    The profiling run is the largest step the scheduler may form: ``max_num_batched_tokens``
    prompt tokens over ``min(max_num_seqs, max_num_batched_tokens)`` sequences, one packed
    forward, then the sampler over that many rows. Its K and V go to a scratch pool that
    exists before the peak is reset, so the peak's rise is activations alone.
    """
    device = model.embed.weight.device
    if device.type != "cuda":
        raise ValueError(f"profile_memory measures a CUDA device's memory; the model is on {device} "
                         f"(pass num_blocks instead)")
    check_positive_int(max_num_batched_tokens, "max_num_batched_tokens")
    num_seqs = min(check_positive_int(max_num_seqs, "max_num_seqs"), max_num_batched_tokens)
    gc.collect()
    torch.cuda.empty_cache()
    non_torch_before = _non_torch_bytes(device)

    per_seq = [max_num_batched_tokens // num_seqs + (i < max_num_batched_tokens % num_seqs) for i in range(num_seqs)]
    blocks_per_seq = [-(-n // block_size) for n in per_seq]
    scratch = PagedKVCache(model.config, sum(blocks_per_seq) + 1, block_size,
                           dtype=model.embed.weight.dtype, device=device)
    runner = ModelRunner(model, scratch, pad_block=sum(blocks_per_seq), max_num_seqs=num_seqs, cuda_graphs=False)
    seqs, next_block = [], 0
    for i, (n, nb) in enumerate(zip(per_seq, blocks_per_seq)):
        seq = Sequence(i, [0] * n, SamplingParams(temperature=1.0, top_k=50, top_p=0.9))
        seq.block_table, seq.num_new = list(range(next_block, next_block + nb)), n
        next_block += nb
        seqs.append(seq)
    batch = runner.prepare(seqs)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    logits = runner.forward(batch)
    sample_batch(logits, [s.params for s in seqs], [None] * num_seqs)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline
    del logits, batch, runner, scratch, seqs
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = plan_memory(total=total, gpu_memory_utilization=gpu_memory_utilization, weights=weight_bytes(model),
                         activation_peak=activation_peak,
                         non_torch=max(0, _non_torch_bytes(device) - non_torch_before),
                         block_bytes=kv_block_bytes(model.config, block_size, model.embed.weight.dtype))
    # vLLM refuses to start when less than the requested memory is free; here the weights are
    # already loaded, so what must still be free is the pool plus the activations' room.
    if budget.kv_cache + budget.activation_peak > free:
        raise ValueError(f"the budget wants {budget.kv_cache + budget.activation_peak} bytes for the KV cache and "
                         f"activations but only {free} are free on {device}: other tensors or processes hold "
                         f"memory; lower gpu_memory_utilization")
    return budget
