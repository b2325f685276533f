"""Sampling parameters and the sampler: greedy, temperature, top-k and top-p, one batch at a time.

Each request that asks for a ``seed`` gets its own ``torch.Generator``, so its tokens do
not depend on which other requests share its batch or in what order the engine ran them:
seeded sampling reproduces under any schedule.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from ..spec.verify import race_winner


GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 is greedy (argmax); so is any below ``GREEDY_BELOW`` (as in vLLM),
    where dividing the logits by it would overflow them to infinities. ``top_k`` 0 and ``top_p`` 1 switch those filters
    off. Generation stops after ``max_tokens`` tokens or on a token in ``stop_token_ids``
    (which is kept in the output). ``seed`` makes sampling reproducible. ``n`` samples share
    the prompt's KV blocks (the engine forks them after the prefill); sample ``i`` draws
    from a generator seeded with ``seed + i``, as vLLM seeds its parallel samples.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: bool = False

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
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (samples per prompt), got {self.n!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask each row of ``logits`` ``[B, vocab]`` to its ``top_k[b]`` largest and then to the
    smallest set of most likely tokens whose probability reaches ``top_p[b]`` (vLLM's batched
    filter: one ascending sort serves both). Masked logits become ``-inf``; ``top_k[b]`` equal
    to the vocabulary or ``top_p[b]`` 1 leave row ``b`` alone.
    """
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError(f"logits must be a [B, vocab] tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    for name, t in (("top_k", top_k), ("top_p", top_p)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != logits.shape[:1]):
            raise ValueError(f"{name} must be None or a [{logits.shape[0]}] tensor (one per row), "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (logits.shape[1] - top_k.long()).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Ascending order: drop a token while everything below it (itself included) stays
        # within 1 - p of the mass, so what is left reaches p; never drop the most likely.
        drop = cumulative <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def host_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of ``values`` on ``device``, copied without waiting for the device.

    ``torch.tensor(values, device=cuda)`` copies from pageable memory, which waits until the
    device has run everything queued before it; an engine that queues the next step while
    the GPU runs this one must not wait there. Pinned memory lets the copy join the queue."""
    on_cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=on_cuda)


def sample_tokens(logits: torch.Tensor, params: SequenceOf[SamplingParams],
                  generators: SequenceOf[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, vocab]``, row ``b`` under ``params[b]``, as an
    int64 tensor on the logits' device (nothing is read back to the host).

    Greedy rows take the argmax. The others divide by their temperature, apply top-k and
    top-p (:func:`apply_top_k_top_p`) and draw from the softmax the way vLLM's sampler does:
    ``argmax(probs / q)`` with ``q`` exponential noise, which picks token ``i`` with
    probability ``probs[i]`` (the exponential race). A row with a generator draws its noise
    from it alone, so a seeded request's tokens do not depend on its batch.
    """
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"logits must be [B, vocab] with B = len(params) = len(generators), got "
                         f"{tuple(logits.shape)}, {len(params)} params and {len(generators)} generators")
    greedy_tokens = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy_tokens
    device = logits.device
    greedy = host_values([p.greedy for p in params], torch.bool, device)
    temperature = host_values([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    scaled = logits.float() / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = top_p = None
    if any(0 < p.top_k < vocab for p in params):
        top_k = host_values([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
    if any(p.top_p < 1 for p in params):
        top_p = host_values([p.top_p for p in params], torch.float32, device)
    probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    sampled = race_winner(probs, noise)
    return torch.where(greedy, greedy_tokens, sampled)


def sample_batch(logits: torch.Tensor, params: SequenceOf[SamplingParams],
                 generators: SequenceOf[torch.Generator | None]) -> list[int]:
    """:func:`sample_tokens` as a list of ints on the host."""
    return sample_tokens(logits, params, generators).tolist()


def token_logprobs(logits: torch.Tensor, params: SequenceOf[SamplingParams], tokens: torch.Tensor) -> torch.Tensor:
    """``log p(tokens[b])`` for each row of ``logits`` ``[B, vocab]`` (``tokens``: a ``[B]``
    int64 tensor on the logits' device), under the distribution :func:`sample_tokens` drew
    it from: temperature, then top-k and top-p (vLLM's ``processed_logprobs``). A greedy row
    reports the raw softmax's log-probability. A float32 tensor; nothing is read back.

    Computed from the engine's own logits, in its dtype and with its kernels: an RL trainer
    recomputing the same tokens gets slightly different numbers, the mismatch that
    truncated importance sampling corrects (:mod:`labkit.rl.tis`).
    """
    if logits.ndim != 2 or not logits.shape[0] == len(params) == len(tokens):
        raise ValueError(f"logits must be [B, vocab] with B = len(params) = len(tokens), got "
                         f"{tuple(logits.shape)}, {len(params)} params and {len(tokens)} tokens")
    device, vocab = logits.device, logits.shape[1]
    temperature = host_values([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    scaled = logits.float() / temperature.unsqueeze(1)
    top_k = top_p = None
    if any(0 < p.top_k < vocab and not p.greedy for p in params):
        top_k = host_values([p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params],
                            torch.int64, device)
    if any(p.top_p < 1 and not p.greedy for p in params):
        top_p = host_values([1.0 if p.greedy else p.top_p for p in params], torch.float32, device)
    logp = apply_top_k_top_p(scaled, top_k, top_p).log_softmax(-1)
    return logp.gather(1, tokens[:, None]).squeeze(1)


def sampled_logprobs(logits: torch.Tensor, params: SequenceOf[SamplingParams], tokens: SequenceOf[int]) -> list[float]:
    """:func:`token_logprobs` of a list of token ids, as a list of floats on the host."""
    tokens = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, params, tokens).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from ``logits`` ``[vocab]`` under ``params`` (:func:`sample_batch` of one row)."""
    if logits.ndim != 1:
        raise ValueError(f"logits must be [vocab], got shape {tuple(logits.shape)}")
    return sample_batch(logits.unsqueeze(0), [params], [generator])[0]
