"""What a KV-cache allocator wastes, measured by replaying a stream of requests.

A server does not know how long a request's answer will be, yet the KV cache must hold
every token of it. Contiguous allocators therefore *reserve*: the whole model length
(``"max"``), or, if an oracle told them the final length, the next power of two
(``"pow2"``) or exactly that (``"oracle"``): the three reservation schemes the vLLM paper
compares against {cite}`kwon2023vllm`. A paged allocator (``"paged"``) instead hands out
fixed-size blocks as the sequence grows.

:func:`simulate` replays one stream of requests through a KV memory of ``capacity`` token
slots, one decode step at a time, and accounts for every slot at every step:

- ``tokens``: holds a token's K and V (the only useful part);
- ``reserved``: allocated to a sequence for a token it will still produce;
- ``internal``: allocated and never used (reservation past the final length; for blocks,
  the unfilled end of a last block);
- ``free``: not allocated. Of it, ``stranded`` is free memory that could not be used at a
  step where the next request had to wait although the free total would have held it:
  external fragmentation, the holes between contiguous reservations.

Requests are served first come, first served, all waiting from the start (a saturated
server, where memory decides the batch). The paged allocator admits a request when its
prompt fits and, when a growing sequence finds no free block, preempts the most recently
admitted one (its blocks are freed and it restarts later), as vLLM's scheduler does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..validate import check_positive_int

POLICIES = ("max", "pow2", "oracle", "paged")
PARTS = ("tokens", "reserved", "internal", "stranded", "free")


def request_lengths(n: int, *, seed: int, prompt_mean: float = 161.0, output_mean: float = 338.0,
                    sigma: float = 1.0, max_len: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic (prompt, output) token counts from log-normal distributions.

    Chat traffic is long-tailed: most turns are short, a few are very long. Log-normals
    with the given means and log-space spread ``sigma`` model that; the defaults follow
    the ShareGPT means the vLLM paper reports (its Figure 11). Each pair is clipped so
    that prompt + output fits ``max_len``, the model's context limit.
    """
    check_positive_int(n, "n")
    rng = np.random.default_rng(seed)

    def lognormal(mean):
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)

    prompts = np.clip(np.rint(lognormal(prompt_mean)), 1, max_len - 1).astype(int)
    outputs = np.clip(np.rint(lognormal(output_mean)), 1, max_len - prompts).astype(int)
    return prompts, outputs


@dataclass
class Timeline:
    """Per-step accounting of one replay: each of :data:`PARTS`, in token slots, and the batch."""

    policy: str
    capacity: int
    parts: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PARTS})
    batch: list[int] = field(default_factory=list)
    saturated: list[bool] = field(default_factory=list)  # requests were still waiting after admission
    preemptions: int = 0

    @property
    def steps(self) -> int:
        return len(self.batch)

    def mean_fraction(self, part: str) -> float:
        """The fraction of the memory in ``part``, averaged over the saturated steps (requests
        waiting: memory, not demand, limits the batch); the drain at the end is left out."""
        return float(np.mean(np.array(self.parts[part])[self.saturated])) / self.capacity

    def summary(self) -> dict[str, float]:
        saturated_batch = np.array(self.batch)[self.saturated]
        return {"policy": self.policy, **{p: self.mean_fraction(p) for p in PARTS},
                "mean_batch": float(saturated_batch.mean()), "steps": self.steps, "preemptions": self.preemptions}


class _FirstFit:
    """A contiguous allocator over ``[0, capacity)``: the first hole large enough wins."""

    def __init__(self, capacity: int) -> None:
        self.holes = [(0, capacity)]  # (start, size), sorted by start

    def allocate(self, size: int) -> int | None:
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                self.holes[i:i + 1] = [(start + size, hole - size)] if hole > size else []
                return start
        return None

    def free(self, start: int, size: int) -> None:
        self.holes.append((start, size))
        self.holes.sort()
        merged = [self.holes[0]]
        for s, n in self.holes[1:]:
            last_s, last_n = merged[-1]
            if last_s + last_n == s:
                merged[-1] = (last_s, last_n + n)
            else:
                merged.append((s, n))
        self.holes = merged

    @property
    def largest(self) -> int:
        return max((n for _, n in self.holes), default=0)


def _reservation(policy: str, final: int, max_len: int) -> int:
    if policy == "max":
        return max_len
    if policy == "pow2":
        return min(max_len, 1 << (final - 1).bit_length())
    return final  # oracle


def simulate(prompts, outputs, capacity: int, policy: str, *, max_len: int = 2048,
             block_size: int = 16) -> Timeline:
    """Replay requests (``prompts[i]`` tokens in, ``outputs[i]`` out) through ``capacity`` KV slots.

    Each step, waiting requests are admitted in order while they fit (their prompt's K and
    V are written at once), then every running sequence appends one token; a sequence
    leaves when it reaches ``prompt + output`` tokens. See the module docstring for the
    accounting and :data:`POLICIES` for the allocators.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    check_positive_int(capacity, "capacity")
    check_positive_int(block_size, "block_size")
    finals = [int(p) + int(o) for p, o in zip(prompts, outputs)]
    if not finals or max(finals) > max_len or min(int(p) for p in prompts) < 1 or min(int(o) for o in outputs) < 1:
        raise ValueError("every request needs a prompt and an output of at least one token, "
                         f"together at most max_len={max_len}")
    need = max(_reservation(policy, f, max_len) for f in finals) if policy != "paged" else \
        block_size * -(-max(finals) // block_size)
    if need > capacity:
        raise ValueError(f"a request needs {need} slots under {policy!r}, the memory has only {capacity}")

    timeline = Timeline(policy, capacity)
    waiting = deque(range(len(finals)))
    running: list[int] = []           # admission order
    length: dict[int, int] = {}       # tokens stored per running sequence
    progress: dict[int, int] = {}     # tokens a preempted sequence had: recomputed as its prompt
    held: dict[int, tuple[int, int]] = {}  # contiguous: (start, size); paged: (0, blocks)
    arena = _FirstFit(capacity)
    free_blocks = capacity // block_size

    while waiting or running:
        # Admission, first come first served: stop at the first request that does not fit.
        stranded = 0
        while waiting:
            r = waiting[0]
            prompt = progress.get(r, finals[r] - int(outputs[r]))
            if policy == "paged":
                blocks = -(-(prompt + 1) // block_size)  # its prompt and its first new token
                if blocks > free_blocks:
                    break
                free_blocks -= blocks
                held[r] = (0, blocks)
            else:
                size = _reservation(policy, finals[r], max_len)
                start = arena.allocate(size)
                if start is None:
                    free_total = sum(n for _, n in arena.holes)
                    stranded = free_total if free_total >= size else 0
                    break
                held[r] = (start, size)
            waiting.popleft()
            progress.pop(r, None)
            running.append(r)
            length[r] = prompt
        # Decode: every running sequence appends one token (paged: a block when the last is full).
        for r in list(running):
            if r not in length:  # preempted earlier in this step
                continue
            if policy == "paged" and length[r] == held[r][1] * block_size:
                while free_blocks == 0:
                    victim = running[-1]
                    free_blocks += held.pop(victim)[1]
                    progress[victim] = length.pop(victim)
                    running.pop()
                    waiting.appendleft(victim)
                    timeline.preemptions += 1
                    if victim == r:
                        break
                if r not in length:
                    continue
                free_blocks -= 1
                held[r] = (0, held[r][1] + 1)
            length[r] += 1
        _account(timeline, policy, running, length, held, finals, block_size, stranded)
        timeline.saturated.append(bool(waiting))
        for r in [r for r in running if length[r] == finals[r]]:
            running.remove(r)
            del length[r]
            start, size = held.pop(r)
            if policy == "paged":
                free_blocks += size
            else:
                arena.free(start, size)
    return timeline


def _account(timeline, policy, running, length, held, finals, block_size, stranded) -> None:
    tokens = reserved = internal = 0
    for r in running:
        allocated = held[r][1] * block_size if policy == "paged" else held[r][1]
        will_fill = min(allocated, finals[r])
        tokens += length[r]
        reserved += will_fill - length[r]
        internal += allocated - will_fill
    free = timeline.capacity - tokens - reserved - internal
    for part, value in zip(PARTS, (tokens, reserved, internal, stranded, free - stranded)):
        timeline.parts[part].append(value)
    timeline.batch.append(len(running))
