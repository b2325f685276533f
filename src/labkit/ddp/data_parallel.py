"""``DistributedDataParallel`` from scratch: broadcast, buckets, hooks, overlapped all-reduce.

:class:`DataParallel` wraps a module the way ``torch.nn.parallel.DistributedDataParallel``
does, with the same steps in the same order, so that its gradients match torch's bit for
bit (the tests check it on gloo):

1. ``__init__`` broadcasts rank 0's parameters and buffers (every replica starts equal),
   assigns parameters to buckets (:mod:`labkit.ddp.buckets`) and puts a hook on every
   parameter that runs when its gradient has been accumulated.
2. ``forward`` rebuilds the buckets once, after the first backward, in the order the
   gradients really arrived; broadcasts rank 0's buffers; runs the module; and arms the
   hooks for the coming backward (unless inside :meth:`no_sync`). With
   ``find_unused_parameters`` it walks the autograd graph from the output to find the
   parameters this backward will never reach.
3. In backward each hook copies its gradient, divided by the world size, into its slot of
   the bucket's flat buffer. When a bucket's last gradient lands, and every earlier
   bucket has been launched, the bucket's all-reduce starts, asynchronously: it runs on
   the communication thread while autograd computes the next gradients.
4. When backward ends (a callback queued on the autograd engine) the reducer waits for
   every all-reduce and copies the averaged gradients back into ``param.grad``.

``overlap=False`` launches the same buckets only after backward, the baseline the chapter
times against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .buckets import NO_LIMIT, assign_buckets, bucket_limits

AllReduce = Callable[[torch.Tensor, "dist.ProcessGroup | None"], Any]


def torch_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    """The default: torch's asynchronous all-reduce (a sum), returning its work handle."""
    return dist.all_reduce(flat, group=group, async_op=True)


@dataclass
class Bucket:
    """One flat buffer of gradients that travels as one all-reduce."""

    indices: list[int]            # parameter indices, in the order of the buffer
    buffer: torch.Tensor          # the gradients, each divided by the world size
    views: list[torch.Tensor]     # views of ``buffer`` shaped like each parameter
    pending: int = 0              # gradients still to arrive in this backward
    work: Any = None              # the all-reduce in flight

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class BackwardTrace:
    """When things happened in the last synchronised backward, in seconds of ``perf_counter``."""

    start: float = 0.0                                   # the first gradient hook
    filled: dict[int, float] = field(default_factory=dict)     # bucket -> its last gradient arrived
    launched: dict[int, float] = field(default_factory=dict)   # bucket -> its all-reduce started
    reduced: dict[int, float] = field(default_factory=dict)    # bucket -> its all-reduce finished
    backward_end: float = 0.0                            # autograd finished computing gradients
    synced: float = 0.0                                  # gradients averaged and back in param.grad


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def parameters_reached(output: Any) -> set[int]:
    """``id`` of every leaf tensor the autograd graph behind ``output`` accumulates into.

    DDP's ``find_unused_parameters`` does this walk after each forward (from the
    ``AccumulateGrad`` nodes it reaches) to learn which parameters get no gradient.
    """
    seen, reached = set(), set()
    stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


class DataParallel(nn.Module):
    """Data parallelism as torch's DDP does it, written out: see the module docstring.

    ``bucket_cap_mb`` (default 25 MiB, with a 1 MiB first bucket), ``find_unused_parameters``
    and ``broadcast_buffers`` mean what they mean for torch's DDP. ``overlap=False``
    all-reduces the buckets only after backward. ``all_reduce(flat, group)`` sums a flat
    buffer across ranks and returns a handle with ``wait()`` (or anything else once the sum
    is done, like :func:`labkit.collectives.ring_all_reduce`).
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True, overlap: bool = True,
                 all_reduce: AllReduce = torch_all_reduce, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("no process group: wrap the model on ranks started by "
                               "labkit.collectives.launch.run (or torchrun and launch.init_from_torchrun)")
        for name, flag in (("find_unused_parameters", find_unused_parameters),
                           ("broadcast_buffers", broadcast_buffers), ("overlap", overlap)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if not callable(all_reduce):
            raise TypeError(f"all_reduce must be a function (flat tensor, group) -> handle, got {all_reduce!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter that requires a gradient: nothing to synchronise")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.overlap = overlap
        self.all_reduce = all_reduce
        self.require_backward_grad_sync = True
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.first_bucket_bytes, self.bucket_bytes = bucket_limits(bucket_cap_mb)
        self._source = 0 if group is None else dist.get_global_rank(group, 0)

        self._broadcast(list(module.parameters()) + list(module.buffers()))
        # Before the first backward the arrival order is a guess, so (unless unused
        # parameters are expected, which disables the rebuild) everything starts in one
        # bucket; see labkit.ddp.buckets.
        if find_unused_parameters:
            limits = ([self.first_bucket_bytes, self.bucket_bytes] if self.first_bucket_bytes < self.bucket_bytes
                      else [self.bucket_bytes])
        else:
            limits = [NO_LIMIT]
        self._set_buckets(list(reversed(assign_buckets(self._params, limits))))
        # The first synchronised backward records the order gradients arrive in; the
        # next forward rebuilds the buckets from it. find_unused_parameters never rebuilds.
        self._arrival: list[int] | None = None if find_unused_parameters else []
        self._rebuild_due = False

        self._armed = False          # hooks act only in a backward that follows a synced forward
        self._started = False
        self._unused: list[int] = []
        self._ready: set[int] = set()  # parameters whose gradient reached its bucket
        self._next_bucket = 0
        self.trace = BackwardTrace()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self._params)]

    # -- buckets ---------------------------------------------------------------------
    def _set_buckets(self, bucket_indices: list[list[int]]) -> None:
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[int, torch.Tensor]] = {}
        for b, indices in enumerate(bucket_indices):
            members = [self._params[i] for i in indices]
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            views = [chunk.view_as(p) for chunk, p in zip(buffer.split([p.numel() for p in members]), members)]
            self.buckets.append(Bucket(list(indices), buffer, views))
            for i, view in zip(indices, views):
                self._slot[i] = (b, view)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The parameter indices of each bucket, in the order the buckets are all-reduced."""
        return [list(b.indices) for b in self.buckets]

    def _rebuild_buckets(self) -> None:
        # Every rank must cut the same buckets, so rank 0's arrival order wins (as in torch).
        order = [self._arrival]
        dist.broadcast_object_list(order, src=self._source, group=self.group)
        arrival = order[0]
        self._set_buckets(assign_buckets([self._params[i] for i in arrival],
                                         [self.first_bucket_bytes, self.bucket_bytes], order=arrival))
        self._arrival, self._rebuild_due = None, False

    # -- forward ---------------------------------------------------------------------
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=self._source, group=self.group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synced one averages the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self._rebuild_due:
            self._rebuild_buckets()
        if self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))
        output = self.module(*args, **kwargs)
        if grad_enabled and self.require_backward_grad_sync:
            self._prepare_for_backward(output)
        return output

    def _prepare_for_backward(self, output: Any) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.indices), None
        self._next_bucket = 0
        self._armed, self._started = True, False
        self._unused, self._ready = [], set()
        if self.find_unused_parameters:
            reached = parameters_reached(output)
            self._unused = [i for i, p in enumerate(self._params) if id(p) not in reached]

    # -- backward --------------------------------------------------------------------
    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._armed:  # under no_sync, or a backward DDP's forward did not prepare
                return
            if not self._started:
                self._started = True
                self.trace = BackwardTrace(start=time.perf_counter())
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
                for unused in self._unused:  # their buckets must fill too, or nothing launches
                    self._mark_ready(unused, None)
            self._mark_ready(index, param.grad)
        return hook

    def _mark_ready(self, index: int, grad: torch.Tensor | None) -> None:
        if self._arrival is not None:
            self._arrival.append(index)
        self._ready.add(index)
        b, view = self._slot[index]
        if grad is None:
            view.zero_()
        else:
            # Divide while copying, as reducer.cpp does (one pass over the gradient).
            torch.mul(grad, 1.0 / self.world_size, out=view)
        bucket = self.buckets[b]
        bucket.pending -= 1
        if bucket.pending == 0:
            self.trace.filled[b] = time.perf_counter()
            if self.overlap:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # All ranks must issue the all-reduces in the same order: a bucket that fills
        # early waits for every earlier bucket to launch.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        bucket, trace = self.buckets[b], self.trace
        trace.launched[b] = time.perf_counter()
        handle = self.all_reduce(bucket.buffer, self.group)
        if hasattr(handle, "wait"):
            bucket.work = handle
            if hasattr(handle, "get_future"):
                handle.get_future().then(lambda _: trace.reduced.__setitem__(b, time.perf_counter()))
        else:
            trace.reduced[b] = time.perf_counter()

    def _finalize_backward(self) -> None:
        self._armed = False
        self.trace.backward_end = time.perf_counter()
        if len(self._ready) < len(self._params):
            missing = [n for i, n in enumerate(self.param_names) if i not in self._ready]
            raise RuntimeError("some parameters received no gradient in this backward, so their buckets never "
                               "filled: pass find_unused_parameters=True. Parameters without a gradient "
                               f"({len(missing)}, the first 5): {missing[:5]}")
        self._launch_ready_buckets()  # after backward: everything, when overlap is off
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        globally_unused: set[int] = set()
        if self.find_unused_parameters:
            used = torch.ones(len(self._params), dtype=torch.int32, device=self.buckets[0].buffer.device)
            used[self._unused] = 0
            dist.all_reduce(used, group=self.group)
            globally_unused = {i for i in range(len(self._params)) if used[i] == 0}
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if i in globally_unused:  # nobody computed a gradient: leave .grad as it was
                    continue
                view = self._slot[i][1]
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        if self._arrival is not None:
            self._rebuild_due = True
        self.trace.synced = time.perf_counter()
