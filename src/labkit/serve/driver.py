"""The trace driver: replay a request trace against :class:`~labkit.serve.LLM`, timestamping every token.

The driver uses only the engine's public API (``add_request``, ``step``,
``has_unfinished``, ``output``, ``abort``), as a server's front end would: requests are
submitted when the trace says they arrive, cancelled when it says the client gives up,
and each step's returned schedule says whose tokens just came out.

Two ways to batch the same trace on the same engine and memory budget:

- ``"continuous"`` (Orca's iteration-level scheduling): every request goes to the engine
  the moment it arrives; the scheduler admits it into the very next step that has room
  and retires it the step it finishes.
- ``"static"``: the way a ``generate(batch)`` call serves. When the engine is empty, the
  requests that have arrived (at most ``static_batch_size``) form one batch; they all
  decode until the batch's longest is done (the others keep producing padding, as a
  padded batch does), and nobody joins until the whole batch has left. Its batch size is
  what a contiguous cache affords: :func:`static_batch_size` reserves every request's
  worst case, the longest prompt plus the largest output, as a static allocation must.
  Two things are generous to it: a request's tokens stream out as they are made (a
  ``generate`` call returns them all at the end), and prompts are not padded.

The clock is the engine's: each step advances it by the step's measured wall time (the
device synchronised), or by a fixed ``step_s`` for a deterministic replay in tests. When
the engine has nothing to do, the clock jumps to the next arrival instead of sleeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..validate import check_choice, check_positive_int
from .engine import LLM
from .metrics import RequestTimeline, summarize
from .sampler import SamplingParams
from .scheduler import Status
from .trace import TraceRequest

BATCHING = ("continuous", "static")


@dataclass(frozen=True)
class StepRecord:
    """One engine step of a replay: when it ran, what it ran, and who was in the system."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    preempted: int
    output_tokens: int  # tokens the step gave to requests (not static batching's padding)
    in_system: int      # requests arrived and not yet finished (queued anywhere or running)


@dataclass
class Replay:
    """A replayed trace: one timeline per request (in trace order) and one record per step."""

    timelines: list[RequestTimeline]
    steps: list[StepRecord]

    def summary(self) -> dict[str, float]:
        return summarize(self.timelines)

    def mean_in_system(self) -> float:
        """The time average of the number of requests in the system, over the steps'
        time from the first arrival to the last finish (idle gaps count as zero)."""
        start = min(t.arrival_s for t in self.timelines)
        end = max(t.finish_s for t in self.timelines if t.finish_s is not None)
        area = sum(s.in_system * (s.end_s - s.start_s) for s in self.steps)
        return area / (end - start)


def static_batch_size(num_blocks: int, block_size: int, max_len: int) -> int:
    """How many requests a contiguous cache of ``num_blocks * block_size`` token slots holds
    when each reserves ``max_len`` slots (the longest request it may have to serve)."""
    slots = check_positive_int(num_blocks, "num_blocks") * check_positive_int(block_size, "block_size")
    check_positive_int(max_len, "max_len")
    if max_len > slots:
        raise ValueError(f"one request of {max_len} tokens does not fit a pool of {slots} token slots")
    return slots // max_len


def replay(llm: LLM, trace: Sequence[TraceRequest], *, batching: str = "continuous",
           static_batch_size: int | None = None, step_s: float | None = None) -> Replay:
    """Serve ``trace`` on ``llm`` (greedy), as ``batching`` says; see the module docstring."""
    if not isinstance(llm, LLM):
        raise TypeError(f"llm must be a labkit.serve.LLM, got {type(llm).__name__}")
    if not trace or not all(isinstance(r, TraceRequest) for r in trace):
        raise ValueError("trace must be a non-empty sequence of TraceRequest")
    check_choice(batching, "batching", BATCHING)
    if (batching == "static") != (static_batch_size is not None):
        raise ValueError(f"static_batch_size goes with batching='static' only, got batching={batching!r}, "
                         f"static_batch_size={static_batch_size!r}")
    if batching == "static":
        check_positive_int(static_batch_size, "static_batch_size")
    if step_s is not None and (isinstance(step_s, bool) or not isinstance(step_s, (int, float)) or not step_s > 0):
        raise ValueError(f"step_s must be a positive number of seconds or None (measure), got {step_s!r}")
    synchronize = torch.cuda.synchronize if llm.model.embed.weight.is_cuda else (lambda: None)

    timelines = [RequestTimeline(i, r.arrival_s, len(r.prompt)) for i, r in enumerate(trace)]
    not_arrived = deque(sorted(range(len(trace)), key=lambda i: trace[i].arrival_s))
    queued: deque[int] = deque()       # arrived, not yet given to the engine (static batching)
    engine_index: dict[int, int] = {}  # engine request id -> trace index, while in the engine
    steps: list[StepRecord] = []
    now = 0.0

    def finish(i: int, reason: str, preemptions: int = 0) -> None:
        if timelines[i].finish_s is None:
            timelines[i].finish_s, timelines[i].finish_reason = now, reason
            timelines[i].num_preemptions = preemptions

    def submit(i: int, max_tokens: int) -> None:
        request_id = llm.add_request(list(trace[i].prompt), SamplingParams(max_tokens=max_tokens))
        try:
            out = llm.output(request_id)  # finished already: the engine rejected it
            finish(i, out.finish_reason)
        except KeyError:
            engine_index[request_id] = i

    def in_system() -> int:
        return sum(1 for t in timelines if t.arrival_s <= now and t.finish_s is None)

    while not_arrived or queued or llm.has_unfinished():
        while not_arrived and trace[not_arrived[0]].arrival_s <= now:
            queued.append(not_arrived.popleft())
        for i in [i for i in queued if _cancelled(trace[i], now)]:
            queued.remove(i)
            finish(i, "abort")
        for request_id, i in list(engine_index.items()):
            if _cancelled(trace[i], now) and timelines[i].finish_s is None:
                llm.abort(request_id)
                del engine_index[request_id]
                finish(i, "abort")
        if batching == "continuous":
            while queued:
                i = queued.popleft()
                submit(i, trace[i].max_tokens)
        elif queued and not llm.has_unfinished():
            batch = [queued.popleft() for _ in range(min(static_batch_size, len(queued)))]
            padded = max(trace[i].max_tokens for i in batch)
            for i in batch:
                submit(i, padded)
        if not llm.has_unfinished():
            if not_arrived and not queued:
                now = max(now, trace[not_arrived[0]].arrival_s)
            continue
        count, start = in_system(), now
        t0 = time.perf_counter()
        step = llm.step()
        synchronize()
        now += step_s if step_s is not None else time.perf_counter() - t0
        emitted = 0
        for seq in step.prefills + step.decodes:
            i = engine_index.get(seq.request_id)
            if i is None:
                continue
            wanted = trace[i].max_tokens  # below the engine's budget under static batching's padding
            timeline = timelines[i]
            while len(timeline.tokens) < min(len(seq.output), wanted):
                timeline.tokens.append(seq.output[len(timeline.tokens)])
                timeline.token_times.append(now)
                emitted += 1
            if len(timeline.tokens) == wanted:
                finish(i, "length", seq.num_preemptions)
            if seq.status is Status.FINISHED:
                out = llm.output(seq.request_id)
                finish(i, out.finish_reason, out.num_preemptions)
                del engine_index[seq.request_id]
        steps.append(StepRecord(start, now, sum(s.num_new for s in step.prefills), len(step.decodes),
                                len(step.preempted), emitted, count))
    return Replay(timelines, steps)


def _cancelled(request: TraceRequest, now: float) -> bool:
    return request.cancel_after_s is not None and now >= request.arrival_s + request.cancel_after_s


__all__ = ["BATCHING", "Replay", "StepRecord", "replay", "static_batch_size"]
