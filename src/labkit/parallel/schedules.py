"""Pipeline schedules as data, and a simulator that turns one into a timeline.

A schedule says, for each pipeline rank, the order in which it runs the forward ("F") and
backward ("B") passes of each micro-batch through each of its model chunks. With
``chunks = v`` the model is cut into ``p * v`` *virtual stages*; rank ``r`` holds virtual
stages ``r, r + p, r + 2p, ...`` (Megatron's interleaving), so chunk ``c`` of rank ``r``
is virtual stage ``c * p + r``.

- :func:`gpipe`: every forward, then every backward {cite}`huang2019gpipe`. The last
  rank stashes the activations of all ``m`` micro-batches.
- :func:`one_f_one_b`: PipeDream-Flush / Megatron's 1F1B {cite}`narayanan2021pipedreamflush,narayanan2021megatron`:
  rank ``r`` runs ``p - r - 1`` warm-up forwards, then alternates one forward and one
  backward, then drains the backwards. Same bubble as GPipe, at most ``p - r``
  micro-batches in flight.
- :func:`interleaved_one_f_one_b`: Megatron's interleaved schedule: ``v`` chunks per rank
  shrink the bubble by ``v`` at the price of ``v`` times the point-to-point messages.

:func:`simulate` runs any schedule against the dependencies (a virtual stage's forward
needs the previous virtual stage's forward of that micro-batch; its backward needs the
next virtual stage's backward, or, on the last one, its own forward) with fixed times per
pass, and reports each pass's start and end; a schedule whose order would deadlock raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_positive_int


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one model chunk of a rank."""

    kind: str         # "F" or "B"
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]  # one list of actions per pipeline rank, in execution order


def _check_sizes(num_stages: object, num_microbatches: object) -> tuple[int, int]:
    return check_positive_int(num_stages, "num_stages"), check_positive_int(num_microbatches, "num_microbatches")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every rank."""
    p, m = _check_sizes(num_stages, num_microbatches)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Warm up with ``p - r - 1`` forwards, alternate F and B, drain the backwards."""
    p, m = _check_sizes(num_stages, num_microbatches)
    schedule = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``chunks`` model chunks per rank.

    Micro-batches go through the chunks in groups of ``p``: forwards of micro-batches
    ``0..p-1`` through chunk 0, then the same ones through chunk 1, ..., then the next
    group; backwards walk the chunks in reverse. Rank ``r`` warms up with
    ``2(p - r - 1) + (v - 1) p`` forwards, as Megatron's
    ``forward_backward_pipelining_with_interleaving`` counts them (which, when ``m = p``,
    runs every forward first instead), and needs ``m`` to be a multiple of ``p``.
    """
    p, m = _check_sizes(num_stages, num_microbatches)
    v = check_positive_int(chunks, "chunks")
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"the interleaved schedule needs num_microbatches to be a multiple of num_stages "
                         f"({p}), got {m}")
    total = m * v

    def forward_action(k: int) -> Action:
        group, within = divmod(k, p * v)
        return Action("F", group * p + within % p, within // p)

    def backward_action(k: int) -> Action:
        group, within = divmod(k, p * v)
        return Action("B", group * p + within % p, v - 1 - within // p)

    schedule = []
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        actions = [forward_action(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward_action(warmup + k), backward_action(k)]
        actions += [backward_action(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b}


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    if name == "interleaved":
        return interleaved_one_f_one_b(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"{name} runs one chunk per rank; chunks={chunks} needs the interleaved schedule")
    return SCHEDULES[name](num_stages, num_microbatches)


@dataclass(frozen=True)
class Timeline:
    """When each pass ran: ``events[rank]`` is a list of ``(action, start, end)``."""

    events: list[list[tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for rank in self.events for _, _, end in rank)

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.events[rank])

    def bubble_fraction(self) -> float:
        """Idle time over total time, over all ranks: ``1 - busy / (p * makespan)``."""
        p = len(self.events)
        return 1.0 - sum(self.busy(r) for r in range(p)) / (p * self.makespan)

    def idle(self, rank: int) -> float:
        return self.makespan - self.busy(rank)


def check_schedule(schedule: Schedule, num_microbatches: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` unless every rank runs each (micro-batch, chunk) forward and backward once."""
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"a schedule is a non-empty list of per-rank action lists, got {schedule!r:.80}")
    want = sorted((kind, i, c) for kind in "BF" for i in range(num_microbatches) for c in range(chunks))
    for rank, actions in enumerate(schedule):
        if not all(isinstance(a, Action) for a in actions):
            raise ValueError(f"rank {rank}'s schedule must hold Action objects")
        got = sorted((a.kind, a.microbatch, a.chunk) for a in actions)
        if got != want:
            raise ValueError(f"rank {rank} must run the forward and backward of each of {num_microbatches} "
                             f"micro-batches through each of {chunks} chunks exactly once; got {actions}")


def simulate(schedule: Schedule, num_microbatches: int, *, chunks: int = 1, forward_time: float = 1.0,
             backward_time: float = 2.0, p2p_time: float = 0.0) -> Timeline:
    """Run ``schedule`` with fixed times per pass (per chunk: a rank's time divided by ``chunks``).

    Each rank runs its actions in order, each as soon as the rank is free and its input
    has arrived (``p2p_time`` after the pass that produced it on another rank).
    """
    check_schedule(schedule, num_microbatches, chunks)
    p = len(schedule)
    stages = p * chunks
    f, b = forward_time / chunks, backward_time / chunks
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time
    position = [0] * p
    free_at = [0.0] * p
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for rank in range(p):
            while position[rank] < len(schedule[rank]):
                action = schedule[rank][position[rank]]
                stage = action.chunk * p + rank
                if action.kind == "F":
                    source = ("F", action.microbatch, stage - 1) if stage > 0 else None
                else:
                    source = (("B", action.microbatch, stage + 1) if stage < stages - 1
                              else ("F", action.microbatch, stage))
                if source is not None and source not in done:
                    break
                ready = 0.0
                if source is not None:
                    source_rank = source[2] % p
                    ready = done[source] + (p2p_time if source_rank != rank else 0.0)
                start = max(free_at[rank], ready)
                end = start + (f if action.kind == "F" else b)
                done[(action.kind, action.microbatch, stage)] = end
                events[rank].append((action, start, end))
                free_at[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][position[r]] for r in range(p) if position[r] < len(schedule[r])}
            raise ValueError(f"the schedule deadlocks: every rank waits on an input never produced; "
                             f"next actions {stuck}")
    return Timeline(events)


def in_flight(actions: list[Action]) -> int:
    """The most micro-batch chunks whose forward ran and backward did not: stashed activations."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction_formula(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Idle over total time of a flushed pipeline with equal stages and no communication time.

    Each rank is busy ``m (t_f + t_b)``; the first forward reaches the last virtual stage
    after ``(p - 1)`` chunk forwards of ``t_f / v``, and the last backward leaves rank 0
    ``(p - 1)`` chunk backwards later than it could: the idle time per rank is
    ``(p - 1)(t_f + t_b) / v``, so idle / total = ``(p - 1) / (v m + p - 1)``.
    (Megatron's paper quotes idle / ideal = ``(p - 1) / (v m)``.)
    """
    p, m = _check_sizes(num_stages, num_microbatches)
    v = check_positive_int(chunks, "chunks")
    return (p - 1) / (v * m + p - 1)
