"""One-sided communication: a simulated symmetric heap, and programs written against it.

- :mod:`~labkit.shmem.heap`: ``World`` (N PEs, a symmetric heap each, a network with
  NVSHMEM's ordering rules) and ``PE`` (put, put_nbi, get, atomics, signals, fence, quiet,
  barrier);
- :mod:`~labkit.shmem.programs`: a one-sided ring all-reduce, a one-shot all-reduce, an
  all-gather, and DeepEP's low-latency MoE dispatch;
- :mod:`~labkit.shmem.cost`: messages, bytes and synchronisations of one- and two-sided
  versions, and a latency model;
- :mod:`~labkit.shmem.kernels`: a Triton kernel whose programs pass data through flags in one
  GPU's memory (producer/consumer), and the two-launch version it replaces;
- :mod:`~labkit.shmem.device`: the code paths of real NVSHMEM (nvshmem4py) and PyTorch's
  SymmetricMemory, guarded: they run only with several GPUs.

The functions here check their inputs, build a world, run a program on it and return every
PE's result with the world's counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from .. import check
from ..validate import check_choice, check_positive_int, check_tensor
from . import programs
from .heap import DELIVERIES, PE, SIGNAL_ADD, SIGNAL_SET, Deadlock, SymTensor, World

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
ALL_REDUCES = ("ring", "one_shot")

__all__ = [
    "ALL_REDUCES", "DELIVERIES", "PE", "SIGNAL_ADD", "SIGNAL_SET", "Deadlock", "SymTensor", "World", "all_gather",
    "all_reduce", "dispatch",
]


def _check_per_pe(tensors: object, name: str, *, same_shape: bool = True) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{name} must be a non-empty list with one tensor per PE, got {type(tensors).__name__}")
    out = [check_tensor(t, f"{name}[{i}]", dtypes=SUPPORTED_DTYPES, device="cpu", nonempty=False)
           for i, t in enumerate(tensors)]
    if len({t.dtype for t in out}) > 1:
        raise TypeError(f"every PE's {name} must have one dtype, got {sorted({str(t.dtype) for t in out})}")
    if same_shape and len({tuple(t.shape) for t in out}) > 1:
        raise ValueError(f"every PE's {name} must have one shape (a symmetric buffer), got "
                         f"{[tuple(t.shape) for t in out]}")
    return out


def _heap_bytes(*nbytes: int) -> int:
    return sum(b + 64 for b in nbytes) + 1024


def all_reduce(inputs: Sequence[torch.Tensor], algorithm: str = "ring", *, delivery: str = "adversarial",
               seed: int = 0) -> tuple[list[torch.Tensor], Counter]:
    """Sum ``inputs`` (one tensor per PE) with a one-sided ``algorithm``; every PE's result and the counts."""
    xs = _check_per_pe(inputs, "inputs")
    check_choice(algorithm, "algorithm", ALL_REDUCES)
    n, numel, dtype = len(xs), xs[0].numel(), xs[0].dtype
    esize = xs[0].element_size()
    if algorithm == "ring":
        longest = -(-numel // n)
        world = World(n, _heap_bytes(numel * esize, 2 * max(n - 1, 1) * longest * esize, 16 * n),
                      delivery=delivery, seed=seed)
        data = world.alloc(numel, dtype, "data")
        slots = world.alloc((max(2 * (n - 1), 1), longest), dtype, "slots")
        flags = world.alloc(max(2 * (n - 1), 1), torch.int64, "flags")
        program = programs.ring_all_reduce
    else:
        world = World(n, _heap_bytes(numel * esize, n * numel * esize, 8), delivery=delivery, seed=seed)
        data = world.alloc(numel, dtype, "data")
        slots = world.alloc((n, numel), dtype, "slots")
        flags = world.alloc(1, torch.int64, "flags")
        program = programs.one_shot_all_reduce
    for p, x in enumerate(xs):
        data.on(p).copy_(x.reshape(-1))
        check.poison(slots.on(p))
    outs = world.run(program, data, slots, flags)
    return [o.view(xs[0].shape) for o in outs], world.totals()


def all_gather(shards: Sequence[torch.Tensor], *, delivery: str = "adversarial",
               seed: int = 0) -> tuple[list[torch.Tensor], Counter]:
    """Concatenate every PE's ``shards[p]`` (1-D, sizes as ``tensor_split`` cuts) on every PE, one-sided."""
    xs = _check_per_pe(shards, "shards", same_shape=False)
    n, total = len(xs), sum(x.numel() for x in xs)
    from ..collectives.schedule import chunk_bounds

    want = [b - a for a, b in chunk_bounds(total, n)]
    if [x.numel() for x in xs] != want:
        raise ValueError(f"shard sizes must be tensor_split's cut of {total} elements over {n} PEs, {want}; "
                         f"got {[x.numel() for x in xs]}")
    world = World(n, _heap_bytes(total * xs[0].element_size(), 8), delivery=delivery, seed=seed)
    out = world.alloc(total, xs[0].dtype, "out")
    counter = world.alloc(1, torch.int64, "counter")
    for p in range(n):
        check.poison(out.on(p))
    outs = world.run(_all_gather_pe, out, [x.reshape(-1) for x in xs], counter)
    return outs, world.totals()


def _all_gather_pe(pe: PE, out: SymTensor, shards: list[torch.Tensor], counter: SymTensor) -> torch.Tensor:
    return programs.all_gather(pe, out, shards[pe.my_pe], counter)


def _dispatch_pe(pe: PE, tokens: list[torch.Tensor], dest: list[torch.Tensor], recv: SymTensor,
                 recv_count: SymTensor, fence: bool) -> list[torch.Tensor]:
    return programs.dispatch(pe, tokens[pe.my_pe], dest[pe.my_pe], recv, recv_count, fence=fence)


def dispatch(tokens: Sequence[torch.Tensor], dest: Sequence[torch.Tensor], capacity: int | None = None, *,
             fence: bool = True, delivery: str = "adversarial",
             seed: int = 0) -> tuple[list[list[torch.Tensor]], Counter]:
    """One-sided MoE dispatch: ``out[d][s]`` = the rows of PE ``s`` whose ``dest`` names PE ``d``.

    ``tokens[p]`` is PE ``p``'s ``(T_p, H)``; ``dest[p]`` its ``(T_p, k)`` int64 PE of each
    top-k expert, in ``[0, n)``. ``capacity`` (default: the most any PE sends) bounds the
    rows one PE may send another; the landing buffer is ``(n, capacity, H)`` on every PE.
    """
    xs = _check_per_pe(tokens, "tokens", same_shape=False)
    if not isinstance(dest, (list, tuple)) or len(dest) != len(xs):
        raise TypeError(f"dest must be a list with one tensor per PE ({len(xs)})")
    n = len(xs)
    hidden = {x.shape[1] if x.dim() == 2 else None for x in xs}
    if len(hidden) != 1 or None in hidden:
        raise ValueError(f"tokens must be 2-D (T, H) with one H on every PE, got {[tuple(x.shape) for x in xs]}")
    ds = []
    for p, (x, d) in enumerate(zip(xs, dest)):
        d = check_tensor(d, f"dest[{p}]", dtypes=(torch.int32, torch.int64), device="cpu", ndim=2, nonempty=False)
        if d.shape[0] != x.shape[0]:
            raise ValueError(f"dest[{p}] has {d.shape[0]} rows for {x.shape[0]} tokens")
        if d.numel() and (int(d.min()) < 0 or int(d.max()) >= n):
            raise ValueError(f"dest[{p}] names PEs outside [0, {n}): min {int(d.min())}, max {int(d.max())}")
        ds.append(d)
    most = max((int((ds[s] == t).any(dim=1).sum()) for s in range(n) for t in range(n)), default=0)
    if capacity is None:
        capacity = max(most, 1)
    check_positive_int(capacity, "capacity")
    if most > capacity:
        raise ValueError(f"some PE sends {most} tokens to one PE, above capacity={capacity}")
    h, dtype = hidden.pop(), xs[0].dtype
    world = World(n, _heap_bytes(n * capacity * h * xs[0].element_size(), 8 * n), delivery=delivery, seed=seed)
    recv = world.alloc((n, capacity, h), dtype, "recv")
    recv_count = world.alloc(n, torch.int64, "recv_count")
    for p in range(n):
        check.poison(recv.on(p))
    outs = world.run(_dispatch_pe, xs, ds, recv, recv_count, fence)
    return outs, world.totals()
