"""What a served trace measures: per-request timelines and the four numbers of serving.

For each request a :class:`RequestTimeline` keeps when it arrived, when each of its
tokens came out and how it finished. From those:

- **TTFT**, time to first token: first token minus arrival (queueing plus prefill);
- **TPOT**, time per output token after the first: ``(last - first) / (n - 1)``, what a
  reader of a streamed answer feels (vLLM's benchmarks call its mean over tokens ITL);
- **latency**: finish minus arrival;
- **throughput**: output tokens of the whole trace over its makespan (first arrival to
  last finish).

:func:`summarize` gives their medians and tails, the arrival rate and the mean latency,
whose product Little's law says is the mean number of requests in the system (which
:meth:`labkit.serve.driver.Replay.mean_in_system` measures from the engine's queues).
:func:`windowed_rate` turns token times into throughput over time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestTimeline:
    """One request's life in a replayed trace; times in seconds on the replay's clock."""

    index: int                   # the request's position in the trace
    arrival_s: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def row(self) -> dict:
        """A flat dict for a benchmark record."""
        return {"request": self.index, "arrival_s": self.arrival_s, "prompt_len": self.prompt_len,
                "output_len": len(self.token_times),
                "first_token_s": self.token_times[0] if self.token_times else None,
                "finish_s": self.finish_s, "finish_reason": self.finish_reason,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "num_preemptions": self.num_preemptions}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, as numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(timelines: Sequence[RequestTimeline]) -> dict[str, float]:
    """TTFT, TPOT and latency percentiles, throughput, arrival rate, over finished requests.

    Requests that failed or were cancelled before their first token count toward nothing
    but the in-system area; cancelled ones with tokens count their tokens.
    """
    finished = [t for t in timelines if t.finish_s is not None]
    if not finished:
        raise ValueError("summarize needs at least one finished request")
    start = min(t.arrival_s for t in finished)
    end = max(t.finish_s for t in finished)
    makespan = end - start
    served = [t for t in finished if t.token_times]
    ttfts = [t.ttft_s for t in served]
    tpots = [t.tpot_s for t in served if t.tpot_s is not None]
    latencies = [t.latency_s for t in finished]
    output_tokens = sum(len(t.token_times) for t in finished)
    summary = {
        "requests": len(finished), "output_tokens": output_tokens,
        "prompt_tokens": sum(t.prompt_len for t in served),
        "makespan_s": makespan, "throughput_tok_s": output_tokens / makespan if makespan > 0 else float("nan"),
        "mean_latency_s": statistics.fmean(latencies),
        "arrival_rate_per_s": len(finished) / makespan if makespan > 0 else float("nan"),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("latency", latencies)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = percentile(values, q) if values else float("nan")
    return summary


def windowed_rate(times: Sequence[float], counts: Sequence[int], window_s: float,
                  start_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Events per second in consecutive windows of ``window_s`` from ``start_s``: ``counts[i]``
    events at ``times[i]`` (tokens out of each step, say). Returns (window centres, rates)."""
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    if len(times) != len(counts):
        raise ValueError(f"times and counts must be as long, got {len(times)} and {len(counts)}")
    if not times:
        return [], []
    if min(times) < start_s:
        raise ValueError(f"every time must be >= start_s {start_s}, got {min(times)}")
    totals = [0] * (int((max(times) - start_s) / window_s) + 1)
    for t, c in zip(times, counts):
        totals[int((t - start_s) / window_s)] += c
    return [start_s + (i + 0.5) * window_s for i in range(len(totals))], [c / window_s for c in totals]
