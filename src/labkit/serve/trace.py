"""Synthetic request traces: when requests arrive, how long their prompts and outputs are,
and which ones the client cancels.

Real serving traces (ShareGPT conversations, the Azure LLM inference traces) share two
traits that decide how a scheduler fares: lengths spread over orders of magnitude with a
long tail, and arrivals come in bursts of independent clients. :func:`synthetic_trace`
draws both: lengths log-uniform between a minimum and a maximum (as many prompts of 16 to
32 tokens as of 512 to 1024), arrivals a Poisson process (exponential gaps) at a given
rate, or all at once for an offline batch. A fraction of requests is cancelled a while
after arriving, as a client that closes its connection does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..validate import check_positive_int


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: it arrives at ``arrival_s``, asks for ``max_tokens`` tokens after
    ``prompt``, and, if ``cancel_after_s`` is set, is aborted that long after it arrived
    unless it has finished by then."""

    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    cancel_after_s: float | None = None


def _check_range(value: object, name: str) -> tuple[int, int]:
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
            or value[0] > value[1]):
        raise ValueError(f"{name} must be a (min, max) tuple of ints with 1 <= min <= max, got {value!r}")
    return value


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An int in ``[low, high]`` whose logarithm is uniform: every octave equally likely."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def synthetic_trace(num_requests: int, *, vocab_size: int, prompt_lens: tuple[int, int],
                    output_lens: tuple[int, int], rate_per_s: float = math.inf,
                    cancel_fraction: float = 0.0, cancel_after_s: tuple[float, float] = (0.0, 1.0),
                    seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` requests in arrival order, drawn from ``seed``.

    Prompt and output lengths are log-uniform over ``prompt_lens`` and ``output_lens``
    (inclusive ranges); prompt tokens are uniform over the vocabulary. Arrivals are Poisson
    at ``rate_per_s`` (``inf``: all at time 0). Each request is cancelled with probability
    ``cancel_fraction``, after a delay uniform over ``cancel_after_s`` seconds.
    """
    check_positive_int(num_requests, "num_requests")
    check_positive_int(vocab_size, "vocab_size")
    prompt_lens, output_lens = _check_range(prompt_lens, "prompt_lens"), _check_range(output_lens, "output_lens")
    if isinstance(rate_per_s, bool) or not isinstance(rate_per_s, (int, float)) or not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be a positive number (inf: all arrive at once), got {rate_per_s!r}")
    if isinstance(cancel_fraction, bool) or not isinstance(cancel_fraction, (int, float)) or not 0 <= cancel_fraction <= 1:
        raise ValueError(f"cancel_fraction must be a number in [0, 1], got {cancel_fraction!r}")
    if (not isinstance(cancel_after_s, tuple) or len(cancel_after_s) != 2
            or not 0 <= cancel_after_s[0] <= cancel_after_s[1] < math.inf):
        raise ValueError(f"cancel_after_s must be a (min, max) tuple of seconds, 0 <= min <= max, got {cancel_after_s!r}")
    rng = random.Random(seed)
    trace, now = [], 0.0
    for _ in range(num_requests):
        if math.isfinite(rate_per_s):
            now += rng.expovariate(rate_per_s)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(log_uniform(rng, *prompt_lens)))
        max_tokens = log_uniform(rng, *output_lens)
        cancel = rng.uniform(*cancel_after_s) if rng.random() < cancel_fraction else None
        trace.append(TraceRequest(now, prompt, max_tokens, cancel))
    return trace
