"""Multi-turn agent traces and a closed-loop driver that serves them.

An agent platform's requests are not independent: every turn of a session resends the
whole conversation so far (system prompt, tool definitions, each earlier message and
answer) plus one new message, a user's or a tool's output; and many sessions share a few
system prompts. :func:`agent_trace` draws such sessions: ``num_system_prompts`` system
prompts of ``system_len`` tokens shared round-robin, then per turn a new message and an
output budget, both log-uniform (:func:`labkit.serve.trace.log_uniform`; tool outputs are
long-tailed). The model's answers are not in the trace: they are what the engine says.

:func:`serve_sessions` is therefore a *closed loop*: it keeps ``concurrency`` sessions
open, and the moment a turn's answer is complete it sends the next turn, whose prompt is
the previous prompt, the answer and the new message. Clock and timelines are the trace
driver's (:mod:`labkit.serve.driver`): each engine step advances the clock by its
measured wall time (device synchronised) or by a fixed ``step_s``; each turn gets a
:class:`~labkit.serve.metrics.RequestTimeline`, and its ``num_cached_tokens`` says how
much of its prompt the prefix cache held.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..validate import check_positive_int
from .engine import LLM
from .metrics import RequestTimeline
from .prefix_cache import CachingBlockManager
from .sampler import SamplingParams
from .trace import _check_range, log_uniform


@dataclass(frozen=True)
class AgentSession:
    """One agent session: its system prompt, then per turn the new message and an output budget."""

    system: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.messages)


@dataclass
class TurnRecord:
    """One served turn: which session and turn, its timeline, and the prompt tokens found cached."""

    session: int
    turn: int
    timeline: RequestTimeline
    num_cached_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return self.timeline.prompt_len

    def row(self) -> dict:
        return {"session": self.session, "turn": self.turn, **self.timeline.row(),
                "cached_tokens": self.num_cached_tokens}


def agent_trace(num_sessions: int, *, vocab_size: int, system_len: int, num_system_prompts: int = 1,
                turns: tuple[int, int] = (2, 6), message_lens: tuple[int, int] = (16, 256),
                output_lens: tuple[int, int] = (8, 64), seed: int = 0) -> list[AgentSession]:
    """``num_sessions`` sessions drawn from ``seed`` (see the module docstring); session ``i``
    uses system prompt ``i % num_system_prompts``. Ranges are inclusive ``(min, max)``."""
    check_positive_int(num_sessions, "num_sessions")
    check_positive_int(vocab_size, "vocab_size")
    check_positive_int(system_len, "system_len")
    check_positive_int(num_system_prompts, "num_system_prompts")
    turns, message_lens = _check_range(turns, "turns"), _check_range(message_lens, "message_lens")
    output_lens = _check_range(output_lens, "output_lens")
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(n))

    systems = [tokens(system_len) for _ in range(num_system_prompts)]
    sessions = []
    for i in range(num_sessions):
        n = rng.randint(*turns)
        sessions.append(AgentSession(systems[i % num_system_prompts],
                                     tuple(tokens(log_uniform(rng, *message_lens)) for _ in range(n)),
                                     tuple(log_uniform(rng, *output_lens) for _ in range(n))))
    return sessions


def longest_conversation(session: AgentSession) -> int:
    """An upper bound on any prompt plus answer of ``session``: every message and answer budget."""
    return len(session.system) + sum(len(m) for m in session.messages) + sum(session.max_tokens)


def serve_sessions(llm: LLM, sessions: Sequence[AgentSession], *, concurrency: int = 1,
                   step_s: float | None = None) -> list[TurnRecord]:
    """Serve every turn of every session on ``llm`` (greedy), ``concurrency`` sessions at a time,
    in session order; one record per turn, ordered by session and turn."""
    if not isinstance(llm, LLM):
        raise TypeError(f"llm must be a labkit.serve.LLM, got {type(llm).__name__}")
    if not sessions or not all(isinstance(s, AgentSession) for s in sessions):
        raise ValueError("sessions must be a non-empty sequence of AgentSession")
    check_positive_int(concurrency, "concurrency")
    if step_s is not None and (isinstance(step_s, bool) or not isinstance(step_s, (int, float)) or not step_s > 0):
        raise ValueError(f"step_s must be a positive number of seconds or None (measure), got {step_s!r}")
    synchronize = torch.cuda.synchronize if llm.model.embed.weight.is_cuda else (lambda: None)

    records: dict[tuple[int, int], TurnRecord] = {}
    history: dict[int, list[int]] = {}      # session -> its conversation so far (the last prompt and answer)
    in_flight: dict[int, tuple[int, int]] = {}  # engine request id -> (session, turn)
    next_session = 0
    now = 0.0

    def submit(session: int, turn: int) -> None:
        s = sessions[session]
        prompt = (list(s.system) if turn == 0 else history[session]) + list(s.messages[turn])
        request_id = llm.add_request(prompt, SamplingParams(max_tokens=s.max_tokens[turn]))
        records[session, turn] = TurnRecord(session, turn, RequestTimeline(len(records), now, len(prompt)))
        history[session] = prompt
        in_flight[request_id] = (session, turn)
        if llm.progress(request_id)[1] is not None:
            raise ValueError(f"session {session} turn {turn}: the engine refused it: {llm.output(request_id).error}")

    while next_session < len(sessions) or in_flight:
        while next_session < len(sessions) and len({s for s, _ in in_flight.values()}) < concurrency:
            submit(next_session, 0)
            next_session += 1
        t0 = time.perf_counter()
        step = llm.step()
        synchronize()
        now += step_s if step_s is not None else time.perf_counter() - t0
        for seq in step.prefills + step.decodes:
            key = in_flight.get(seq.request_id)
            if key is None:
                continue
            timeline = records[key].timeline
            while len(timeline.tokens) < len(seq.output):
                timeline.tokens.append(seq.output[len(timeline.tokens)])
                timeline.token_times.append(now)
        for request_id, (session, turn) in list(in_flight.items()):
            try:
                out = llm.take_output(request_id)
            except KeyError:
                continue  # still running
            del in_flight[request_id]
            record = records[session, turn]
            record.timeline.finish_s, record.timeline.finish_reason = now, out.finish_reason
            record.num_cached_tokens = out.num_cached_tokens
            history[session] = history[session] + list(out.tokens)
            if turn + 1 < sessions[session].turns:
                submit(session, turn + 1)
    return [records[key] for key in sorted(records)]


def simulate_cache(sessions: Sequence[AgentSession], *, num_blocks: int, block_size: int, policy: str,
                   concurrency: int = 1, seed: int = 0) -> dict[str, float]:
    """The prefix cache alone over ``sessions``, without a model: ``concurrency`` sessions open at
    a time take turns round-robin (a new one opens as one ends), and each answer is ``max_tokens``
    random tokens (what decides a hit is that the next turn resends it, not what it says). What
    LRU eviction costs at a pool of ``num_blocks``: the token hit rate, the blocks evicted, and
    the fraction of later turns that found their whole conversation so far cached."""
    if not sessions or not all(isinstance(s, AgentSession) for s in sessions):
        raise ValueError("sessions must be a non-empty sequence of AgentSession")
    check_positive_int(concurrency, "concurrency")
    blocks = CachingBlockManager(num_blocks, block_size, policy)
    rng = random.Random(seed)
    queried = hit = full_hits = later_turns = 0
    waiting = list(range(len(sessions)))
    open_sessions: list[list] = []  # [session index, next turn, conversation so far]
    while waiting or open_sessions:
        while waiting and len(open_sessions) < concurrency:
            i = waiting.pop(0)
            open_sessions.append([i, 0, list(sessions[i].system)])
        for state in list(open_sessions):
            i, turn, history = state
            s = sessions[i]
            prompt = history + list(s.messages[turn])
            total = len(prompt) + s.max_tokens[turn]
            if blocks.blocks_needed(total) > num_blocks:
                raise ValueError(f"a turn of {total} tokens needs more than the pool's {num_blocks} blocks")
            prefix = blocks.cache.match(prompt)
            table = blocks.cache.claim(len(prompt), prefix) + blocks.allocate(total - len(prefix) * block_size)
            answer = [rng.randrange(1 << 30) for _ in range(s.max_tokens[turn])]
            blocks.cache.insert(prompt + answer[:-1], table)  # the last answer token is never stored
            blocks.free(table)
            queried += len(prompt)
            hit += len(prefix) * block_size
            if turn > 0:  # all a cache can hold of the conversation: its full blocks but the last token's
                later_turns += 1
                full_hits += len(prefix) * block_size >= (len(history) - 1) // block_size * block_size
            state[1], state[2] = turn + 1, prompt + answer
            if turn + 1 == s.turns:
                open_sessions.remove(state)
    return {"hit_rate": hit / queried, "evicted_blocks": blocks.cache.evicted_blocks,
            "turns_with_history_cached": full_hits / later_turns if later_turns else 1.0}


def hit_rate(records: Sequence[TurnRecord]) -> float:
    """Prompt tokens the prefix cache held over all prompt tokens served."""
    total = sum(r.prompt_len for r in records)
    return sum(r.num_cached_tokens for r in records) / total if total else 0.0


__all__ = ["AgentSession", "TurnRecord", "agent_trace", "hit_rate", "longest_conversation", "serve_sessions",
           "simulate_cache"]
