"""Greedy generation four ways, so a chapter can show that they agree and what each costs.

- ``"recompute"``: every step runs the whole sequence so far through the model, the way a
  model without a cache must: step ``t`` costs a forward pass over ``t`` tokens.
- ``"growing"``: a :class:`~labkit.models.GrowingKVCache`; one token per step, and the
  cache is copied (``torch.cat``) at every step.
- ``"preallocated"``: a :class:`~labkit.models.KVCache` sized for the whole generation.
- ``"graphed"``: a :class:`GraphedDecoder`, the way serving engines decode: a
  :class:`~labkit.models.StaticKVCache` and, on a GPU, every step replayed from one
  captured CUDA graph.

Why graphs: a decode step of a small batch does little work per kernel, and eager PyTorch
issues each of its kernels from Python (some twenty per layer, each a few microseconds of
host time to launch). At the book's model's size the host then takes longer to issue a
step than the GPU takes to run it, and the GPU waits. A CUDA graph records the step's
kernels once, with their arguments and addresses; replaying it is one launch. That needs
a step whose kernels and arguments never change, which is what the static cache provides:
its position and lengths live in device tensors that the host overwrites before each
replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_choice, check_cuda_graph_flag, check_positive_int, check_tensor
from .cache import GrowingKVCache, StaticKVCache
from .decoder import Decoder

CACHE_MODES = ("recompute", "growing", "preallocated", "graphed")


@dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor   # [batch, new] greedy picks
    logits: torch.Tensor   # [batch, new, vocab] the logits each pick was taken from


class GraphedDecoder:
    """One-token decode steps of ``model`` over a :class:`~labkit.models.StaticKVCache`,
    captured in a CUDA graph on the first step and replayed for every later one.

    >>> runner = GraphedDecoder(model, batch=4, capacity=4096)
    >>> logits = runner.prefill(prompt)                         # eager, [batch, vocab]
    >>> logits = runner.step(logits.argmax(-1, keepdim=True))   # one replay per token

    ``use_graph`` defaults to whether the model is on a CUDA device. Without a graph the
    same fixed-shape step runs eagerly, which is how the CPU tests check its logic. A
    step's logits are the graph's output buffer: the next step overwrites them, so clone
    what you keep.
    """

    def __init__(self, model: Decoder, batch: int, capacity: int, *, use_graph: bool | None = None) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
        check_positive_int(batch, "batch")
        check_positive_int(capacity, "capacity")
        w = model.embed.weight
        self.model = model
        self.use_graph = check_cuda_graph_flag(use_graph, "use_graph", w.device)
        self.cache = StaticKVCache(model.config, batch, capacity, dtype=w.dtype, device=w.device)
        self.ids = torch.zeros(batch, 1, dtype=torch.int64, device=w.device)  # the step's static input
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run ``prompt`` ``[batch, T]`` into the cache eagerly; the last position's logits."""
        return self.model(prompt, self.cache, last_only=True)[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence (``[batch, 1]``); the next logits, ``[batch, vocab]``."""
        check_tensor(tokens, "tokens", ndim=2, dtypes=(torch.int32, torch.int64), device=self.ids.device)
        if tokens.shape != self.ids.shape:
            raise ValueError(f"tokens must be [batch, 1] = {tuple(self.ids.shape)}, got {tuple(tokens.shape)}")
        self.ids.copy_(tokens)
        self.cache.stage_step()
        if not self.use_graph:
            return self._forward()[:, -1]
        if self._graph is None:
            self._capture()
        self._graph.replay()
        self.cache.advance(1)  # the replay ran the kernels, not the Python that counts
        return self._logits[:, -1]

    def _capture(self) -> None:
        length = self.cache.length
        # One eager step first, on a side stream as torch requires: it compiles the Triton
        # kernels and lets cuBLAS choose its algorithms, none of which a capture may do.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.cache.truncate(length)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self._forward()
        self.cache.truncate(length)  # the capture ran the Python (and its advance), no kernel
        self._graph = graph

    def _forward(self) -> torch.Tensor:
        """The step a graph records: its inputs are the static ids and the cache's device tensors."""
        return self.model(self.ids, self.cache, last_only=True)


@torch.no_grad()
def generate_greedy(model: Decoder, prompt: torch.Tensor, new_tokens: int, *,
                    cache: str = "preallocated", decode_kernel: bool = False) -> Generation:
    """Extend ``prompt`` ``[batch, T]`` by ``new_tokens`` argmax tokens.

    ``decode_kernel`` sends the cached modes' decode steps through the Triton kernel
    (``"graphed"`` always uses it).
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
    check_tensor(prompt, "prompt", ndim=2, dtypes=(torch.int32, torch.int64))
    check_positive_int(new_tokens, "new_tokens")
    check_choice(cache, "cache", CACHE_MODES)
    batch, prompt_len = prompt.shape
    picks, all_logits = [], []
    if cache == "graphed":
        runner = GraphedDecoder(model, batch, prompt_len + new_tokens)
        logits = runner.prefill(prompt)
        for i in range(new_tokens):
            token = logits.argmax(-1, keepdim=True)
            picks.append(token)
            all_logits.append(logits)
            if i + 1 < new_tokens:
                logits = runner.step(token).clone()
        return Generation(torch.cat(picks, dim=1), torch.stack(all_logits, dim=1))
    if cache == "recompute":
        kv = None
    elif cache == "growing":
        w = model.embed.weight
        kv = GrowingKVCache(model.config, batch, dtype=w.dtype, device=w.device)
    else:
        kv = model.new_cache(batch, prompt_len + new_tokens)
    ids, step_input = prompt, prompt
    for _ in range(new_tokens):
        logits = model(step_input if kv is not None else ids, kv, last_only=True,
                       decode_kernel=decode_kernel)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        picks.append(token)
        all_logits.append(logits)
        ids = torch.cat([ids, token], dim=1)
        step_input = token
    return Generation(torch.cat(picks, dim=1), torch.stack(all_logits, dim=1))
