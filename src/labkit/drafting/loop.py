"""Draft a tree, verify it in one target pass, keep the longest matching path: one loop, four proposers.

:func:`generate_tree` is :func:`labkit.spec.generate_speculative`'s loop with a tree in place
of a chain and greedy verification (:func:`labkit.drafting.tree.greedy_accept`). Every
step: the proposer builds a tree whose root is the last emitted token; the
:class:`~labkit.drafting.runner.TreeRunner` scores it; the walk picks the deepest node whose
path agrees with the target's argmax; one host read brings back how many tokens were kept,
their ids and the target's argmax at every node; the runner commits the path. The output
is plain greedy decoding's, token for token (up to rounding ties, as in the previous chapter).

The proposers differ only in where the tree comes from:

- :class:`MedusaProposer`: a fixed tree of top-k ranks (``choices``) filled from the Medusa
  heads' top-k at the last accepted node's hidden state;
- :class:`EagleProposer`: EAGLE-2's dynamic tree, grown by the EAGLE head ``depth`` layers
  deep, expanding the ``width`` most confident nodes at each depth, then the ``total`` best
  of all drafted nodes by their path's draft probability;
- :class:`PromptLookupProposer`: a chain copied from where the text's last n-gram occurred;
- :class:`LookaheadProposer`: a Jacobi chain of guesses plus n-gram branches from the pool.

The first two draft on the device (one CUDA graph each on a GPU); the last two on the
host from the ids the step reads back anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models import Decoder
from ..spec import DenseStepKV, SpecOutput
from ..validate import check_positive_int, check_tensor
from .heads import EagleHead, MedusaHeads
from .ngram import NGramPool, prompt_lookup
from .runner import TreeRunner
from .tree import Tree, chain, greedy_accept, tree_mask


class Graphed:
    """``fn(*tensors)`` replayed from one CUDA graph (captured at the first call) when ``use_graph``;
    the arguments are copied into static buffers, so every call must pass the same shapes."""

    def __init__(self, fn: Callable[..., object], use_graph: bool) -> None:
        self.fn, self.use_graph = fn, use_graph
        self._static: list[torch.Tensor] | None = None
        self._graph = None
        self._out = None

    def __call__(self, *tensors: torch.Tensor):
        if not self.use_graph:
            return self.fn(*tensors)
        if self._graph is None:
            self._static = [t.clone() for t in tensors]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn(*self._static)
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._out = self.fn(*self._static)
        for static, t in zip(self._static, tensors):
            static.copy_(t)
        self._graph.replay()
        return self._out


@dataclass
class Step:
    """What one verification told the proposer: the kept path (device ``path``, host ``count`` nodes
    including the root), the ``next_token`` (device and host), the step's ``tokens``, ``hidden`` and
    the host copies of its tokens and of the target's argmax at every node."""

    path: torch.Tensor
    count: int
    next_token: torch.Tensor
    next_id: int
    best: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    host_tokens: list[int]
    host_argmax: list[int]
    position: int  # the root's position in the sequence


class Proposer:
    """The interface :func:`generate_tree` drives (subclasses fill it in)."""

    name = "proposer"
    max_depth: int
    tree_size: int

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor, context: list[int]) -> None:
        """After the prefill: ``hidden`` ``[T, H]`` of the prompt, ``first`` the first emitted token."""

    def propose(self, pending: torch.Tensor, context: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree to verify: tokens ``[n]`` (``tokens[0] == pending``), depth ``[n]``, mask ``[n, n]``."""
        raise NotImplementedError

    def update(self, step: Step) -> None:
        """Learn what the last verification kept."""


@torch.no_grad()
def generate_tree(runner: TreeRunner, proposer: Proposer, prompt: torch.Tensor, new_tokens: int) -> SpecOutput:
    """``new_tokens`` greedy tokens after ``prompt`` ``[T]``, one tree verification per step."""
    if not isinstance(runner, TreeRunner):
        raise TypeError(f"runner must be a TreeRunner, got {type(runner).__name__}")
    if not isinstance(proposer, Proposer):
        raise TypeError(f"proposer must be a labkit.drafting Proposer, got {type(proposer).__name__}")
    check_tensor(prompt, "prompt", ndim=1, dtypes=(torch.int32, torch.int64), device=runner.device)
    check_positive_int(new_tokens, "new_tokens")
    if prompt.numel() + new_tokens + proposer.tree_size > runner.capacity:
        raise ValueError(f"prompt ({prompt.numel()}) + new_tokens ({new_tokens}) + a tree of {proposer.tree_size} "
                         f"exceed the runner's capacity {runner.capacity}")
    logits, hidden = runner.prefill_hidden(prompt.long())
    first = logits[-1].argmax().view(1)
    out = SpecOutput(tokens=[int(first)], k=proposer.max_depth)
    context = prompt.tolist() + out.tokens
    proposer.start(prompt.long(), hidden, first, context)
    pending = first
    while len(out.tokens) < new_tokens:
        tokens, depth, mask = proposer.propose(pending, context)
        logits, hidden = runner.tree_step(tokens, depth, mask)
        argmax = logits.argmax(-1)
        best, path = greedy_accept(tokens, mask, depth, argmax, proposer.max_depth)
        next_token = argmax[best].view(1)
        kept, next_id, *rest = torch.cat([depth[best].view(1), next_token, tokens[path], tokens, argmax]).tolist()
        n = tokens.shape[0]
        path_tokens, host_tokens, host_argmax = rest[:path.shape[0]], rest[path.shape[0]:path.shape[0] + n], rest[-n:]
        position = runner.length
        runner.commit(path, kept + 1)
        out.accepted.append(kept)
        emitted = path_tokens[1:kept + 1] + [next_id]
        out.tokens += emitted
        context += emitted
        proposer.update(Step(path, kept + 1, next_token, next_id, best, tokens, hidden, host_tokens, host_argmax,
                             position))
        pending = next_token
    del out.tokens[new_tokens:]
    return out


class ChainProposer(Proposer):
    """Host-side drafts as a chain of ``k`` after the root (padded with the root's token when short)."""

    def __init__(self, k: int, device: torch.device | str) -> None:
        self.k = check_positive_int(k, "k")
        tree = chain(k).to(device)
        self.depth, self.mask = tree.depth, tree.mask
        self.max_depth, self.tree_size = k, k + 1
        self.device = device

    def drafts(self, context: list[int]) -> list[int]:
        raise NotImplementedError

    def propose(self, pending, context):
        drafts = (self.drafts(context) + [context[-1]] * self.k)[:self.k]
        tail = torch.tensor(drafts, dtype=torch.int64).to(self.device, non_blocking=True)
        return torch.cat([pending, tail]), self.depth, self.mask


class PromptLookupProposer(ChainProposer):
    """Prompt lookup: the ``k`` tokens after the latest earlier occurrence of the last n-gram."""

    name = "prompt lookup"

    def __init__(self, k: int, device: torch.device | str, max_ngram: int = 3) -> None:
        super().__init__(k, device)
        self.max_ngram = check_positive_int(max_ngram, "max_ngram")

    def drafts(self, context):
        return prompt_lookup(context, self.k, self.max_ngram)


class LookaheadProposer(Proposer):
    """Lookahead decoding: a chain of ``window`` Jacobi guesses after the root, and up to ``branches``
    n-grams from the pool that start with the root's token, each a branch of ``ngram - 1`` tokens."""

    name = "lookahead"

    def __init__(self, window: int, ngram: int, branches: int, device: torch.device | str) -> None:
        self.window = check_positive_int(window, "window")
        self.branches = check_positive_int(branches, "branches")
        self.pool = NGramPool(ngram, per_key=branches)
        self.gram = ngram - 1
        parents = [-1] + list(range(window))
        for _ in range(branches):
            start = len(parents)
            parents += [0] + list(range(start, start + self.gram - 1))
        self.parents = parents
        mask = tree_mask(parents)
        depth = mask.sum(-1) - 1
        self.depth, self.mask = depth.to(device), mask.to(device)
        self.max_depth, self.tree_size = max(window, self.gram), len(parents)
        self.device = device
        self.guesses: list[int] = []

    def start(self, prompt, hidden, first, context):
        self.guesses = (context[-self.window - 1:-1] * self.window)[:self.window]  # any start converges

    def propose(self, pending, context):
        root = context[-1]
        grams = self.pool.lookup(root)[:self.branches]
        tokens = list(self.guesses)
        for b in range(self.branches):
            tokens += list(grams[b]) if b < len(grams) else [root] * self.gram
        tail = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        return torch.cat([pending, tail]), self.depth, self.mask

    def update(self, step):
        # The chain's outputs: argmax at chain node i (position P + i) is the next iterate for P + i + 1.
        outputs = step.host_argmax[:self.window + 1]
        self.pool.add_level({step.position + i + 1: t for i, t in enumerate(outputs)})
        kept = step.count - 1
        # New guesses for the positions after the next root, from the iterate where it exists.
        fresh = outputs[kept + 1:]
        self.guesses = (fresh + [outputs[-1]] * self.window)[:self.window]


class MedusaProposer(Proposer):
    """Medusa: the fixed tree ``tree`` filled from the heads' top-k at the last accepted hidden state."""

    name = "Medusa"

    def __init__(self, heads: MedusaHeads, lm_head_weight: torch.Tensor, tree: Tree, *,
                 use_graph: bool = False) -> None:
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"a tree {tree.max_depth} deep needs {tree.max_depth} heads, got {heads.num_heads}")
        device = lm_head_weight.device
        self.heads, self.lm_head_weight, self.tree = heads, lm_head_weight, tree.to(device)
        self.depth, self.mask = self.tree.depth, self.tree.mask
        self.max_depth, self.tree_size = tree.max_depth, tree.size
        self.top_k = max(tree.ranks) + 1
        self._head_of = (self.tree.depth[1:] - 1).clamp_min(0)
        self._rank_of = torch.tensor(tree.ranks[1:], dtype=torch.int64, device=device)
        self._propose = Graphed(self._fill, use_graph)
        self.hidden: torch.Tensor | None = None

    def _fill(self, hidden: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        top = self.heads(hidden, self.lm_head_weight).topk(self.top_k, dim=-1).indices   # [K, top_k]
        return torch.cat([pending, top[self._head_of, self._rank_of]])

    def start(self, prompt, hidden, first, context):
        self.hidden = hidden[-1]

    def propose(self, pending, context):
        return self._propose(self.hidden, pending), self.depth, self.mask

    def update(self, step):
        self.hidden = step.hidden[step.best]


class EagleProposer(Proposer):
    """EAGLE-2's dynamic draft tree from an :class:`EagleHead` (module docstring)."""

    name = "EAGLE"

    def __init__(self, head: EagleHead, target: Decoder, capacity: int, *, depth: int, width: int, total: int,
                 use_graph: bool = False) -> None:
        if not isinstance(head, EagleHead):
            raise TypeError(f"head must be an EagleHead, got {type(head).__name__}")
        self.head, self.embed, self.lm = head, target.embed.weight, target.lm_head.weight
        self.D, self.w = check_positive_int(depth, "depth"), check_positive_int(width, "width")
        self.candidates = width + (depth - 1) * width * width
        if not 1 <= total <= self.candidates:
            raise ValueError(f"total must be in [1, {self.candidates}] (the nodes drafted), got {total}")
        self.N = total
        self.max_depth, self.tree_size = depth, total + 1
        cfg, device = head.config, self.embed.device
        self.capacity = capacity
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=self.embed.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.embed.dtype, device=device)
        self.keys = torch.arange(capacity, device=device)
        self.F = depth + 1  # the longest path a step can keep, root included
        self._draft = Graphed(self._draft_tree, use_graph)
        self.device = device

    def _forward(self, features, tokens, positions, slots, mask):
        kv = DenseStepKV(self.k, self.v, positions, slots=slots, mask=mask)
        return self.head(features[None], tokens[None], self.embed, kv, positions)[0]

    def start(self, prompt, hidden, first, context):
        t = prompt.numel()
        pairs = torch.cat([prompt[1:], first])  # the token after each prompt position
        if t > 1:  # all pairs but the last go in now; the last is the first step's feed
            positions = torch.arange(t - 1, device=self.device)
            self._forward(hidden[:-1], pairs[:-1], positions, positions,
                          self.keys[None, :] <= positions[:, None])
        self.length = torch.tensor(t - 1, device=self.device)
        self.count = torch.tensor(1, device=self.device)
        self.feed_f = torch.zeros(self.F, hidden.shape[-1], dtype=hidden.dtype, device=self.device)
        self.feed_t = torch.zeros(self.F, dtype=torch.int64, device=self.device)
        self.feed_f[0], self.feed_t[0] = hidden[-1], first[0]

    def propose(self, pending, context):
        return self._draft(self.feed_f, self.feed_t, self.count, self.length, pending)

    def update(self, step):
        path = step.path
        self.feed_f = step.hidden[path]
        after = torch.cat([step.tokens[path[1:]], step.next_token])
        index = torch.arange(self.F, device=self.device)
        self.feed_t = torch.where(index == step.count - 1, step.next_token, after)
        self.length = self.length + self.count
        self.count = torch.tensor(step.count, device=self.device)

    def _draft_tree(self, feed_f, feed_t, count, length, pending):
        D, w, F_ = self.D, self.w, self.F
        # 1. The kept path's (feature, next token) pairs, at positions length .. length + F - 1.
        positions = length + torch.arange(F_, device=self.device)
        out = self._forward(feed_f, feed_t, positions, positions, self.keys[None, :] <= positions[:, None])
        root = out.index_select(0, (count - 1).view(1))                       # f^ at the root's position
        base = length + count                                                 # the root's position
        tree_start = length + F_                                              # draft tree slots start here
        # 2. Depth 1: the root's top-w tokens.
        logp = F.linear(root, self.lm).float().log_softmax(-1)[0]
        score, tok = logp.topk(w)
        cand_tok, cand_score = [tok], [score]
        cand_parent = [torch.full((w,), -1, dtype=torch.int64, device=self.device)]
        cand_depth = [torch.ones(w, dtype=torch.int64, device=self.device)]
        front_idx = torch.arange(w, device=self.device)                        # candidate ids being expanded
        front_feat, front_tok, front_score = root.expand(w, -1), tok, score
        front_parent_slot = torch.full((w,), -1, dtype=torch.int64, device=self.device)
        exp_anc = torch.zeros(D * w, D * w, dtype=torch.bool, device=self.device)
        offset = w
        for d in range(1, D):
            # 3. Expand the frontier (w nodes of depth d): one draft layer over w tokens under a tree mask.
            rows = torch.arange((d - 1) * w, d * w, device=self.device)
            parent_rows = exp_anc[front_parent_slot.clamp_min(0)] & (front_parent_slot >= 0)[:, None]
            exp_anc[rows] = parent_rows | (rows[:, None] == torch.arange(D * w, device=self.device))  # no one_hot: it syncs
            rel = self.keys - tree_start
            inside = (rel >= 0) & (rel < D * w)
            mask = (self.keys < base)[None, :] | (inside[None, :] & exp_anc[rows][:, rel.clamp(0, D * w - 1)])
            pos = (base + d - 1).expand(w)
            feat = self._forward(front_feat, front_tok, pos, tree_start + rows, mask)          # [w, H]
            logp = F.linear(feat, self.lm).float().log_softmax(-1)
            top_score, top_tok = logp.topk(w, dim=-1)                                          # [w, w]
            child_score = (front_score[:, None] + top_score).flatten()
            child_tok = top_tok.flatten()
            child_parent = front_idx[:, None].expand(w, w).flatten()
            cand_tok.append(child_tok), cand_score.append(child_score), cand_parent.append(child_parent)
            cand_depth.append(torch.full((w * w,), d + 1, dtype=torch.int64, device=self.device))
            # 4. The w most confident children become the next frontier.
            keep = child_score.topk(w).indices
            front_idx = offset + keep
            front_feat = feat[keep // w]
            front_tok, front_score = child_tok[keep], child_score[keep]
            front_parent_slot = rows[keep // w]
            offset += w * w
        tokens = torch.cat(cand_tok)
        scores = torch.cat(cand_score)
        parents = torch.cat(cand_parent)
        depths = torch.cat(cand_depth)
        # 5. Rerank every drafted node; a parent outranks its children (ties broken by depth).
        chosen = (scores - 1e-4 * depths).topk(self.N).indices.sort().values
        # Ancestors by pointer jumping, D rounds: anc[i, j] when j is i or above it.
        C = tokens.shape[0]
        anc = torch.eye(C, dtype=torch.bool, device=self.device)
        cur = torch.arange(C, device=self.device)
        for _ in range(D):
            cur = torch.where(cur >= 0, parents[cur.clamp_min(0)], cur)
            anc |= (cur[:, None] == torch.arange(C, device=self.device)) & (cur >= 0)[:, None]
        sub = anc[chosen][:, chosen]
        mask = torch.zeros(self.N + 1, self.N + 1, dtype=torch.bool, device=self.device)
        mask[:, 0] = True
        mask[1:, 1:] = sub
        return (torch.cat([pending, tokens[chosen]]), torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device),
                                                                  depths[chosen]]), mask)

