"""Prefix caching: KV blocks of finished and running requests kept for the next request that
starts with the same tokens.

Two requests that share a prefix (a system prompt, the turns so far of a conversation, an
agent's tool definitions) compute the same K and V for it: position ``p`` of a causal model
depends on tokens ``0..p`` only. A prefix cache keeps the blocks that hold those K and V
after their request is done, indexed by the tokens they hold; a new request whose prompt
starts with cached blocks skips their prefill (its block table starts with the cached
blocks, shared through the block manager's reference counts, and ``num_cached`` starts past
them). Only *full* blocks are cached: they never change again.

Two indexes over the same blocks, as the two main serving engines keep them:

- :class:`RadixCache`, SGLang's RadixAttention: a radix tree whose edges are runs of
  token blocks; a lookup walks from the root as far as the prompt agrees with the tree, and
  a node splits where a new prompt diverges inside it.
- :class:`HashCache`, vLLM's automatic prefix caching: a dict from a block's *chained*
  hash (its parent block's hash and its own tokens, so equal hashes mean equal whole
  prefixes) to the block; a lookup hashes the prompt block by block until the first miss.

Both hold one reference to every block they index (so a cached block outlives its
request) and evict least recently used blocks that nobody else references when the pool
runs dry. The radix tree evicts from the leaves, so a block's descendants go before it
and what stays cached is always reachable. The hash index has no tree and orders evictions
by recency alone; since every lookup and insert touches all blocks of a prefix, a parent
is never less recent than its children, and ties (one request's blocks) go tail first, as
vLLM's free queue takes a finished request's blocks back in reverse order.
:class:`CachingBlockManager` counts evictable blocks as free and evicts on demand, so the
scheduler allocates as it always does.

A lookup never matches a whole prompt: the last prompt token must run through the model,
whose logits give the first output token (vLLM and SGLang both leave at least one token).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf

from ..validate import check_choice, check_positive_int
from .block_manager import BlockManager, NoFreeBlocks

POLICIES = ("radix", "hash")


def _check_tokens(tokens: object) -> list[int]:
    # Every step checks whole conversations (16K tokens and more): the set of the element
    # types is the cheapest complete check (bool's type is not int, so booleans fail too).
    if not isinstance(tokens, (list, tuple)) or not set(map(type, tokens)) <= {int}:
        raise TypeError(f"tokens must be a list of int token ids, got {tokens!r:.80}")
    return list(tokens)


class PrefixCache:
    """What the scheduler asks of a prefix cache over ``blocks``' pool (see the module docstring).

    ``hit_tokens`` / ``queried_tokens`` is the token hit rate of the sequences admitted so far
    (counted by :meth:`claim`, so that a lookup retried while a request waits counts once);
    ``evicted_blocks`` counts evictions.
    """

    def __init__(self, blocks: BlockManager) -> None:
        if not isinstance(blocks, BlockManager):
            raise TypeError(f"blocks must be a BlockManager, got {type(blocks).__name__}")
        self.blocks = blocks
        self.block_size = blocks.block_size
        self._clock = itertools.count(1)  # a logical clock: LRU order without wall-clock ties
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    # -- the interface ---------------------------------------------------------------------

    def match(self, tokens: SequenceOf[int]) -> list[int]:
        """The blocks holding the longest cached prefix of ``tokens`` (whole blocks, never all of
        ``tokens``), marked used now. A sequence admitted with them takes them with :meth:`claim`."""
        tokens = _check_tokens(tokens)
        limit = (len(tokens) - 1) // self.block_size  # leave at least one token to compute
        return self._lookup(tokens[:limit * self.block_size], next(self._clock))

    def claim(self, num_tokens: int, prefix: SequenceOf[int]) -> list[int]:
        """A sequence of ``num_tokens`` tokens is admitted with the matched ``prefix``: one more
        reference to each of its blocks (the start of its block table), and the hit counted."""
        check_positive_int(num_tokens, "num_tokens")
        self.queried_tokens += num_tokens
        self.hit_tokens += len(prefix) * self.block_size
        return self.blocks.fork(list(prefix))

    def insert(self, tokens: SequenceOf[int], table: SequenceOf[int]) -> int:
        """Index the full blocks of ``tokens`` (block ``i`` of ``table`` holds tokens ``i*B..(i+1)*B-1``
        and its K and V are stored). Blocks already cached under the same prefix stay as they are;
        the cache takes a reference to each block it adds. Returns how many it added."""
        tokens = _check_tokens(tokens)
        full = len(tokens) // self.block_size
        if len(table) < full:
            raise ValueError(f"{len(tokens)} tokens fill {full} blocks of {self.block_size}, the table has {len(table)}")
        return self._insert(tokens[:full * self.block_size], list(table[:full]), next(self._clock))

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` least recently used blocks that only the cache references;
        how many it freed."""
        check_positive_int(num_blocks, "num_blocks")
        freed = 0
        while freed < num_blocks:
            block = self._pop_victim()
            if block is None:
                break
            self.blocks.free([block])
            freed += 1
        self.evicted_blocks += freed
        return freed

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody but the cache references: what :meth:`evict` can free."""
        refs = self.blocks.ref_counts
        return sum(1 for block in self.cached_blocks() if refs[block] == 1)

    def can_allocate(self, num_tokens: int, prefix: SequenceOf[int]) -> bool:
        """Whether a sequence of ``num_tokens`` whose first blocks are the cached ``prefix`` fits:
        the blocks it still needs must be free or evictable once ``prefix`` is no longer evictable."""
        refs = self.blocks.ref_counts
        pinned = sum(1 for block in prefix if refs[block] == 1)
        return self.blocks.blocks_needed(num_tokens) - len(prefix) <= self.blocks.num_free - pinned

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached over prompt tokens looked up, since the start."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def cached_blocks(self) -> list[int]:
        raise NotImplementedError

    def _lookup(self, tokens: list[int], now: int) -> list[int]:
        raise NotImplementedError

    def _insert(self, tokens: list[int], table: list[int], now: int) -> int:
        raise NotImplementedError

    def _pop_victim(self) -> int | None:
        """Forget the least recently used evictable block and return it (``None``: none left)."""
        raise NotImplementedError

    def _adopt(self, block: int) -> None:
        self.blocks.fork([block])  # the cache's own reference


class RadixNode:
    """A run of blocks: ``keys[i]`` is the tokens of block ``blocks[i]``; children by their first key."""

    __slots__ = ("keys", "blocks", "children", "parent", "last_used")

    def __init__(self, keys: list[tuple[int, ...]], blocks: list[int], parent: RadixNode | None, now: int) -> None:
        self.keys = keys
        self.blocks = blocks
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.last_used = now


class RadixCache(PrefixCache):
    """SGLang's RadixAttention over token blocks: a radix tree whose edges are runs of blocks."""

    def __init__(self, blocks: BlockManager) -> None:
        super().__init__(blocks)
        self.root = RadixNode([], [], None, 0)

    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        b = self.block_size
        return [tuple(tokens[i:i + b]) for i in range(0, len(tokens), b)]

    def _lookup(self, tokens: list[int], now: int) -> list[int]:
        node, found = self.root, []
        keys = self._chunks(tokens)
        while keys:
            child = node.children.get(keys[0])
            if child is None:
                break
            shared = _common_length(child.keys, keys)
            if shared < len(child.keys):
                child = self._split(child, shared)  # the match ends inside it: split so nodes stay whole
            child.last_used = now
            found += child.blocks
            keys = keys[shared:]
            node = child
        return found

    def _insert(self, tokens: list[int], table: list[int], now: int) -> int:
        node, keys = self.root, self._chunks(tokens)
        while keys:
            child = node.children.get(keys[0])
            if child is None:  # the rest is new: one leaf holds it
                node.children[keys[0]] = RadixNode(keys, table, node, now)
                for block in table:
                    self._adopt(block)
                return len(table)
            shared = _common_length(child.keys, keys)
            if shared < len(child.keys):
                child = self._split(child, shared)
            child.last_used = now  # (where this request computed a cached block again, the cached one stays)
            node, keys, table = child, keys[shared:], table[shared:]
        return 0

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after its first ``at`` blocks; the returned head keeps its place in the tree."""
        head = RadixNode(node.keys[:at], node.blocks[:at], node.parent, node.last_used)
        node.parent.children[head.keys[0]] = head
        node.keys, node.blocks, node.parent = node.keys[at:], node.blocks[at:], head
        head.children[node.keys[0]] = node
        return head

    def cached_blocks(self) -> list[int]:
        return [block for node in self._nodes() for block in node.blocks]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _pop_victim(self) -> int | None:
        # A leaf's last block goes first: a running sequence that holds any block of a path
        # holds every block before it, so the unreferenced blocks are the tails of paths.
        refs = self.blocks.ref_counts
        leaves = [n for n in self._nodes() if not n.children and refs[n.blocks[-1]] == 1]
        if not leaves:
            return None
        leaf = min(leaves, key=lambda n: n.last_used)
        block = leaf.blocks.pop()
        leaf.keys.pop()
        if not leaf.blocks:  # (its parent keeps its other children unmerged, as SGLang's _delete_leaf does)
            parent = leaf.parent
            del parent.children[next(k for k, v in parent.children.items() if v is leaf)]
        return block


def _common_length(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class HashCache(PrefixCache):
    """vLLM's automatic prefix caching: a dict from each full block's chained hash to the block.

    A block's key is ``(its parent's key hash, its tokens)``: two blocks have the same key only
    if the whole prefixes up to and including them are the same, unless Python's ``hash`` of
    a parent collides (vLLM hashes the same tuple with SHA-256 by default)."""

    def __init__(self, blocks: BlockManager) -> None:
        super().__init__(blocks)
        self.index: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self.key_of: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.last_used: dict[int, int] = {}

    def _keys(self, tokens: list[int]):
        parent = None
        for i in range(0, len(tokens), self.block_size):
            key = (parent, tuple(tokens[i:i + self.block_size]))
            yield key
            parent = hash(key)

    def _lookup(self, tokens: list[int], now: int) -> list[int]:
        found = []
        for key in self._keys(tokens):
            block = self.index.get(key)
            if block is None:
                break
            self.last_used[block] = now
            found.append(block)
        return found

    def _insert(self, tokens: list[int], table: list[int], now: int) -> int:
        added = 0
        for key, block in zip(self._keys(tokens), table):
            cached = self.index.get(key)
            if cached is None and block not in self.key_of:
                self.index[key] = block
                self.key_of[block] = key
                self._adopt(block)
                added += 1
                cached = block
            if cached is not None:
                self.last_used[cached] = now
        return added

    def cached_blocks(self) -> list[int]:
        return list(self.key_of)

    def _pop_victim(self) -> int | None:
        refs = self.blocks.ref_counts
        # Oldest first; within one request's blocks (same time), the tail first, as vLLM
        # returns a finished request's blocks to its free queue in reverse order.
        candidates = [b for b in self.key_of if refs[b] == 1]
        if not candidates:
            return None
        position = {b: i for i, b in enumerate(self.key_of)}
        block = min(candidates, key=lambda b: (self.last_used[b], -position[b]))
        del self.index[self.key_of.pop(block)]
        del self.last_used[block]
        return block


CACHES = {"radix": RadixCache, "hash": HashCache}


class CachingBlockManager(BlockManager):
    """A :class:`BlockManager` with a prefix cache (``policy`` ``"radix"`` or ``"hash"``) over its pool.

    Blocks only the cache references count as free; taking a block when none is truly free
    evicts the least recently used one. Everything else is the plain manager's."""

    def __init__(self, num_blocks: int, block_size: int, policy: str = "radix") -> None:
        super().__init__(num_blocks, block_size)
        check_choice(policy, "policy", POLICIES)
        self.policy = policy
        self.cache: PrefixCache = CACHES[policy](self)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.cache.num_evictable

    def _take(self) -> int:
        if not self._free and not self.cache.evict(1):
            raise NoFreeBlocks(f"all {self.num_blocks} blocks are in use (none is only cached)")
        return super()._take()


__all__ = ["CACHES", "POLICIES", "CachingBlockManager", "HashCache", "PrefixCache", "RadixCache", "RadixNode"]
