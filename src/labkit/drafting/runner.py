"""The target's forward pass over a tree of candidates, replayed from a CUDA graph per tree size.

:class:`TreeRunner` is :class:`labkit.spec.StepRunner` with a second kind of step. A tree
step of ``n`` nodes writes their keys and values at ``n`` consecutive cache *slots* after
the committed ones, gives node ``i`` the rotary *position* ``length + depth[i]``, and
attends under a mask ``[n, capacity]``: every committed key, then the tree mask over the
step's own slots. The tokens, depths and tree mask are copied into static device buffers
before the replay, so one graph serves every tree of that size, fixed (Medusa) or made
anew each step (EAGLE-2), and nothing in the step waits on the host. The step returns
the logits and the final hidden states (the features Medusa's and EAGLE's heads read).

After verification the accepted nodes sit at scattered slots; :meth:`TreeRunner.commit`
copies their keys and values down to consecutive slots (one gather per cache, all layers
at once) and moves the length: the rest of the tree is forgotten without a copy.
"""

from __future__ import annotations

import torch

from ..models import Decoder
from ..spec import DenseStepKV, StepRunner
from ..validate import check_tensor


class TreeRunner(StepRunner):
    """A :class:`~labkit.spec.StepRunner` that also runs trees (``tree_sizes``: one graph each).

    >>> runner = TreeRunner(target, capacity=1024, tree_sizes=(26,))
    >>> logits, hidden = runner.prefill_hidden(prompt)
    >>> logits, hidden = runner.tree_step(tokens, depth, mask)      # [26, V], [26, H]
    >>> runner.commit(path, count)                                  # keep path[:count], in order
    """

    def __init__(self, model: Decoder, capacity: int, tree_sizes: tuple[int, ...] = (), *,
                 query_counts: tuple[int, ...] = (1,), use_graph: bool | None = None) -> None:
        super().__init__(model, capacity, query_counts, use_graph=use_graph)
        if not isinstance(tree_sizes, tuple):
            raise TypeError(f"tree_sizes must be a tuple of ints, got {tree_sizes!r}")
        device = self.device
        self._keys = torch.arange(capacity, device=device)
        self._length = torch.zeros((), dtype=torch.int64, device=device)  # the committed length, on the device
        # Per tree size: static tokens [n], depths [n], tree mask [n, n]; once captured, the graph and its outputs.
        self._tree_static = {n: (torch.zeros(n, dtype=torch.int64, device=device),
                                 torch.zeros(n, dtype=torch.int64, device=device),
                                 torch.eye(n, dtype=torch.bool, device=device)) for n in set(tree_sizes)}
        self._tree_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def prefill_hidden(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``prompt`` ``[T]`` from position 0, eagerly: logits ``[T, V]`` and hidden states ``[T, H]``."""
        check_tensor(prompt, "prompt", ndim=1, dtypes=(torch.int32, torch.int64), device=self.device)
        self.length = 0
        self._check_room(prompt.numel())
        positions = torch.arange(prompt.numel(), device=self.device)
        hidden = self.model(prompt.view(1, -1), DenseStepKV(self.k, self.v, positions), positions=positions,
                            hidden_only=True)[0]
        self.length = prompt.numel()
        return self.model.lm_head(hidden), hidden

    @torch.no_grad()
    def tree_step(self, tokens: torch.Tensor, depth: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a tree of ``n`` nodes after the committed tokens: ``tokens`` ``[n]`` (node 0, the root, is
        the last emitted token), ``depth`` ``[n]``, ``mask`` ``[n, n]`` (see :mod:`labkit.drafting.tree`).
        Returns logits ``[n, V]`` and hidden states ``[n, H]`` (graph buffers: read them before the next
        step of this size). The committed length does not move until :meth:`commit`."""
        check_tensor(tokens, "tokens", ndim=1, dtypes=(torch.int64,), device=self.device)
        n = tokens.shape[0]
        check_tensor(depth, "depth", ndim=1, dtypes=(torch.int64,), device=self.device)
        check_tensor(mask, "mask", ndim=2, dtypes=(torch.bool,), device=self.device)
        if depth.shape[0] != n or mask.shape != (n, n):
            raise ValueError(f"a tree of {n} tokens needs depth [{n}] and mask [{n}, {n}], got "
                             f"{tuple(depth.shape)} and {tuple(mask.shape)}")
        self._check_room(n)
        self._length.fill_(self.length)
        if not self.use_graph or n not in self._tree_static:
            return self._tree_forward(tokens, depth, mask)
        static_tokens, static_depth, static_mask = self._tree_static[n]
        static_tokens.copy_(tokens)
        static_depth.copy_(depth)
        static_mask.copy_(mask)
        if n not in self._tree_graphs:
            self._capture_tree(n)
        graph, logits, hidden = self._tree_graphs[n]
        graph.replay()
        return logits, hidden

    def commit(self, path: torch.Tensor, count: int) -> None:
        """Keep the tree nodes ``path[:count]`` (device indices into the last tree step, root first)
        as the next ``count`` committed positions, copying their keys and values into place."""
        check_tensor(path, "path", ndim=1, dtypes=(torch.int64,), device=self.device)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= path.shape[0]:
            raise ValueError(f"count must be an int in [1, {path.shape[0]}], got {count!r}")
        self._check_room(path.shape[0])
        # All of path moves (a fixed shape; the padding lands past the new length, where nothing reads).
        src, dst = self.length + path, self.length + torch.arange(path.shape[0], device=self.device)
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))
        self.length += count

    def _tree_forward(self, tokens: torch.Tensor, depth: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[0]
        slots = self._length + torch.arange(n, device=self.device)
        rel = self._keys - self._length  # each key's slot relative to the tree's first
        inside = (rel >= 0) & (rel < n)
        full = (rel < 0)[None, :] | (inside[None, :] & mask[:, rel.clamp(0, n - 1)])
        kv = DenseStepKV(self.k, self.v, self._length + depth, slots=slots, mask=full)
        hidden = self.model(tokens.view(1, -1), kv, positions=self._length + depth, hidden_only=True)[0]
        return self.model.lm_head(hidden), hidden

    def _capture_tree(self, n: int) -> None:
        tokens, depth, mask = self._tree_static[n]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one eager run first: kernels compile, cuBLAS picks algorithms
            self._tree_forward(tokens, depth, mask)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, hidden = self._tree_forward(tokens, depth, mask)
        self._tree_graphs[n] = (graph, logits, hidden)
