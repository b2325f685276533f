"""What an agent's context costs: a calculator for context-management strategies under
providers' prompt-caching prices.

An agent session is a system prompt, then turns: a new message (the user's task, then tool
outputs), and the model's answer. Every turn resends a *context*; a strategy decides what it
holds:

- ``full``: everything so far (the default of most agent loops);
- ``compaction``: once the history passes ``threshold`` tokens, one extra call summarizes it
  into ``summary_tokens`` and the summary replaces it;
- ``tool_pruning``: tool outputs older than the last ``keep_last`` turns shrink to a
  ``stub_tokens`` placeholder ("output elided");
- ``retrieval``: only the last ``keep_last`` turns stay verbatim; ``retrieved_tokens`` of
  older material, chosen anew each turn, stand in for the rest.

Prompt caching, on top of any strategy, bills the longest prefix a turn shares with the
previous request at the provider's cache-read price and the rest at the cache-write price
(Anthropic charges a premium to write; OpenAI caches automatically at the input price).
Prefixes are compared segment by segment (system prompt, each message, answer, summary,
stub, retrieved block), which is what decides a hit: a strategy that edits the history in
the middle (pruning, a new summary, new retrieved text) loses the cached suffix after the
edit. Caches expire after minutes of inactivity; the calculator assumes turns come faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..validate import check_choice, check_positive_int

STRATEGIES = ("full", "compaction", "tool_pruning", "retrieval")
SUMMARY_REQUEST_TOKENS = 200  # the instruction appended to the history when asking for a summary


@dataclass(frozen=True)
class TokenPrices:
    """US dollars per million tokens; ``cache_write`` is what a token costs the turn it enters the
    cache, ``cache_read`` each later turn it is read from it."""

    provider: str
    model: str
    input: float
    cache_write: float
    cache_read: float
    output: float
    as_of: str
    source: str


# Published list prices; each row says where and when it was read.
PRICES = {
    "Claude Opus 4.5": TokenPrices("Anthropic", "Claude Opus 4.5", input=5.0, cache_write=6.25, cache_read=0.50,
                                   output=25.0, as_of="2026-12",
                                   source="platform.claude.com/docs/en/about-claude/pricing (5-minute cache writes)"),
    "Claude Sonnet 4.5": TokenPrices("Anthropic", "Claude Sonnet 4.5", input=3.0, cache_write=3.75, cache_read=0.30,
                                     output=15.0, as_of="2026-12",
                                     source="platform.claude.com/docs/en/about-claude/pricing (5-minute cache writes)"),
    "GPT-4o (2024-08-06)": TokenPrices("OpenAI", "gpt-4o-2024-08-06", input=2.50, cache_write=2.50, cache_read=1.25,
                                       output=10.0, as_of="2024-10-01",
                                       source="openai.com/index/api-prompt-caching (automatic, prompts of 1024+ "
                                              "tokens)"),
}


@dataclass(frozen=True)
class AgentSession:
    """A session's token counts: the system prompt, then per turn the new message and the answer.
    Turn 0's message is the user's task; the later ones are tool outputs."""

    system_tokens: int
    message_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        check_positive_int(self.system_tokens, "system_tokens")
        if not self.message_tokens or len(self.message_tokens) != len(self.output_tokens):
            raise ValueError(f"message_tokens and output_tokens must be equally long and not empty, got "
                             f"{len(self.message_tokens)} and {len(self.output_tokens)}")
        for name in ("message_tokens", "output_tokens"):
            for n in getattr(self, name):
                check_positive_int(n, name)


def agent_session(turns: int, *, system_tokens: int, task_tokens: int, tool_tokens: int,
                  output_tokens: int) -> AgentSession:
    """A session of ``turns`` turns with constant sizes: a task, then tool outputs of ``tool_tokens``."""
    check_positive_int(turns, "turns")
    return AgentSession(system_tokens, (task_tokens,) + (tool_tokens,) * (turns - 1), (output_tokens,) * turns)


@dataclass(frozen=True)
class Strategy:
    """A context strategy and its knobs (see the module docstring); unused knobs are ignored."""

    name: str = "full"
    prompt_caching: bool = True
    threshold: int = 32_000
    summary_tokens: int = 2_000
    keep_last: int = 3
    stub_tokens: int = 20
    retrieved_tokens: int = 4_000

    def __post_init__(self) -> None:
        check_choice(self.name, "name", STRATEGIES)
        if not isinstance(self.prompt_caching, bool):
            raise TypeError(f"prompt_caching must be a bool, got {type(self.prompt_caching).__name__}")
        for knob in ("threshold", "summary_tokens", "keep_last", "stub_tokens", "retrieved_tokens"):
            check_positive_int(getattr(self, knob), knob)


@dataclass
class SessionCost:
    """What a session cost under one strategy and one price list, with its token counts by bill line."""

    dollars: float = 0.0
    uncached_input: int = 0      # tokens billed at the input or cache-write price
    cached_input: int = 0        # tokens billed at the cache-read price
    output: int = 0
    summary_calls: int = 0
    prompt_lengths: list[int] = field(default_factory=list)  # each turn's prompt, in tokens

    @property
    def hit_rate(self) -> float:
        total = self.uncached_input + self.cached_input
        return self.cached_input / total if total else 0.0


def _context(session: AgentSession, strategy: Strategy, turn: int, summary: tuple | None) -> list[tuple]:
    """The segments of turn ``turn``'s prompt: ``(kind, turn or id, tokens)`` in order."""
    segments = [("system", 0, session.system_tokens)]
    first = 0
    if summary is not None:
        segments.append(summary)
        first = summary[1]  # the turns it summarized are gone
    if strategy.name == "retrieval" and turn - first > strategy.keep_last:
        first = turn - strategy.keep_last
        segments.append(("retrieved", turn, strategy.retrieved_tokens))  # chosen anew: never a hit
    for t in range(first, turn):
        is_old_tool = strategy.name == "tool_pruning" and t > 0 and t < turn - strategy.keep_last
        segments.append(("stub", t, strategy.stub_tokens) if is_old_tool else ("message", t, session.message_tokens[t]))
        segments.append(("answer", t, session.output_tokens[t]))
    segments.append(("message", turn, session.message_tokens[turn]))
    return segments


def _shared_prefix_tokens(previous: list[tuple], current: list[tuple]) -> int:
    shared = 0
    for a, b in zip(previous, current):
        if a != b:
            break
        shared += a[2]
    return shared


def session_cost(session: AgentSession, strategy: Strategy, prices: TokenPrices) -> SessionCost:
    """Bill every turn (and every summarization call) of ``session`` under ``strategy`` at ``prices``."""
    if not isinstance(session, AgentSession):
        raise TypeError(f"session must be an AgentSession, got {type(session).__name__}")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a Strategy, got {type(strategy).__name__}")
    if not isinstance(prices, TokenPrices):
        raise TypeError(f"prices must be TokenPrices, got {type(prices).__name__}")
    cost, previous, summary = SessionCost(), [], None

    def bill(prompt: list[tuple], output_tokens: int) -> None:
        nonlocal previous
        total = sum(s[2] for s in prompt)
        cached = _shared_prefix_tokens(previous, prompt) if strategy.prompt_caching else 0
        new = total - cached
        cost.cached_input += cached
        cost.uncached_input += new
        cost.output += output_tokens
        write = prices.cache_write if strategy.prompt_caching else prices.input
        cost.dollars += (cached * prices.cache_read + new * write + output_tokens * prices.output) / 1e6
        previous = prompt

    for turn in range(len(session.message_tokens)):
        prompt = _context(session, strategy, turn, summary)
        history = sum(s[2] for s in prompt[1:-1])
        if strategy.name == "compaction" and history > strategy.threshold:
            # The summarization call reads the prompt so far (a cache hit on it) and writes the summary.
            bill(prompt[:-1] + [("instruction", turn, SUMMARY_REQUEST_TOKENS)], strategy.summary_tokens)
            cost.summary_calls += 1
            summary = ("summary", turn, strategy.summary_tokens)
            prompt = _context(session, strategy, turn, summary)
        bill(prompt, session.output_tokens[turn])
        cost.prompt_lengths.append(sum(s[2] for s in prompt))
    return cost


__all__ = ["PRICES", "STRATEGIES", "AgentSession", "SessionCost", "Strategy", "TokenPrices", "agent_session",
           "session_cost"]
