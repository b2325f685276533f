"""Drafts that need no training: prompt lookup, Jacobi iteration, and lookahead's n-gram pool.

- :func:`prompt_lookup`: the text so far often repeats itself (code, quotes, edits of a
  document in the prompt). Take its last ``n`` tokens, find their latest earlier
  occurrence, and propose the tokens that followed it (Saxena's prompt-lookup decoding;
  vLLM's and Hugging Face's n-gram proposers).
- :func:`jacobi_decode`: greedy decoding as a fixed point. Guess the next ``m`` tokens,
  run the model once over the prompt and the guesses, and replace every guess by the
  argmax after the tokens before it. The first guess is then right (it follows the
  prompt alone), and each iteration fixes at least one more; at the fixed point every
  token is the argmax after its prefix, which is greedy decoding's output (Santilli et
  al. 2023; Song et al. 2021).
- :class:`NGramPool`: lookahead decoding (Fu et al. 2024) keeps the Jacobi iterates of
  the last few steps and reads n-grams off them diagonally (a token from one iteration,
  the next token from the following iteration, which was computed after it); verified
  later against the target like any draft.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from ..models import Decoder
from ..validate import check_positive_int, check_tensor


def prompt_lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``context``'s last ``n``
    tokens, for the longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs; ``[]`` if none."""
    check_positive_int(k, "k")
    check_positive_int(max_ngram, "max_ngram")
    check_positive_int(min_ngram, "min_ngram")
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
    if not isinstance(context, (list, tuple)):
        raise TypeError(f"context must be a list of token ids, got {type(context).__name__}")
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n:])
        # The latest start s < length - n with context[s:s+n] == suffix (not the suffix itself).
        for start in range(length - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return list(context[start + n:start + n + k])
    return []


@torch.no_grad()
def jacobi_decode(model: Decoder, prompt: torch.Tensor, new_tokens: int,
                  guesses: torch.Tensor | None = None, max_iterations: int | None = None) -> tuple[list[int], int]:
    """Greedy decoding of ``new_tokens`` tokens after ``prompt`` ``[T]`` by Jacobi iteration from
    ``guesses`` (``[new_tokens]``; default: the prompt's last token repeated). Returns the fixed
    point and the number of forward passes it took (at most ``new_tokens``: each fixes one more)."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
    check_tensor(prompt, "prompt", ndim=1, dtypes=(torch.int32, torch.int64))
    check_positive_int(new_tokens, "new_tokens")
    if guesses is None:
        guesses = prompt[-1:].long().repeat(new_tokens)
    check_tensor(guesses, "guesses", ndim=1, dtypes=(torch.int32, torch.int64), device=prompt.device)
    if guesses.shape[0] != new_tokens:
        raise ValueError(f"guesses must be [{new_tokens}], got {tuple(guesses.shape)}")
    limit = new_tokens if max_iterations is None else check_positive_int(max_iterations, "max_iterations")
    guesses, t = guesses.long(), prompt.numel()
    for iteration in range(1, limit + 1):
        logits = model(torch.cat([prompt.long(), guesses])[None])[0]
        updated = logits[t - 1:t - 1 + new_tokens].argmax(-1)  # position t-1+i predicts token i
        if torch.equal(updated, guesses):
            return guesses.tolist(), iteration
        guesses = updated
    return guesses.tolist(), limit


class NGramPool:
    """Lookahead decoding's n-gram pool: n-grams keyed by their first token, at most ``per_key``
    per key (the most recent kept), gathered diagonally from the last ``n`` Jacobi iterates."""

    def __init__(self, n: int, per_key: int) -> None:
        self.n = check_positive_int(n, "n")
        if n < 2:
            raise ValueError(f"n-grams must have n >= 2 (a first token and at least one to propose), got {n}")
        self.per_key = check_positive_int(per_key, "per_key")
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: deque[dict[int, int]] = deque(maxlen=n)

    def add(self, ngram: tuple[int, ...]) -> None:
        """Remember one n-gram (its first token is the key; the rest is what it proposes)."""
        tails = self.pool.setdefault(ngram[0], OrderedDict())
        tails.pop(ngram[1:], None)
        tails[ngram[1:]] = None
        while len(tails) > self.per_key:
            tails.popitem(last=False)

    def add_level(self, level: dict[int, int]) -> None:
        """One Jacobi iterate, ``{absolute position: token}``; adds the n-grams read diagonally across
        the last ``n`` iterates (position ``p`` from the oldest, ``p + 1`` from the next, ...)."""
        self.levels.append(dict(level))
        if len(self.levels) < self.n:
            return
        oldest = self.levels[0]
        for p in oldest:
            gram = [oldest[p]]
            for j in range(1, self.n):
                token = self.levels[j].get(p + j)
                if token is None:
                    break
                gram.append(token)
            if len(gram) == self.n:
                self.add(tuple(gram))

    def lookup(self, token: int) -> list[tuple[int, ...]]:
        """The tails of the n-grams that start with ``token``, most recent first."""
        return list(reversed(self.pool.get(token, {})))
