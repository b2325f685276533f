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
