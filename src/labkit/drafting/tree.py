"""Trees of candidate tokens, verified in one forward pass under a tree attention mask.

A tree of ``n`` nodes is given by ``parents``: ``parents[0] == -1`` (the root: the last
emitted token, in no cache yet) and ``parents[i] < i`` for every other node. Node ``i``
continues the text of its ancestors, so in the target's forward pass it must

- sit at rotary position ``length + depth[i]`` (its depth in the tree, not its index:
  siblings share a position), and
- attend to the committed prefix and to its ancestors and itself, nothing else: row ``i``
  of the *tree mask* is true at ``j`` exactly when ``j`` is ``i`` or an ancestor of ``i``.

Then the logits at node ``i`` are the ones plain decoding would compute after the path to
``i``, for every branch at once (SpecInfer; Medusa; EAGLE). Greedy verification keeps the
deepest node whose whole path matches the target's own argmax (each node's token equals
the argmax at its parent), emits that path's tokens and the argmax after it. Every
function here runs on the device without reading anything back, except where it says so.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def check_parents(parents: Sequence[int]) -> list[int]:
    """``parents`` as a list of ints, or a ValueError that says what is wrong with it."""
    if isinstance(parents, torch.Tensor):
        parents = parents.tolist()
    if not isinstance(parents, (list, tuple)) or not parents:
        raise ValueError(f"parents must be a non-empty list of ints, got {parents!r}")
    out = []
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"parents[{i}] must be an int, got {p!r}")
        if i == 0 and p != -1:
            raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {p}")
        if i > 0 and not 0 <= p < i:
            raise ValueError(f"parents[{i}] must be a node before it, in [0, {i}), got {p}")
        out.append(p)
    return out


def tree_depths(parents: Sequence[int]) -> torch.Tensor:
    """Each node's depth (the root's is 0): ``[n]`` int64. Its rotary position is ``length + depth``."""
    parents = check_parents(parents)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return torch.tensor(depth, dtype=torch.int64)


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """The tree attention mask ``[n, n]`` (bool): ``mask[i, j]`` when ``j`` is ``i`` or an ancestor of ``i``."""
    parents = check_parents(parents)
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]  # parents come first, so row parents[i] is complete
    return mask


def parents_from_mask(mask: torch.Tensor) -> list[int]:
    """The inverse of :func:`tree_mask`: each node's deepest strict ancestor (-1 for the root)."""
    depth = mask.sum(-1) - 1
    strict = mask & ~torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
    parents = torch.where(strict.any(-1), (strict * (depth[None, :] + 1)).argmax(-1), -1)
    return parents.tolist()


@dataclass(frozen=True)
class Tree:
    """A static tree of candidates: ``parents`` (host), ``depth`` ``[n]`` and ``mask`` ``[n, n]``, and, for a
    Medusa-style tree, ``ranks``: which of its parent's head's top-k each node takes (the root's is 0)."""

    parents: tuple[int, ...]
    depth: torch.Tensor
    mask: torch.Tensor
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def to(self, device: torch.device | str) -> Tree:
        return Tree(self.parents, self.depth.to(device), self.mask.to(device), self.ranks)


def tree_from_choices(choices: Sequence[Sequence[int]]) -> Tree:
    """A tree from Medusa's ``choices``: each a path of top-k ranks from the root (``(0, 1)``: the
    best token of the first head, then the second best of the second head after it). Every
    prefix of a path must be a path too. Nodes are ordered by depth, then as listed."""
    paths = [tuple(c) for c in choices]
    for path in paths:
        if not path or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(f"each choice must be a non-empty path of ranks >= 0, got {path!r}")
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"choice {path} has no parent {path[:-1]} among the choices")
    if len(set(paths)) != len(paths):
        raise ValueError("choices must be distinct")
    ordered = sorted(paths, key=lambda p: (len(p), paths.index(p)))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in ordered:
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return Tree(tuple(parents), tree_depths(parents), tree_mask(parents), tuple(ranks))


def chain(k: int) -> Tree:
    """The chain of ``k`` drafts after the root: plain speculative decoding's "tree"."""
    return tree_from_choices([(0,) * d for d in range(1, k + 1)])


def best_choices(accuracy: torch.Tensor, size: int) -> list[tuple[int, ...]]:
    """The ``size`` paths most likely to be accepted, given ``accuracy[d, r]``: the chance that
    rank ``r`` of head ``d`` is the right token (measured on held-out text).

    The expected number of accepted drafts is the sum, over the tree's nodes, of the chance
    that the node's whole path is right; assuming heads right independently, that is the
    product of its ranks' accuracies. A child's product is at most its parent's, so taking
    nodes best-first always yields a tree: Medusa's construction of its sparse trees."""
    if not isinstance(accuracy, torch.Tensor) or accuracy.ndim != 2:
        raise ValueError(f"accuracy must be a [heads, top_k] tensor, got {getattr(accuracy, 'shape', accuracy)!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    heads, top_k = accuracy.shape
    acc = accuracy.double().tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(top_k)]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < heads:
            for r in range(top_k):
                heapq.heappush(frontier, (neg * acc[len(path)][r], path + (r,)))
    return chosen


def greedy_accept(tokens: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor, target_argmax: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy acceptance walk, on the device: ``(best, path)``.

    ``tokens`` ``[n]`` (the root's is the pending token), ``mask`` ``[n, n]`` the tree mask,
    ``depth`` ``[n]`` (at most ``max_depth``), ``target_argmax`` ``[n]`` the target's argmax at
    every node. A node *matches* when its token is the argmax at its parent; it is accepted
    when it and all its ancestors match (the root always does). ``best`` is the deepest
    accepted node (distinct sibling tokens make it unique); ``path`` ``[max_depth + 1]``
    holds the accepted nodes by depth, then ``best`` again as padding. The step emits
    ``tokens[path[1:depth[best] + 1]]`` and then ``target_argmax[best]``."""
    n = tokens.shape[0]
    strict = mask & ~torch.eye(n, dtype=torch.bool, device=mask.device)
    # A node's parent is its deepest strict ancestor; the root has none (it matches by definition).
    parent = torch.where(strict.any(-1), (strict * (depth[None, :] + 1)).argmax(-1), 0)
    matches = (tokens == target_argmax[parent]) | (depth == 0)
    accepted = ~(mask & ~matches[None, :]).any(-1)
    best = torch.argmax(torch.where(accepted, depth, -1))
    # Scatter the path's nodes to their depths; deeper slots keep best (an index that exists).
    path = best.expand(max_depth + 2).clone()
    path.scatter_(0, torch.where(mask[best], depth, max_depth + 1), torch.arange(n, device=tokens.device))
    return best, path[:max_depth + 1]
