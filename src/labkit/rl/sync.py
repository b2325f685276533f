"""Weight sync: the trainer's new weights into the rollout engine's model.

After every update the engine must sample from the new policy. Two ways to move weights:

- **Colocated** (trainer and engine on the same GPUs, verl's default): the engine's
  weights can be refilled from the trainer's memory on the same device. verl and slime
  pass CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``) from the
  trainer process to the engine process, which maps the same memory and copies from it:
  no network, one device-to-device copy per tensor (plus a gather when the trainer is sharded).
- **Disaggregated** (engine on other GPUs or nodes): the trainer's rank 0 broadcasts each
  tensor over an NCCL group that includes the engine's ranks, in buckets; the time is
  bytes over the link's bandwidth (NVLink inside a node, InfiniBand across).

Here trainer and engine share one process, so :func:`sync_weights` is the colocated copy
itself: every engine tensor is overwritten in place from the trainer's (casting fp32 to
the engine's dtype). In place matters: the engine's CUDA graphs captured the addresses
of its weights, and a sync that swapped in new tensors would leave them reading the old.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SyncStats:
    """One sync: how many tensors and bytes (in the engine's dtype) were written, and how long it took."""

    tensors: int
    bytes: int
    seconds: float


@torch.no_grad()
def sync_weights(source: nn.Module, target: nn.Module) -> SyncStats:
    """Copy every parameter and buffer of ``source`` into ``target``'s, in place.

    The two must have the same names and shapes (the same architecture); dtypes and devices
    may differ (a float32 trainer, a bf16 engine). Tied weights are written once. On a GPU
    the time includes waiting for the copies to finish.
    """
    if not isinstance(source, nn.Module) or not isinstance(target, nn.Module):
        raise TypeError(f"source and target must be torch modules, got {type(source).__name__} "
                        f"and {type(target).__name__}")
    src = dict(source.named_parameters()) | dict(source.named_buffers())
    dst = dict(target.named_parameters()) | dict(target.named_buffers())
    if src.keys() != dst.keys():
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        raise ValueError(f"source and target differ in tensors: target only {missing[:3]}, source only {extra[:3]}")
    for name, t in dst.items():
        if t.shape != src[name].shape:
            raise ValueError(f"{name}: source {tuple(src[name].shape)} does not fit target {tuple(t.shape)}")
    devices = {t.device for t in dst.values()} | {t.device for t in src.values()}
    cuda = [d for d in devices if d.type == "cuda"]
    for d in cuda:
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for name, t in dst.items():
        t.copy_(src[name], non_blocking=True)
    for d in cuda:
        torch.cuda.synchronize(d)
    seconds = time.perf_counter() - start
    return SyncStats(len(dst), sum(t.numel() * t.element_size() for t in dst.values()), seconds)
