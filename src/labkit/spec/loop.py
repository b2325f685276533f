"""Plain decoding and draft-then-verify decoding of one sequence, on :class:`StepRunner` s.

Both loops keep the state a serving engine keeps: every token emitted so far is in the
runners' caches except the last one, which the next step feeds. A speculative step:

1. the draft proposes ``k`` tokens, one graphed step each, sampling (or taking the
   argmax) on the device;
2. the target runs once over the last emitted token and the ``k`` drafts (``k + 1``
   query tokens, one graph), giving ``p_1..p_{k+1}``;
3. the verifier (:mod:`labkit.spec.verify`) keeps ``n`` drafts and adds one token;
   this is the only point where the host reads anything back from the device;
4. both caches are cut back to the kept tokens (a host integer each).

When all ``k`` drafts are kept the draft model never saw its own last draft, so the next
step first feeds it that token too. With ``temperature`` 0 the loop is greedy and the
output is plain greedy decoding's, token for token (up to ties that the ``k + 1``-token
and one-token forwards round differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..validate import check_positive_int, check_tensor
from .runner import StepRunner
from .verify import exponential_race, verify_greedy, verify_sampled


@dataclass
class SpecOutput:
    """The generated ``tokens`` and, per verification step, how many drafts it kept."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    k: int = 0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward (plain decoding: 1)."""
        return len(self.tokens) / self.steps if self.steps else 1.0


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    return float(temperature)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.float() / temperature).softmax(dim=-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token(s) from ``logits`` ``[..., V]`` on the device: the argmax, or a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return exponential_race(_probs(logits, temperature), generator)


def _start(runner: StepRunner, prompt: torch.Tensor, new_tokens: int, room: int) -> torch.Tensor:
    check_tensor(prompt, "prompt", ndim=1, dtypes=(torch.int32, torch.int64), device=runner.device)
    check_positive_int(new_tokens, "new_tokens")
    if prompt.numel() + new_tokens + room > runner.capacity:
        raise ValueError(f"prompt ({prompt.numel()}) + new_tokens ({new_tokens}) + {room} positions of "
                         f"drafts exceed the runner's capacity {runner.capacity}")
    return runner.prefill(prompt)[-1]


@torch.no_grad()
def generate_plain(target: StepRunner, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[int]:
    """``new_tokens`` tokens after ``prompt`` (``[T]``), one target step each (the baseline).
    Nothing is read back until the end: the steps queue on the device back to back."""
    temperature = _check_temperature(temperature)
    logits = _start(target, prompt, new_tokens, 0)
    picks = []
    for i in range(new_tokens):
        token = _pick(logits, temperature, generator).view(1)
        picks.append(token)
        if i + 1 < new_tokens:
            logits = target.step(token)[0]
    return torch.cat(picks).tolist()


@torch.no_grad()
def generate_speculative(target: StepRunner, draft: StepRunner, prompt: torch.Tensor, new_tokens: int, *,
                         k: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                         stop_token_ids: tuple[int, ...] = ()) -> SpecOutput:
    """``new_tokens`` tokens after ``prompt``, ``k`` drafts per target step (see the module docstring);
    fewer when a token of ``stop_token_ids`` is emitted (it is kept, and nothing after it).

    ``target`` should have a graph for ``k + 1`` query tokens and ``draft`` for 1."""
    check_positive_int(k, "k")
    stops = set(stop_token_ids)
    temperature = _check_temperature(temperature)
    if target.device != draft.device:
        raise ValueError(f"target and draft must be on one device, got {target.device} and {draft.device}")
    if target.model.config.vocab_size != draft.model.config.vocab_size:
        raise ValueError(f"target and draft must share a vocabulary, got {target.model.config.vocab_size} "
                         f"and {draft.model.config.vocab_size} tokens")
    target_logits = _start(target, prompt, new_tokens, k + 1)
    draft_logits = _start(draft, prompt, new_tokens, k + 1)
    first = _pick(target_logits, temperature, generator).view(1)
    out = SpecOutput(tokens=[int(first)], k=k)
    pending = first              # emitted, in neither cache yet: what the target step feeds first
    draft_backlog = first        # what the draft must still read before proposing (1 or 2 tokens)
    while len(out.tokens) < new_tokens and out.tokens[-1] not in stops:
        for token in draft_backlog[:-1]:
            draft.step(token.view(1))
        x = draft_backlog[-1:]
        drafts, draft_probs = [], []
        for _ in range(k):
            logits = draft.step(x)[0]
            x = _pick(logits, temperature, generator).view(1)
            drafts.append(x)
            if temperature > 0:
                draft_probs.append(_probs(logits, temperature))
        proposal = torch.cat(drafts)                                   # [k]
        start = target.length
        logits = target.step(torch.cat([pending, proposal]))          # [k + 1, V]
        if temperature == 0:
            verdict = verify_greedy(proposal.view(1, k), logits.unsqueeze(0))
        else:
            verdict = verify_sampled(proposal.view(1, k), torch.stack(draft_probs).unsqueeze(0),
                                     _probs(logits, temperature).unsqueeze(0), generator)
        n, next_token, *proposed = torch.cat([verdict.num_accepted, verdict.next_token, proposal]).tolist()
        out.accepted.append(n)
        out.tokens += proposed[:n] + [next_token]
        target.truncate(start + 1 + n)                 # pending and the n kept drafts
        draft.truncate(min(draft.length, start + 1 + n))
        pending = verdict.next_token.view(1)
        # All k kept: the draft read pending and drafts 1..k-1, not draft k.
        draft_backlog = torch.cat([proposal[k - 1:], pending]) if n == k else pending
    del out.tokens[new_tokens:]
    for i, token in enumerate(out.tokens):
        if token in stops:
            del out.tokens[i + 1:]
            break
    return out
