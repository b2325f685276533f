"""Softmax in plain torch: the float64 oracle, the naive multi-pass version, the online one.

- :func:`softmax_reference`: what every kernel is checked against (float64).
- :func:`naive_softmax`: the textbook formula as five eager torch operations, each a
  separate pass over memory; :func:`count_traffic` counts those passes and their bytes.
- :func:`online_softmax` and :func:`online_softmax_steps`: the block-by-block algorithm of
  the online kernel (running max, running sum, rescaling), step by step, in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..validate import check_positive_int, check_tensor

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, computed in float64."""
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    return torch.softmax(x.to(torch.float64), dim=-1)


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` over the last dimension, one op at a time.

    Each line is an eager kernel that reads its inputs from memory and writes its output
    back: the matrix crosses the memory bus eight times instead of twice.
    """
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    row_max = x.amax(dim=-1, keepdim=True)  # read x, write one value per row
    shifted = x - row_max  # read x and the maxima, write a matrix
    numerator = torch.exp(shifted)  # read a matrix, write a matrix
    denominator = numerator.sum(dim=-1, keepdim=True)  # read a matrix, write one value per row
    return numerator / denominator  # read a matrix and the sums, write the result


@dataclass(frozen=True)
class OpTraffic:
    """One torch operation and the bytes it reads (its tensor inputs) and writes (outputs)."""

    op: str
    bytes_read: int
    bytes_written: int


class _TrafficCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpTraffic] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        tensors_out = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        self.ops.append(OpTraffic(
            op=func.overloadpacket.__name__,
            bytes_read=sum(t.numel() * t.element_size() for t in tensors_in),
            bytes_written=sum(t.numel() * t.element_size() for t in tensors_out),
        ))
        return out


def count_traffic(fn: Callable[..., object], *args: object) -> list[OpTraffic]:
    """The aten operations ``fn(*args)`` runs, each with its bytes in and out.

    A model of an eager program's memory traffic: each operation is its own kernel,
    reading every input once and writing every output once (true when the tensors are
    larger than the caches, as at the sizes this book benchmarks).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    counter = _TrafficCounter()
    with counter:
        fn(*args)
    return counter.ops


@dataclass(frozen=True)
class OnlineStep:
    """The online normaliser after one more block of ``block_cols`` columns.

    ``running_max`` and ``running_sum`` hold, per row, the max of the columns seen so far
    and ``sum(exp(x - running_max))`` over them; ``rescale`` is ``exp(old max - new max)``,
    the factor the previous sum was multiplied by at this step (1 where the max held).
    """

    end_col: int
    block_max: torch.Tensor
    running_max: torch.Tensor
    running_sum: torch.Tensor
    rescale: torch.Tensor


def online_softmax_steps(x: torch.Tensor, block_cols: int) -> Iterator[OnlineStep]:
    """Pass 1 of the online kernel over each row of the 2-D ``x``, one block at a time."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_positive_int(block_cols, "block_cols")
    n_rows, n_cols = x.shape
    running_max = torch.full((n_rows,), float("-inf"), dtype=x.dtype, device=x.device)
    running_sum = torch.zeros(n_rows, dtype=x.dtype, device=x.device)
    for start in range(0, n_cols, block_cols):
        block = x[:, start:start + block_cols]
        block_max = block.amax(dim=1)
        new_max = torch.maximum(running_max, block_max)
        rescale = torch.exp(running_max - new_max)  # exp(-inf) = 0 at the first block
        running_sum = running_sum * rescale + torch.exp(block - new_max[:, None]).sum(dim=1)
        running_max = new_max
        yield OnlineStep(min(start + block_cols, n_cols), block_max, running_max, running_sum, rescale)


def online_softmax(x: torch.Tensor, block_cols: int) -> torch.Tensor:
    """Softmax of the 2-D ``x`` by the online kernel's two passes, in ``x``'s dtype."""
    *_, last = online_softmax_steps(x, block_cols)
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], block_cols):  # pass 2: read each block again, write it
        block = x[:, start:start + block_cols]
        out[:, start:start + block_cols] = torch.exp(block - last.running_max[:, None]) / last.running_sum[:, None]
    return out
