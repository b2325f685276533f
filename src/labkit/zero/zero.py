"""ZeRO stages 1 and 2: the optimizer state (and the gradients) sharded, the parameters whole.

:class:`ZeroDataParallel` wraps a module like DDP does, but owns the update too. The
trainable parameters are grouped in buckets (DDP's rule, :func:`labkit.ddp.assign_buckets`:
reverse order, so backward fills them one after another), each bucket a flat buffer that
the parameters become views of, cut by a :class:`~labkit.zero.layout.FlatLayout` into one
shard per rank. A rank keeps the fp32 master weights and AdamW's moments of its shard only.

- **Stage 1**: each bucket's gradients live in a full flat buffer (the parameters' ``.grad``
  are views of it) until the step, which reduce-scatters every bucket, so each rank gets
  the summed gradient of its shard (an all-reduce would send twice as much for gradients
  nobody updates).
- **Stage 2**: a bucket is reduce-scattered *during* backward, as soon as its last
  gradient is in; the full gradients are then freed and only the shard of the sum is kept.

Both then update their shard (:class:`~labkit.zero.optim.ShardedAdamW`) and all-gather the
new parameters: per step, a reduce-scatter and an all-gather of the parameters' size, what
one DDP all-reduce moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..ddp import MIB, assign_buckets
from ..validate import check_positive_int
from .accounting import MemoryMeter
from .comm import Communicator
from .layout import FlatLayout
from .optim import DEFAULT_CHUNK_NUMEL, ShardedAdamW

ZERO_STAGES = (1, 2)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer would update (each once, tied ones included once), in one dtype."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("module has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"every trainable parameter must have one floating dtype, got {sorted(map(str, dtypes))}")
    return params


def check_adamw(lr: object, betas: object, eps: object, weight_decay: object) -> dict:
    """AdamW's hyper-parameters, checked, as keyword arguments."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


@dataclass
class ShardedBucket:
    """One bucket: its parameters (indices), its flat layout and buffers, its shard's optimizer."""

    indices: list[int]
    layout: FlatLayout
    flat_params: torch.Tensor
    master: torch.Tensor
    optimizer: ShardedAdamW
    flat_grads: torch.Tensor | None = None  # stage 1: the full gradients, which .grad are views of
    grad_shard: torch.Tensor | None = None  # stage 2: this rank's shard of the summed gradients
    pending: int = 0
    reduced: bool = False
    transient: list[torch.Tensor] = field(default_factory=list)


class ZeroDataParallel(nn.Module):
    """``module`` trained with ZeRO ``stage`` (1 or 2) and AdamW, over ``comm``'s group.

    ``forward`` runs the module; ``loss.backward()`` then :meth:`step` (which reduces,
    updates and gathers) and :meth:`zero_grad`. Ranks must call them in the same order.
    ``meter`` measures the bytes held (:class:`~labkit.zero.accounting.MemoryMeter`).
    """

    def __init__(self, module: nn.Module, *, stage: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        super().__init__()
        if isinstance(stage, bool) or stage not in ZERO_STAGES:
            raise ValueError(f"stage must be 1 or 2 (stage 3 is labkit.zero.FullyShard), got {stage!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        check_positive_int(chunk_numel, "chunk_numel")
        hyper = check_adamw(lr, betas, eps, weight_decay)
        if not dist.is_initialized():
            raise RuntimeError("no process group: run inside labkit.collectives.launch.run or torchrun")
        self.module, self.stage = module, stage
        self.comm = Communicator() if comm is None else comm
        self.params = trainable_parameters(module)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        # DDP's rule over the parameters in reverse (the order backward produces their gradients)
        backward_order = list(reversed(range(len(self.params))))
        groups = assign_buckets([self.params[i] for i in backward_order], [int(bucket_cap_mb * MIB)],
                                order=backward_order)
        self.buckets = [self._make_bucket(indices, hyper, chunk_numel) for indices in groups]
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        if stage == 2:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        self.meter = MemoryMeter(self.tensors_by_kind)
        self.zero_grad()

    def _make_bucket(self, indices: list[int], hyper: dict, chunk_numel: int) -> ShardedBucket:
        params = [self.params[i] for i in indices]
        layout = FlatLayout([p.shape for p in params], self.world_size)
        with torch.no_grad():
            flat = layout.pack([p.detach() for p in params])
            dist.broadcast(flat, src=dist.get_global_rank(self.comm.group, 0) if self.comm.group else 0,
                           group=self.comm.group)  # every rank starts from rank 0's weights, as DDP
            for p, view in zip(params, layout.unpack(flat)):
                p.data = view
        own = layout.shard_of(flat, self.rank)
        master = own if own.dtype == torch.float32 else own.to(torch.float32)
        bucket = ShardedBucket(indices, layout, flat, master,
                               ShardedAdamW(master, chunk_numel=min(chunk_numel, layout.shard_numel), **hyper))
        if self.stage == 1:
            bucket.flat_grads = torch.zeros_like(flat)
            for p, view in zip(params, layout.unpack(bucket.flat_grads)):
                p.grad = view
        else:
            bucket.grad_shard = torch.zeros_like(own)
        return bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def tensors_by_kind(self) -> dict[str, list[torch.Tensor | None]]:
        """What this rank holds, by kind: parameters, gradients (full or sharded, and any in flight), optimizer."""
        return {
            "params": [b.flat_params for b in self.buckets],
            "grads": [p.grad for p in self.params] + [b.grad_shard for b in self.buckets]
                     + [t for b in self.buckets for t in b.transient],
            "optimizer": [b.master for b in self.buckets]
                         + [t for b in self.buckets for t in b.optimizer.state_tensors()],
        }

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.flat_grads is not None:
                bucket.flat_grads.zero_()
            else:
                bucket.grad_shard.zero_()
                for i in bucket.indices:
                    self.params[i].grad = None
            bucket.pending, bucket.reduced = len(bucket.indices), False

    def _reduce_scatter(self, bucket: ShardedBucket, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the average over ranks of ``full`` (divided first, as DDP divides)."""
        full.div_(self.world_size)
        shard = torch.empty(bucket.layout.shard_numel, dtype=full.dtype, device=full.device)
        bucket.transient.append(shard)
        self.comm.reduce_scatter(shard, full, tag="gradients")
        return shard

    def _grad_ready(self, i: int) -> None:
        """Stage 2, during backward: parameter ``i``'s gradient is in; reduce its bucket once full."""
        bucket = self.buckets[self.bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._reduce_bucket_during_backward(bucket)

    @torch.no_grad()
    def _reduce_bucket_during_backward(self, bucket: ShardedBucket) -> None:
        params = [self.params[i] for i in bucket.indices]
        full = bucket.layout.pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        bucket.transient.append(full)
        for p in params:  # the full gradients go: the shard of their sum is all this rank keeps
            p.grad = None
        bucket.grad_shard.add_(self._reduce_scatter(bucket, full))
        self.meter.sample("stage 2: a bucket reduce-scattered in backward")
        bucket.transient.clear()
        bucket.reduced = True

    @torch.no_grad()
    def step(self) -> None:
        """Reduce what backward has not, update this rank's shard, all-gather the parameters."""
        self.meter.sample("after backward")
        for bucket in self.buckets:
            if self.stage == 1:
                grad = self._reduce_scatter(bucket, bucket.flat_grads)
            else:
                if not bucket.reduced:  # parameters without gradients: reduce zeros, the others wait for us
                    self._reduce_bucket_during_backward(bucket)
                grad = bucket.grad_shard
            bucket.optimizer.step(grad)
            self.meter.sample("after a shard's update")
            bucket.transient.clear()
            own = bucket.layout.shard_of(bucket.flat_params, self.rank)
            # a copy: the all-gather writes the buffer the shard is a part of
            sent = bucket.master.to(own.dtype, copy=True)
            bucket.transient.append(sent)
            self.comm.all_gather(bucket.flat_params, sent, tag="parameters")
            bucket.transient.clear()
