"""Iteration-level scheduling (Orca): which sequences run in the next model step.

The order is vLLM v1's. Every step the scheduler first keeps the running sequences
decoding (one token each), finding each a slot for its next token; when the pool has no
free block, it preempts the newest running sequence. By *recompute* (vLLM v1's only mode):
its blocks are freed and it goes back to the front of the waiting queue, to be prefilled
again (prompt and tokens so far) once blocks free up. By *swap* (vLLM v0's other mode):
its blocks' contents are copied to a CPU-side store (``swap_blocks``, a second
:class:`BlockManager` that numbers the CPU blocks) before they are freed, and it waits in
the *swapped* queue; once enough blocks are free it is copied back and carries on where it
stopped, with no token recomputed. Swapped sequences return before any waiting one is
admitted, oldest first; a victim that the CPU store cannot hold is recomputed instead.
The step's ``swap_out`` and ``swap_in`` list the ``(source, destination)`` block copies
the engine does before the forward pass (out first: a block freed by a swap-out may be
handed to another sequence in the same step). Then it admits waiting sequences, oldest first, while
their whole prefill fits the free blocks and the step's budgets (``max_num_seqs``
sequences, ``max_num_batched_tokens`` tokens). Decode first keeps the running requests'
time per output token steady; the waiting ones are admitted into whatever room is left.
With ``chunked_prefill`` a prompt longer than the room left runs in chunks over several
steps (its blocks allocated at once), so prefill and decode tokens share each step.
(nano-vllm orders it the other way: a step that can admit a waiting sequence runs
prefills only, and the decodes wait.) A step that had to preempt admits nobody: the
blocks it freed were just found too few.

With a ``prefix_cache`` (:mod:`~labkit.serve.prefix_cache`) an admitted sequence's table
starts with the cached blocks of its longest cached prefix, shared, and only the rest is
allocated and prefilled; a retiring sequence's full blocks are offered to the cache first.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from ..validate import check_choice, check_positive_int
from .block_manager import BlockManager, NoFreeBlocks
from .prefix_cache import PrefixCache
from .sampler import SamplingParams


PREEMPTION_MODES = ("recompute", "swap")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV waits in CPU blocks (``cpu_block_table``)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and where its KV lives.

    ``num_cached`` tokens have K and V stored in ``block_table``'s blocks; the rest of
    ``tokens`` (the whole prompt before a prefill, the last sampled token before a
    decode step) go through the model next.
    """

    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # filled when params.logprobs
    block_table: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_new: int = 0  # how many tokens after the cached ones the scheduled step runs
    status: Status = Status.WAITING
    num_preemptions: int = 0
    num_prefix_hit: int = 0  # prompt tokens the prefix cache held when it was first admitted
    # Sampled tokens still on their way from the device (the engine's asynchronous scheduling):
    # the last num_pending entries of output are placeholders until the engine reads them back.
    num_pending: int = 0
    lora_slot: int = -1  # the slot of its request's adapter (labkit.serve.lora), -1 for the base model

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(self.tokens)`` without building the list (a step asks it of every sequence)."""
        return len(self.prompt) + len(self.output)


@dataclass
class ScheduledStep:
    """What one model step runs: prefills (the uncached tokens, or with chunked prefill the
    next chunk of them) and decodes (one token each)."""

    prefills: list[Sequence]
    decodes: list[Sequence]
    preempted: list[Sequence]
    copies: list[tuple[int, int]]  # copy-on-write block copies to do before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU block), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (CPU block, device block)


class Scheduler:
    """Waiting, running and swapped queues over one :class:`BlockManager`.

    ``preemption`` is ``"recompute"`` or ``"swap"``; swap needs ``swap_blocks``, the
    :class:`BlockManager` of the CPU-side block store.
    """

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = False, preemption: str = "recompute",
                 swap_blocks: BlockManager | None = None, prefix_cache: PrefixCache | None = None) -> None:
        if not isinstance(blocks, BlockManager):
            raise TypeError(f"blocks must be a BlockManager, got {type(blocks).__name__}")
        if not isinstance(chunked_prefill, bool):
            raise TypeError(f"chunked_prefill must be a bool, got {type(chunked_prefill).__name__}")
        check_choice(preemption, "preemption", PREEMPTION_MODES)
        if (preemption == "swap") != (swap_blocks is not None):
            raise ValueError(f"preemption 'swap' needs swap_blocks (a BlockManager of CPU blocks) and "
                             f"'recompute' takes none; got preemption={preemption!r}, swap_blocks={swap_blocks!r}")
        if swap_blocks is not None:
            if not isinstance(swap_blocks, BlockManager):
                raise TypeError(f"swap_blocks must be a BlockManager, got {type(swap_blocks).__name__}")
            if swap_blocks.block_size != blocks.block_size:
                raise ValueError(f"swap_blocks must have the device blocks' size {blocks.block_size}, "
                                 f"got {swap_blocks.block_size}")
        if prefix_cache is not None and (not isinstance(prefix_cache, PrefixCache) or prefix_cache.blocks is not blocks):
            raise ValueError(f"prefix_cache must be a PrefixCache over this scheduler's blocks, got {prefix_cache!r}")
        self.prefix_cache = prefix_cache
        self.blocks = blocks
        self.swap_blocks = swap_blocks
        self.preemption = preemption
        self.max_num_seqs = check_positive_int(max_num_seqs, "max_num_seqs")
        self.max_num_batched_tokens = check_positive_int(max_num_batched_tokens, "max_num_batched_tokens")
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admitted first
        self.swapped: deque[Sequence] = deque()  # oldest preempted first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledStep:
        """The next step's sequences; each one's ``num_new`` says how many of its tokens it runs."""
        step = ScheduledStep([], [], [], [])
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            if seq.num_pending and len(seq.output) >= seq.params.max_tokens:
                continue  # its last token is still on its way from the device: it decodes no more
            uncached = seq.num_tokens - seq.num_cached
            if uncached > 1:  # a chunked prefill in progress: its blocks were allocated on admission
                seq.num_new = min(uncached, budget)
                if seq.num_new > 0:
                    step.prefills.append(seq)
                    budget -= seq.num_new
                continue
            while True:
                try:
                    copy = self.blocks.append_slot(seq.block_table, seq.num_cached)
                    break
                except NoFreeBlocks:
                    victim = self.running[-1]
                    self._preempt(victim, step)
                    step.preempted.append(victim)
                    if victim is seq:
                        break
            if seq.status is Status.RUNNING:
                seq.num_new = 1
                step.decodes.append(seq)
                budget -= 1
                if copy is not None:
                    step.copies.append(copy)
        while self.swapped and len(self.running) < self.max_num_seqs and not step.preempted and budget > 0:
            seq = self.swapped[0]
            uncached = seq.num_tokens - seq.num_cached
            if (uncached > budget and not self.chunked_prefill) or not self.blocks.can_allocate(seq.num_tokens):
                break
            self.swapped.popleft()
            self._swap_in(seq, step)
            seq.num_new = min(uncached, budget)
            (step.decodes if uncached == 1 else step.prefills).append(seq)
            budget -= seq.num_new
        while (self.waiting and not self.swapped and len(self.running) < self.max_num_seqs
               and not step.preempted and budget > 0):
            seq = self.waiting[0]
            needed = seq.num_tokens
            prefix = self.prefix_cache.match(seq.tokens) if self.prefix_cache is not None else []
            hit = len(prefix) * self.blocks.block_size
            fits = (self.prefix_cache.can_allocate(needed, prefix) if self.prefix_cache is not None
                    else self.blocks.can_allocate(needed))
            if (needed - hit > budget and not self.chunked_prefill) or not fits:
                break
            self.waiting.popleft()
            # The shared prefix first: its references keep it from being evicted by the allocation.
            shared = self.prefix_cache.claim(needed, prefix) if self.prefix_cache is not None else []
            seq.block_table = shared + self.blocks.allocate(needed - hit)
            seq.num_cached = hit
            if not seq.num_preemptions:
                seq.num_prefix_hit = hit
            seq.status = Status.RUNNING
            seq.num_new = min(needed - hit, budget)
            self.running.append(seq)
            step.prefills.append(seq)
            budget -= seq.num_new
        return step

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (done, aborted or failed) wherever it is, freeing its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(seq.tokens[:seq.num_cached], seq.block_table)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
            self.swap_blocks.free(seq.cpu_block_table)
        self.blocks.free(seq.block_table)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        if self.prefix_cache is not None:  # what it computed may spare its own recompute
            self.prefix_cache.insert(seq.tokens[:seq.num_cached], seq.block_table)
        seq.num_preemptions += 1
        stored = self.blocks.blocks_needed(seq.num_cached) if seq.num_cached else 0
        if self.preemption == "swap" and stored and self.swap_blocks.num_free >= stored:
            # Only the blocks holding cached tokens travel; a chunked prefill's unwritten
            # blocks are simply freed and allocated again on the way back.
            seq.cpu_block_table = self.swap_blocks.allocate(seq.num_cached)
            step.swap_out.extend(zip(seq.block_table[:stored], seq.cpu_block_table))
            self.blocks.free(seq.block_table)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            return
        self.blocks.free(seq.block_table)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self, seq: Sequence, step: ScheduledStep) -> None:
        """Give ``seq`` device blocks for all its tokens and copy its cached ones back."""
        seq.block_table = self.blocks.allocate(seq.num_tokens)
        step.swap_in.extend(zip(seq.cpu_block_table, seq.block_table))
        self.swap_blocks.free(seq.cpu_block_table)
        seq.status = Status.RUNNING
        self.running.append(seq)
