"""Forward passes of one sequence over ``n`` new tokens at a time, replayed from CUDA graphs.

Speculative decoding needs two kinds of target step: one token (plain decoding, and the
draft model's steps) and ``k + 1`` tokens (verification). Both must be cheap to launch:
at batch 1 the host takes longer to issue an eager step of the book's model than the GPU
takes to run it (see :mod:`labkit.models.generate`). :class:`labkit.models.GraphedDecoder`
graphs one-token steps only, because a :class:`~labkit.models.StaticKVCache` takes a
longer step's position from the host. Here every step count ``n`` in ``query_counts``
gets its own graph, and nothing in a step depends on the host's values:

- the ``n`` tokens' positions live in a device tensor (the Decoder's packed-batch input,
  which computes the rotary angles from it);
- the cache is a :class:`DenseStepKV`, which the Decoder hands each layer's attention
  (its ``attend`` method): it writes the new keys and values at those positions with
  ``index_copy_`` and attends over the *whole* capacity under the mask ``key <= query``.

Positions past the committed length may hold keys of rejected drafts; they are never
read, because a step writes its own positions before attending and the mask stops every
query at itself. Rejecting drafts is therefore only :meth:`StepRunner.truncate`, a host
integer. Off a GPU (or with ``use_graph=False``) the same static step runs eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import Decoder
from ..validate import check_cuda_graph_flag, check_positive_int, check_tensor


class DenseStepKV:
    """One sequence's keys and values, ``[layers, kv_heads, capacity, head_dim]``, and the attention
    of a step of ``n`` tokens at the device positions ``positions`` ``[n]`` (see the module docstring)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        # A chain of tokens is written at its positions and sees every key up to itself. A
        # tree of drafts (labkit.drafting) passes its own cache ``slots`` (consecutive, while
        # positions repeat across branches) and its ``mask`` [n, capacity] (prefix + ancestors).
        self.k, self.v, self.positions = k, v, positions
        self.slots = positions if slots is None else slots
        if mask is None:
            keys = torch.arange(k.shape[2], device=k.device)
            mask = keys[None, :] <= positions[:, None]  # [n, capacity]: built once per step, read by every layer
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[1, heads, n, d]``, ``k``, ``v`` ``[1, kv_heads, n, d]``; the attention output ``[1, heads, n, d]``."""
        self.k[layer].index_copy_(1, self.slots, k[0])
        self.v[layer].index_copy_(1, self.slots, v[0])
        return F.scaled_dot_product_attention(q, self.k[layer].unsqueeze(0), self.v[layer].unsqueeze(0),
                                              attn_mask=self.mask, enable_gqa=True)


class StepRunner:
    """Steps of one sequence through ``model``: :meth:`prefill` a prompt, then :meth:`step` ``n``
    tokens at a time, each ``n`` in ``query_counts`` from its own CUDA graph (others eagerly).

    >>> target = StepRunner(model, capacity=1024, query_counts=(1, 5))
    >>> logits = target.prefill(prompt)        # [T, vocab]
    >>> logits = target.step(tokens)           # tokens [5] on the device -> [5, vocab]
    >>> target.truncate(target.length - 3)     # forget the last three positions

    A replayed step's logits are the graph's output buffer: the next step of the same
    ``n`` overwrites them, so read (or clone) them first.
    """

    def __init__(self, model: Decoder, capacity: int, query_counts: tuple[int, ...] = (1,), *,
                 use_graph: bool | None = None) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
        check_positive_int(capacity, "capacity")
        if not isinstance(query_counts, tuple) or not query_counts:
            raise TypeError(f"query_counts must be a non-empty tuple of ints, got {query_counts!r}")
        for n in query_counts:
            check_positive_int(n, "each of query_counts")
        config, w = model.config, model.embed.weight
        if capacity > config.max_position_embeddings:
            raise ValueError(f"capacity {capacity} exceeds the model's {config.max_position_embeddings} positions")
        self.model, self.capacity, self.device = model, capacity, w.device
        self.use_graph = check_cuda_graph_flag(use_graph, "use_graph", w.device)
        shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.v = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.length = 0
        self._offsets = torch.arange(max(query_counts), device=w.device)
        # Per step count: the static inputs (ids [1, n], positions [n]), and once captured the graph and its logits.
        self._static = {n: (torch.zeros(1, n, dtype=torch.int64, device=w.device),
                            torch.zeros(n, dtype=torch.int64, device=w.device)) for n in sorted(set(query_counts))}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run ``prompt`` (``[T]`` or ``[1, T]`` ids) from position 0, eagerly; logits ``[T, vocab]``."""
        check_tensor(prompt, "prompt", ndim=(1, 2), dtypes=(torch.int32, torch.int64), device=self.device)
        ids = prompt.reshape(1, -1)
        if prompt.ndim == 2 and prompt.shape[0] != 1:
            raise ValueError(f"a StepRunner serves one sequence: prompt must be [T] or [1, T], got {tuple(prompt.shape)}")
        self.length = 0
        return self._eager(ids)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (``[n]`` ids on the model's device) after the cached ones; logits ``[n, vocab]``."""
        check_tensor(tokens, "tokens", ndim=1, dtypes=(torch.int32, torch.int64), device=self.device)
        n = tokens.shape[0]
        if not self.use_graph or n not in self._static:
            return self._eager(tokens.view(1, -1))
        self._check_room(n)
        ids, positions = self._static[n]
        ids[0].copy_(tokens)
        torch.add(self._offsets[:n], self.length, out=positions)
        if n not in self._graphs:
            self._capture(n)
        graph, logits = self._graphs[n]
        graph.replay()
        self.length += n
        return logits

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (rejected drafts are forgotten; nothing is copied)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.length = length

    def _check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise ValueError(f"{self.length} cached + {n} new positions exceed the capacity {self.capacity}")

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv = DenseStepKV(self.k, self.v, positions)
        return self.model(ids, kv, positions=positions)[0]

    def _eager(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        self._check_room(n)
        positions = torch.arange(self.length, self.length + n, device=self.device)
        logits = self._forward(ids, positions)
        self.length += n
        return logits

    def _capture(self, n: int) -> None:
        ids, positions = self._static[n]
        # One eager run first, on a side stream as torch requires: kernels compile and cuBLAS
        # picks its algorithms, which a capture may not do. It writes the positions this
        # step is about to write anyway.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(ids, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward(ids, positions)
        self._graphs[n] = (graph, logits)
