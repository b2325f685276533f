"""Greedy generation three ways, so a chapter can show that they agree and what each costs.

- ``"recompute"``: every step runs the whole sequence so far through the model, the way a
  model without a cache must: step ``t`` costs a forward pass over ``t`` tokens.
- ``"growing"``: a :class:`~labkit.models.GrowingKVCache`; one token per step, and the
  cache is copied (``torch.cat``) at every step.
- ``"preallocated"``: a :class:`~labkit.models.KVCache` sized for the whole generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_choice, check_positive_int, check_tensor
from .cache import GrowingKVCache
from .decoder import Decoder

CACHE_MODES = ("recompute", "growing", "preallocated")


@dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor   # [batch, new] greedy picks
    logits: torch.Tensor   # [batch, new, vocab] the logits each pick was taken from


@torch.no_grad()
def generate_greedy(model: Decoder, prompt: torch.Tensor, new_tokens: int, *,
                    cache: str = "preallocated", decode_kernel: bool = False) -> Generation:
    """Extend ``prompt`` ``[batch, T]`` by ``new_tokens`` argmax tokens."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
    check_tensor(prompt, "prompt", ndim=2, dtypes=(torch.int32, torch.int64))
    check_positive_int(new_tokens, "new_tokens")
    check_choice(cache, "cache", CACHE_MODES)
    batch, prompt_len = prompt.shape
    if cache == "recompute":
        kv = None
    elif cache == "growing":
        w = model.embed.weight
        kv = GrowingKVCache(model.config, batch, dtype=w.dtype, device=w.device)
    else:
        kv = model.new_cache(batch, prompt_len + new_tokens)
    ids, step_input = prompt, prompt
    picks, all_logits = [], []
    for _ in range(new_tokens):
        logits = model(step_input if kv is not None else ids, kv, last_only=True,
                       decode_kernel=decode_kernel)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        picks.append(token)
        all_logits.append(logits)
        ids = torch.cat([ids, token], dim=1)
        step_input = token
    return Generation(torch.cat(picks, dim=1), torch.stack(all_logits, dim=1))
