"""AdamW on one rank's shard: torch's own AdamW, run a chunk at a time.

The sharded update is torch's ``AdamW`` applied to a flat fp32 shard (the master weights).
It is elementwise, so updating the shard, a slice of it, or each parameter's rows
separately gives the same bits: this is why a flat ZeRO shard and FSDP2's per-parameter
shards take identical steps. Two details keep memory what the formula says:

- The shard is cut into chunks of at most ``chunk_numel`` elements, each with its own
  optimizer, and the single-tensor (not ``foreach``) implementation runs: its
  temporaries (``sqrt(v)``, the update) are then one chunk big, not one shard. Fused
  optimizers (DeepSpeed's, ``AdamW(fused=True)``) get the same effect from one kernel.
- Gradients arrive in the parameters' dtype (bf16 in mixed precision) and are cast to
  fp32 one chunk at a time, just before that chunk's update.
"""

from __future__ import annotations

import torch

from ..validate import check_positive_int, check_tensor

DEFAULT_CHUNK_NUMEL = 1 << 20


class ShardedAdamW:
    """``torch.optim.AdamW(**hyper)`` over ``master`` (a flat fp32 tensor), chunk by chunk."""

    def __init__(self, master: torch.Tensor, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        check_tensor(master, "master", ndim=1, dtypes=(torch.float32,), contiguous=True)
        check_positive_int(chunk_numel, "chunk_numel")
        self.master = master
        self.chunks = [c.detach() for c in master.split(chunk_numel)]
        self.optimizers = [torch.optim.AdamW([c], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                             foreach=False, fused=False) for c in self.chunks]

    def step(self, grad: torch.Tensor) -> None:
        """One AdamW step of the shard with gradient ``grad`` (same length, any float dtype)."""
        check_tensor(grad, "grad", ndim=1, contiguous=True)
        if grad.numel() != self.master.numel():
            raise ValueError(f"grad must have the shard's {self.master.numel()} elements, got {grad.numel()}")
        for chunk, grad_chunk, optimizer in zip(self.chunks, grad.split(self.chunks[0].numel()), self.optimizers):
            chunk.grad = grad_chunk.to(torch.float32)
            optimizer.step()
            chunk.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Adam's moments (and step counters), for memory accounting."""
        return [t for opt in self.optimizers for state in opt.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
