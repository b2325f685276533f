"""Sampling parameters and the sampler: greedy, temperature, top-k and top-p.

Each request that asks for a ``seed`` gets its own ``torch.Generator``, so its tokens do
not depend on which other requests share its batch or in what order the engine ran them:
seeded sampling reproduces under any schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 is greedy (argmax); so is any below ``GREEDY_BELOW`` (as in vLLM),
    where dividing the logits by it would overflow them to infinities. ``top_k`` 0 and ``top_p`` 1 switch those filters
    off. Generation stops after ``max_tokens`` tokens or on a token in ``stop_token_ids``
    (which is kept in the output). ``seed`` makes sampling reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        def is_number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from ``logits`` ``[vocab]`` under ``params``.

    The filters apply in vLLM's order: temperature scales the logits, top-k keeps the
    ``k`` largest, top-p keeps the smallest set of the most likely tokens whose
    probability reaches ``p`` (always at least the most likely one).
    """
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_largest = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens more likely than it already reach top_p.
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
