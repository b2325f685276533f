"""Data parallelism from scratch: torch's ``DistributedDataParallel``, written out in Python.

>>> from labkit.collectives import launch
>>> from labkit.ddp import programs
>>> launch.run(programs.compare_with_torch_ddp, 2, args=(...))   # gradients against torch's DDP

:class:`DataParallel` broadcasts rank 0's weights, packs gradients into buckets with
torch's rule (:func:`assign_buckets`), all-reduces each bucket asynchronously as soon as
its gradients are in (overlapping backward) and averages by the world size; it supports
``no_sync`` and ``find_unused_parameters``. The tests check its gradients bit for bit
against ``torch.nn.parallel.DistributedDataParallel`` on gloo.
"""

from .buckets import (DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, NO_LIMIT, assign_buckets,
                      bucket_limits)
from .data_parallel import BackwardTrace, Bucket, DataParallel, parameters_reached, torch_all_reduce

__all__ = [
    "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES", "MIB", "NO_LIMIT", "BackwardTrace", "Bucket",
    "DataParallel", "assign_buckets", "bucket_limits", "parameters_reached", "torch_all_reduce",
]
