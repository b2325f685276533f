"""The end-to-end check that speculative sampling draws from the target: the first two tokens.

For one prompt, ``samples`` independent speculative steps run side by side (a batch of
copies of the prompt through the models' own caches): the draft samples ``k`` tokens,
the target scores them in one pass, the verifier keeps some. A row that emitted fewer
than two tokens gets its second from the target itself (what the next step would give,
and by the argument of :mod:`labkit.spec.verify` a correct step gives exactly that).
The pairs ``(y1, y2)`` must then follow the target's ``p(y1) p(y2 | y1)``, computed
exactly: one target pass over the prompt followed by each of the ``V`` possible first
tokens. Their counts go to :func:`labkit.spec.chi_square_test`.

Two tokens, not one, because the first alone never shows the bonus token (drawn only
after a kept draft) or a second draft judged in the light of the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import Decoder, KVCache
from ..validate import check_positive_int, check_tensor
from .stats import ChiSquare, chi_square_test
from .verify import exponential_race, verify_sampled


@dataclass(frozen=True)
class PairTest:
    """Observed counts and exact probabilities of the first two tokens (``[V * V]``, index ``y1 * V + y2``)."""

    counts: torch.Tensor
    probs: torch.Tensor
    test: ChiSquare
    mean_accepted: float


@torch.no_grad()
def _probs_after(model: Decoder, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    return (model(ids, last_only=True)[:, -1].float() / temperature).softmax(-1)


def _prefill_once(model: Decoder, prompt: torch.Tensor, capacity: int) -> tuple[KVCache, torch.Tensor]:
    """The prompt's cache at batch 1 and its last logits ``[1, V]``: every sample shares this prefix."""
    cache = model.new_cache(1, capacity)
    return cache, model(prompt[None], cache, last_only=True)[:, -1]


def _copies(model: Decoder, prefilled: KVCache, batch: int) -> KVCache:
    """A cache of ``batch`` rows, each holding the prefilled prompt (one prefill, not ``batch``)."""
    cache = model.new_cache(batch, prefilled.capacity)
    n = prefilled.length
    cache.k[:, :, :, :n] = prefilled.k[:, :, :, :n]
    cache.v[:, :, :, :n] = prefilled.v[:, :, :, :n]
    cache.length = n
    return cache


@torch.no_grad()
def first_two_tokens(target: Decoder, draft: Decoder, prompt: torch.Tensor, *, k: int, samples: int,
                     temperature: float = 1.0, generator: torch.Generator | None = None,
                     chunk: int = 4096) -> PairTest:
    """Run ``samples`` speculative steps of ``k`` drafts after ``prompt`` (``[T]``) and test their
    first two tokens against the target's exact distribution (see the module docstring)."""
    if not isinstance(target, Decoder) or not isinstance(draft, Decoder):
        raise TypeError("target and draft must be labkit Decoders")
    device = target.embed.weight.device
    check_tensor(prompt, "prompt", ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_positive_int(k, "k")
    check_positive_int(samples, "samples")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be a positive number (sampling), got {temperature!r}")
    vocab = target.config.vocab_size
    prompt = prompt.long()
    # The exact law: p(y1) from the prompt, p(y2 | y1) from the prompt followed by every y1.
    p1 = _probs_after(target, prompt[None], temperature)[0]
    every_first = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab, device=device)[:, None]], dim=1)
    p2 = _probs_after(target, every_first, temperature)                     # [V, V]
    exact = (p1[:, None] * p2).flatten()
    counts = torch.zeros(vocab * vocab, dtype=torch.int64, device=device)
    accepted_total = 0
    done = 0
    capacity = prompt.numel() + k
    target_prompt, target_logits = _prefill_once(target, prompt, capacity)
    draft_prompt, draft_prompt_logits = _prefill_once(draft, prompt, capacity)
    while done < samples:
        b = min(chunk, samples - done)
        target_cache, draft_cache = _copies(target, target_prompt, b), _copies(draft, draft_prompt, b)
        target_last = (target_logits.float() / temperature).softmax(-1).expand(b, -1)
        draft_logits = draft_prompt_logits.expand(b, -1)
        drafts, draft_probs = [], []
        for i in range(k):
            q = (draft_logits.float() / temperature).softmax(-1)
            x = exponential_race(q, generator)
            drafts.append(x)
            draft_probs.append(q)
            if i + 1 < k:
                draft_logits = draft(x[:, None], draft_cache, last_only=True)[:, -1]
        x = torch.stack(drafts, dim=1)                                      # [b, k]
        scored = (target(x, target_cache).float() / temperature).softmax(-1)  # p_2..p_{k+1}
        target_probs = torch.cat([target_last[:, None], scored], dim=1)    # [b, k + 1, V]
        verdict = verify_sampled(x, torch.stack(draft_probs, dim=1), target_probs, generator)
        n = verdict.num_accepted
        # The row emits x[:n], then next: y1 is x1 if kept, y2 is x2 if kept (n >= 2), else next if n == 1.
        y1 = torch.where(n >= 1, x[:, 0], verdict.next_token)
        second = torch.where(n >= 2, x[:, 1], verdict.next_token) if k >= 2 else verdict.next_token
        completion = exponential_race(p2[y1], generator)                    # rows that emitted only y1
        y2 = torch.where(n >= 1, second, completion)
        counts += torch.bincount(y1 * vocab + y2, minlength=vocab * vocab)
        accepted_total += int(n.sum())
        done += b
    return PairTest(counts.cpu(), exact.cpu(), chi_square_test(counts.cpu(), exact.cpu()), accepted_total / samples)


def random_distributions(rows: int, vocab: int, generator: torch.Generator, sharpness: float = 1.5) -> torch.Tensor:
    """``rows`` random distributions over ``vocab`` tokens (float64), unevenly peaked:
    the softmax of normals scaled by ``sharpness``."""
    return (sharpness * torch.randn(rows, vocab, generator=generator, dtype=torch.float64)).softmax(-1)


def first_two_tokens_on_tables(verify, *, k: int, vocab: int, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test of :func:`first_two_tokens` on made-up distributions instead of models, for any
    ``verify(draft_tokens, draft_probs, target_probs, generator) -> Verdict`` with ``k`` 1 or 2.

    The target's and the draft's second-position distributions depend on the first token
    (random tables ``[V, V]``); the third position (``k = 2``'s bonus) does not matter for two
    tokens. Returns the counts of ``(y1, y2)`` (``[V * V]``) and their exact law."""
    if k not in (1, 2):
        raise ValueError(f"k must be 1 or 2 (the first two tokens), got {k!r}")
    gen = torch.Generator().manual_seed(seed)
    p1, q1 = random_distributions(1, vocab, gen)[0], random_distributions(1, vocab, gen)[0]
    p2, q2 = random_distributions(vocab, vocab, gen), random_distributions(vocab, vocab, gen)
    p3 = random_distributions(1, vocab, gen)[0].expand(samples, vocab)
    x1 = torch.multinomial(q1, samples, replacement=True, generator=gen)
    x2 = torch.multinomial(q2[x1], 1, generator=gen)[:, 0]
    drafts = torch.stack([x1, x2], dim=1)[:, :k]
    draft_probs = torch.stack([q1.expand(samples, vocab), q2[x1]], dim=1)[:, :k]
    target_probs = torch.stack([p1.expand(samples, vocab), p2[x1], p3], dim=1)[:, :k + 1]
    verdict = verify(drafts, draft_probs, target_probs, gen)
    n = verdict.num_accepted
    y1 = torch.where(n >= 1, drafts[:, 0], verdict.next_token)
    second = torch.where(n >= 2, drafts[:, k - 1], verdict.next_token)
    completion = torch.multinomial(p2[y1], 1, generator=gen)[:, 0]    # a row that emitted one token: the next step
    y2 = torch.where(n >= 1, second, completion)
    return torch.bincount(y1 * vocab + y2, minlength=vocab * vocab), (p1[:, None] * p2).flatten()
