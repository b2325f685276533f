"""Fixed-size KV blocks, handed out to sequences as an OS hands out pages.

A sequence's keys and values live in blocks of ``block_size`` token slots; its *block
table* lists the block ids in order, so token ``t`` sits in block ``table[t // block_size]``
at slot ``t % block_size``. Only the last block can be partly filled, so a sequence wastes
fewer than ``block_size`` slots (internal fragmentation), and any free block serves any
sequence (no external fragmentation).

Blocks carry reference counts so that a fork (parallel sampling, beam search) shares its
parent's blocks instead of copying them. Full blocks never change again and stay shared;
the shared *partial* last block is copied on the first write (copy-on-write), which
:meth:`BlockManager.append_slot` reports so that the KV storage can copy its contents.
"""

from __future__ import annotations

from collections import deque

from ..validate import check_positive_int


class NoFreeBlocks(RuntimeError):
    """The pool has too few free blocks now; the scheduler preempts or waits."""


class BlockManager:
    """Allocates, shares and frees ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self.block_size = check_positive_int(block_size, "block_size")
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def allocate(self, num_tokens: int) -> list[int]:
        """A new block table with room for ``num_tokens`` tokens."""
        check_positive_int(num_tokens, "num_tokens")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks:
            raise ValueError(f"{num_tokens} tokens need {needed} blocks of {self.block_size}, "
                             f"the pool has only {self.num_blocks}")
        if needed > self.num_free:
            raise NoFreeBlocks(f"{num_tokens} tokens need {needed} blocks, {self.num_free} are free")
        return [self._take() for _ in range(needed)]

    def append_slot(self, table: list[int], num_tokens: int) -> tuple[int, int] | None:
        """Make room in ``table`` (which holds ``num_tokens`` tokens) for token ``num_tokens``.

        A full last block gets a fresh block appended. A shared partial last block is
        replaced by a private copy: the return value is then ``(source, destination)``,
        whose contents the caller must copy; otherwise ``None``. The table changes in place.
        Raises :class:`NoFreeBlocks` (leaving the table as it was) when the pool is empty.
        """
        if not 0 < num_tokens <= len(table) * self.block_size:
            raise ValueError(f"num_tokens must be in (0, {len(table) * self.block_size}] for a table "
                             f"of {len(table)} blocks, got {num_tokens}")
        if num_tokens == len(table) * self.block_size:
            table.append(self._take())
            return None
        last = table[-1]
        if self.ref_counts[last] == 1:
            return None
        copy = self._take()
        self._release(last)
        table[-1] = copy
        return last, copy

    def fork(self, table: list[int]) -> list[int]:
        """A second table sharing every block of ``table`` (one more reference each)."""
        for block in table:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"cannot fork block {block}: it is not allocated")
            self.ref_counts[block] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table``; blocks nobody references become free."""
        for block in table:
            self._release(block)
        table.clear()

    def _take(self) -> int:
        if not self._free:
            raise NoFreeBlocks(f"all {self.num_blocks} blocks are in use")
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"double free: block {block} is not allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
