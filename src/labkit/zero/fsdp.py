"""ZeRO-3, the FSDP way: parameters sharded too, gathered one unit at a time.

:class:`FullyShard` wraps a model whose blocks are its *units* (FSDP's wrapping: one
``fully_shard`` call per transformer block, and one for the root, which takes every
parameter left over: embedding, final norm, LM head). Between uses a unit's parameters
exist only as shards; each rank keeps ``1/N`` of every unit, plus that shard's master
weights, gradient and AdamW moments: ``16 P / N`` bytes in all.

A step, for one unit:

1. **Forward**: all-gather the unit's parameters (:meth:`ShardedUnit.start_unshard` issues
   it, :meth:`ShardedUnit.finish_unshard` waits and, in the per-parameter layout, copies
   each parameter out of the gathered buffer), run it, and free them again
   (``reshard_after_forward``). The unit's parameters are the module's own
   ``nn.Parameter`` objects throughout; freeing one resizes its storage to zero bytes, so
   the tensors autograd saved for backward see the data again once it is gathered back
   (what FSDP does; it is why the copy-out writes through ``.data``, which leaves the
   version counter autograd checks alone).
2. **Backward**: a hook on the unit's output fires before its backward runs, and gathers
   the parameters again. When the last parameter's gradient has accumulated, the unit's
   gradients are packed in the layout's order, reduce-scattered (each rank gets the
   average of its shard), and freed with the parameters.
3. **Step**: each unit's shard takes its AdamW step (:class:`~labkit.zero.optim.ShardedAdamW`).
   Nothing is gathered: the next forward does.

``prefetch`` gathers the next unit (the one after in forward, the one before in backward)
as soon as the current one is gathered, so the next all-gather is in flight while this
unit computes: the communication hides behind compute, at the price of two units being
whole at once. ``layout`` chooses FSDP1's flat cut or FSDP2's per-parameter cut
(:mod:`labkit.zero.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..validate import check_choice, check_positive_int
from .accounting import MemoryMeter
from .comm import Communicator
from .layout import LAYOUTS
from .optim import DEFAULT_CHUNK_NUMEL, ShardedAdamW
from .zero import check_adamw, trainable_parameters


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class ShardedUnit:
    """One unit's parameters: sharded at rest, gathered while forward or backward runs it."""

    def __init__(self, name: str, params: list[nn.Parameter], layout_kind: str, comm: Communicator,
                 hyper: dict, chunk_numel: int) -> None:
        self.name, self.params, self.comm = name, params, comm
        self.layout = LAYOUTS[layout_kind]([p.shape for p in params], comm.world_size)
        with torch.no_grad():
            full = self.layout.pack([p.detach() for p in params])
            dist.broadcast(full, src=dist.get_global_rank(comm.group, 0) if comm.group else 0, group=comm.group)
            self.shard = self.layout.shard_of(full, comm.rank).clone()
            if layout_kind == "flat":
                # FSDP1: the parameters are views of one flat buffer, gathered in place
                for p, view in zip(params, self.layout.unpack(full)):
                    p.data = view
                self.full = full
            else:
                for p in params:
                    p.data = p.data.contiguous()
                self.full = None
        self.master = self.shard if self.shard.dtype == torch.float32 else self.shard.to(torch.float32)
        self.optimizer = ShardedAdamW(self.master, chunk_numel=min(chunk_numel, self.layout.shard_numel), **hyper)
        self.grad_shard = torch.zeros_like(self.shard)
        self.gathered = True  # until the first reshard below
        self.work = None
        self.pending, self.reduced = len(params), False
        self.transient: list[torch.Tensor] = []
        self.reshard()

    @property
    def num_params(self) -> int:
        return self.layout.numel

    def start_unshard(self) -> None:
        """Issue the all-gather of this unit's parameters (asynchronous where the backend allows)."""
        if self.gathered or self.work is not None:
            return
        if self.full is None:
            self.full = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        else:
            _alloc(self.full)
        self.work = self.comm.all_gather(self.full, self.shard, tag=f"parameters of {self.name}", async_op=True)

    def finish_unshard(self) -> None:
        """Wait for the all-gather and make the parameters whole."""
        if self.gathered:
            return
        self.start_unshard()
        self.work.wait()
        self.work = None
        if self.layout.kind == "per-parameter":  # FSDP2's copy-out into each parameter's own storage
            for p in self.params:
                _alloc(p)
            self.layout.unpack(self.full, out=[p.data for p in self.params])
            self.transient.append(self.full)
        self.gathered = True

    def drop_gathered_buffer(self) -> None:
        """After the copy-out, the per-parameter layout frees the gathered buffer."""
        self.transient.clear()
        if self.layout.kind == "per-parameter":
            self.full = None

    def reshard(self) -> None:
        """Free the gathered parameters; the shard stays."""
        if not self.gathered:
            return
        if self.layout.kind == "flat":
            _free(self.full)  # the parameters are views of it
        else:
            for p in self.params:
                _free(p)
        self.drop_gathered_buffer()
        self.gathered = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter this unit's gradients (zeros for a parameter without one), then free them."""
        world = self.comm.world_size
        full = self.layout.pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        self.transient.append(full)
        for p in self.params:
            p.grad = None
        full.div_(world)  # divided before the sum, as DDP divides
        shard = torch.empty_like(self.shard)
        self.transient.append(shard)
        self.comm.reduce_scatter(shard, full, tag=f"gradients of {self.name}")
        self.grad_shard.add_(shard)
        self.reduced = True

    def step(self) -> None:
        self.optimizer.step(self.grad_shard)
        if self.master is not self.shard:
            self.shard.copy_(self.master)


class FullyShard(nn.Module):
    """``module`` with its ``units`` (and the root: the rest) fully sharded, trained with AdamW.

    ``units`` are submodules called in this order in forward, each once (the book's
    ``Decoder``: its ``blocks``). ``layout``: ``"per-parameter"`` (FSDP2) or ``"flat"``
    (FSDP1). Then ``loss.backward()``, :meth:`step`, :meth:`zero_grad`, on every rank.
    """

    def __init__(self, module: nn.Module, units: Sequence[nn.Module], *, layout: str = "per-parameter",
                 reshard_after_forward: bool = True, prefetch: bool = True, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 comm: Communicator | None = None, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        super().__init__()
        check_choice(layout, "layout", LAYOUTS)
        for flag, name in ((reshard_after_forward, "reshard_after_forward"), (prefetch, "prefetch")):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        check_positive_int(chunk_numel, "chunk_numel")
        hyper = check_adamw(lr, betas, eps, weight_decay)
        if not dist.is_initialized():
            raise RuntimeError("no process group: run inside labkit.collectives.launch.run or torchrun")
        all_params = trainable_parameters(module)
        units = list(units)
        owned = {m: i for i, m in enumerate(module.modules())}
        if not units or any(not isinstance(u, nn.Module) or u not in owned or u is module for u in units):
            raise ValueError("units must be a non-empty list of submodules of module (not module itself)")
        self.module = module
        self.comm = Communicator() if comm is None else comm
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        claimed: set[int] = set()
        self.units: list[ShardedUnit] = []
        for k, unit_module in enumerate(units):
            params = [p for p in unit_module.parameters() if p.requires_grad and id(p) not in claimed]
            if not params:
                raise ValueError(f"unit {k} has no trainable parameters of its own")
            claimed.update(id(p) for p in params)
            self.units.append(ShardedUnit(f"unit {k}", params, layout, self.comm, hyper, chunk_numel))
            unit_module.register_forward_pre_hook(lambda m, args, k=k: self._before_forward(k))
            unit_module.register_forward_hook(lambda m, args, out, k=k: self._after_forward(k, out))
        rest = [p for p in all_params if id(p) not in claimed]
        self.root = ShardedUnit("root", rest, layout, self.comm, hyper, chunk_numel) if rest else None
        for unit in self.all_units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_ready(unit))
        self.meter = MemoryMeter(self.tensors_by_kind)

    @property
    def all_units(self) -> list[ShardedUnit]:
        return ([self.root] if self.root is not None else []) + self.units

    def tensors_by_kind(self) -> dict[str, list[torch.Tensor | None]]:
        units = self.all_units
        return {
            "params": [u.shard for u in units] + [p for u in units for p in u.params]
                      + [u.full for u in units if u.full is not None],
            "grads": [p.grad for u in units for p in u.params] + [u.grad_shard for u in units]
                     + [t for u in units for t in u.transient],
            "optimizer": [u.master for u in units] + [t for u in units for t in u.optimizer.state_tensors()],
        }

    def _unshard(self, unit: ShardedUnit, where: str) -> None:
        unit.finish_unshard()
        self.meter.sample(where)
        unit.drop_gathered_buffer()

    def forward(self, *args, **kwargs):
        if self.root is not None:
            self._unshard(self.root, "root gathered")
        if self.prefetch:
            self.units[0].start_unshard()
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_begins)
        return out

    def _before_forward(self, k: int) -> None:
        self._unshard(self.units[k], f"forward: {self.units[k].name} gathered")
        if self.prefetch and k + 1 < len(self.units):
            self.units[k + 1].start_unshard()

    def _after_forward(self, k: int, out):
        if self.reshard_after_forward:
            self.units[k].reshard()
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, k=k: self._before_backward(k))
        return out

    def _backward_begins(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        if self.prefetch and self.units:
            self.units[-1].start_unshard()

    def _before_backward(self, k: int) -> None:
        self._unshard(self.units[k], f"backward: {self.units[k].name} gathered")
        if self.prefetch and k > 0:
            self.units[k - 1].start_unshard()

    def _grad_ready(self, unit: ShardedUnit) -> None:
        unit.pending -= 1
        if unit.pending == 0:
            self._reduce(unit)

    def _reduce(self, unit: ShardedUnit) -> None:
        unit.reduce_gradients()
        self.meter.sample(f"backward: {unit.name} reduce-scattered")
        unit.transient.clear()
        unit.reshard()

    def _after_backward(self) -> None:
        """The end of backward: units some parameter of which got no gradient are reduced now (all ranks)."""
        for unit in self.all_units:
            if not unit.reduced:
                unit.finish_unshard()
                unit.drop_gathered_buffer()
                self._reduce(unit)

    @torch.no_grad()
    def step(self) -> None:
        for unit in self.all_units:
            unit.step()
            self.meter.sample(f"step: {unit.name} updated")

    def zero_grad(self) -> None:
        for unit in self.all_units:
            unit.grad_shard.zero_()
            unit.pending, unit.reduced = len(unit.params), False
            for p in unit.params:
                p.grad = None

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter whole, gathered now (a collective: call it on every rank), in module order."""
        by_id = {}
        for unit in self.all_units:
            full = torch.empty(unit.layout.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
            self.comm.all_gather(full, unit.shard, tag="full_parameters")
            self.comm.log.pop()  # a read-out for checking, not training traffic
            for p, t in zip(unit.params, unit.layout.unpack(full)):
                by_id[id(p)] = t.clone()
        return [by_id[id(p)] for p in trainable_parameters(self.module)]
