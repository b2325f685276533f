"""Plain-torch versions of the memory chapter's kernels: the oracles they are checked against.

A copy and a gather move bits, so a kernel must match them exactly; an add rounds once,
so the tests compare it with a float64 sum at the book's tolerance for its dtype. Both
go through ``labkit.check.assert_close``, so that a failure prints the worst elements.
"""

from __future__ import annotations

import torch


def copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def strided_read(x: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th element of a 1-D tensor, starting at 0, as a new contiguous tensor."""
    return x[::stride].clone()


def read_sum(x: torch.Tensor, passes: int, programs: int, block_size: int) -> torch.Tensor:
    """What :func:`labkit.memory.read_sum` writes, in float64: program ``p`` sums blocks
    ``p, p + programs, ...`` of ``x`` (the last one zero-padded), ``passes`` times over."""
    flat = x.reshape(-1).double()
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size).sum(dim=1)
    per_program = torch.zeros(programs, dtype=torch.float64, device=x.device)
    per_program.index_add_(0, torch.arange(blocks.numel(), device=x.device) % programs, blocks)
    return passes * per_program


def pointer_chase(table: torch.Tensor, start: int, hops: int) -> int:
    """Where ``hops`` links of ``table`` lead from ``start``: ``table[table[...table[start]]]``."""
    links = table.tolist()
    index = start
    for _ in range(hops):
        index = links[index]
    return index
