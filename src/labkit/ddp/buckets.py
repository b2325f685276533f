"""Which gradients travel together: torch DDP's bucket assignment, in Python.

DDP does not all-reduce each gradient alone (thousands of small messages, each paying
the link's latency) nor all of them at once (nothing could start before backward ends).
It packs them into buckets of about ``bucket_cap_mb`` (25 MiB) and all-reduces a bucket
as soon as every gradient in it is ready. :func:`assign_buckets` is the rule of
``compute_bucket_assignment_by_size`` in torch's ``reducer.cpp``:

- walk the tensors in the order given, one open bucket per (dtype, device);
- add a tensor to its open bucket; once the bucket holds at least the current size
  limit, close it and move to the next limit (the last limit repeats);
- close what remains open;
- when no explicit order was given, sort the buckets by the smallest index they hold.

DDP calls it twice. At construction it walks ``module.parameters()`` (forward order) and
reverses the list of buckets, betting that gradients arrive in reverse order of
definition; with ``find_unused_parameters=False`` the limit there is "infinite" (one
bucket) because the real order is not known yet. After the first backward it rebuilds the
buckets from the order in which the gradients actually arrived, with the limits
``[first_bucket_bytes, bucket_bytes]`` (1 MiB, then 25 MiB): a small first bucket so that
the first all-reduce starts early.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
NO_LIMIT = sys.maxsize  # DDP's "one bucket" limit for the first iteration


def bucket_limits(bucket_cap_mb: float | None) -> tuple[int, int]:
    """``(first_bucket_bytes, bucket_bytes)`` for DDP's ``bucket_cap_mb``.

    The 1 MiB first bucket applies only when the user kept the default cap; an explicit
    ``bucket_cap_mb`` is used for every bucket, the first one included (as torch does).
    """
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB or None, got {bucket_cap_mb!r}")
    cap = int(bucket_cap_mb * MIB)
    return cap, cap


def assign_buckets(tensors: Sequence[torch.Tensor], size_limits: Sequence[int],
                   order: Sequence[int] | None = None) -> list[list[int]]:
    """Group ``tensors`` into buckets by bytes; each bucket is a list of tensor indices.

    ``size_limits`` are the limits of the first, second, ... bucket of each dtype and
    device (the last repeats). ``order``, when given, is the position of ``tensors[i]``
    in the caller's list (``tensors`` are then walked as given and the buckets kept in
    that order, the rebuild after the first backward); without it, tensor ``i`` has index
    ``i`` and buckets are sorted by their smallest index.
    """
    if not size_limits or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in size_limits):
        raise ValueError(f"size_limits must be a non-empty list of positive byte counts, got {list(size_limits)!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a tensor, got {type(t).__name__}")
    if order is not None and (len(order) != len(tensors) or len(set(order)) != len(order)):
        raise ValueError(f"order must hold {len(tensors)} distinct indices, one per tensor, got {list(order)!r}")
    indices = list(range(len(tensors))) if order is None else list(order)
    done: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], int]] = {}  # key -> (indices, bytes)
    limit_position: dict[tuple, int] = {}
    for t, index in zip(tensors, indices):
        key = (t.dtype, t.device)
        members, size = open_buckets.get(key, ([], 0))
        members.append(index)
        size += t.numel() * t.element_size()
        position = limit_position.setdefault(key, 0)
        if size >= size_limits[position]:
            done.append(members)
            open_buckets.pop(key, None)
            limit_position[key] = min(position + 1, len(size_limits) - 1)
        else:
            open_buckets[key] = (members, size)
    done.extend(members for members, _ in open_buckets.values())
    if order is None:
        done.sort(key=min)
    return done
