"""Tensor parallelism (Megatron-LM): each rank holds a slice of every weight matrix of a block.

A *column-parallel* linear splits the output features: rank ``r`` holds rows
``W[r*k:(r+1)*k]`` of ``W`` ``[out, in]`` and computes its slice of ``y = x W^T`` from the
whole ``x``. A *row-parallel* linear splits the input features: rank ``r`` holds columns
``W[:, r*k:(r+1)*k]``, takes its slice of ``x`` and produces a *partial sum* of the whole
``y``. Chained column-then-row, the slice never needs gathering: the MLP splits
``gate``/``up`` by columns and ``down`` by rows, attention splits ``wq``/``wk``/``wv`` by
heads and ``wo`` by rows. Each half of a block then needs exactly one all-reduce in forward
(Megatron's ``g``, summing the partial outputs) and one in backward (``f``, summing the
partial gradients of the replicated input) {cite}`shoeybi2019megatron`: four per block.

With ``sequence_parallel=True`` the regions between them run on ``s/t`` tokens per rank
(:mod:`labkit.parallel.sequence_parallel`): ``f`` becomes an all-gather and ``g`` a
reduce-scatter.

Parameters every rank holds whole (norms, embedding, LM head) get *partial* gradients
where each rank saw only part of the work: the per-head q/k norms always (each rank
normalises its own heads), and, under sequence parallelism, everything outside the
matmuls (each rank saw its own tokens). :meth:`TensorParallelDecoder.sync_replicated_grads`
all-reduces exactly those.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models import Decoder, apply_rope, attend, masked_cross_entropy_sum
from ..models.decoder import Attention, Block, MLP
from . import comm
from .sequence_parallel import gather_sequence, reduce_scatter_sequence, sequence_slice

PARTIAL_GRAD = "_partial_grad_under_tp"  # marks a replicated parameter whose gradient each rank holds a part of


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward sums the ranks' partial input gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward sums the ranks' partial outputs; identity backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return comm.all_reduce(partial.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(partial: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(partial, group)


def shard_rows(weight: torch.Tensor, rank: int, world_size: int, what: str) -> nn.Parameter:
    """Rank ``rank``'s block of output features of ``weight`` ``[out, in]``: a column-parallel shard."""
    if weight.shape[0] % world_size:
        raise ValueError(f"{what}: {weight.shape[0]} output features do not split over {world_size} ranks")
    return nn.Parameter(weight.detach().chunk(world_size, 0)[rank].clone())


def shard_columns(weight: torch.Tensor, rank: int, world_size: int, what: str) -> nn.Parameter:
    """Rank ``rank``'s block of input features of ``weight`` ``[out, in]``: a row-parallel shard."""
    if weight.shape[1] % world_size:
        raise ValueError(f"{what}: {weight.shape[1]} input features do not split over {world_size} ranks")
    return nn.Parameter(weight.detach().chunk(world_size, 1)[rank].clone())


class _Region(nn.Module):
    """How a tensor-parallel region is entered and left: ``f``/``g``, or all-gather/reduce-scatter."""

    def __init__(self, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tensor_parallel(x, self.group)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_tensor_parallel(partial, self.group)


class TensorParallelAttention(_Region):
    """Rank ``r``'s query and K/V heads (column-parallel ``wq``/``wk``/``wv``), row-parallel ``wo``."""

    def __init__(self, attn: Attention, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__(group, sequence_parallel)
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        if attn.num_kv_heads % n:
            raise ValueError(f"tensor parallelism over {n} ranks splits the K/V heads: {attn.num_kv_heads} K/V "
                             f"heads do not divide (Megatron then replicates K/V heads; not done here)")
        self.heads, self.kv_heads, self.head_dim = attn.num_heads // n, attn.num_kv_heads // n, attn.head_dim
        self.wq = shard_rows(attn.wq.weight, rank, n, "wq")
        self.wk = shard_rows(attn.wk.weight, rank, n, "wk")
        self.wv = shard_rows(attn.wv.weight, rank, n, "wv")
        self.wo = shard_columns(attn.wo.weight, rank, n, "wo")
        self.q_norm, self.k_norm = copy.deepcopy(attn.q_norm), copy.deepcopy(attn.k_norm)
        for p in (self.q_norm.weight, self.k_norm.weight):
            setattr(p, PARTIAL_GRAD, True)  # each rank normalises only its own heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        batch, length, _ = x.shape
        q = self.q_norm(F.linear(x, self.wq).view(batch, length, self.heads, self.head_dim))
        k = self.k_norm(F.linear(x, self.wk).view(batch, length, self.kv_heads, self.head_dim))
        v = F.linear(x, self.wv).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        out = attend(q, k, v).transpose(1, 2).reshape(batch, length, -1)
        return self.leave(F.linear(out, self.wo))


class TensorParallelMLP(_Region):
    """SwiGLU with column-parallel ``gate``/``up`` and row-parallel ``down``."""

    def __init__(self, mlp: MLP, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__(group, sequence_parallel)
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        self.gate = shard_rows(mlp.gate.weight, rank, n, "gate")
        self.up = shard_rows(mlp.up.weight, rank, n, "up")
        self.down = shard_columns(mlp.down.weight, rank, n, "down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        return self.leave(F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down))


class TensorParallelBlock(nn.Module):
    """One decoder block: ``x + attn(norm(x))``, ``x + mlp(norm(x))``, the matmuls split."""

    def __init__(self, block: Block, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = copy.deepcopy(block.attn_norm), copy.deepcopy(block.mlp_norm)
        self.attn = TensorParallelAttention(block.attn, group, sequence_parallel)
        self.mlp = TensorParallelMLP(block.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TensorParallelDecoder(nn.Module):
    """The book's :class:`~labkit.models.Decoder`, its blocks tensor-parallel over ``group``.

    The embedding, final norm and LM head stay whole on every rank (Megatron also splits
    the vocabulary; here they are small). With ``sequence_parallel`` each rank embeds,
    runs the norms and residuals on, and scores its own ``s/t`` tokens.
    """

    def __init__(self, model: Decoder, group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit.models.Decoder, got {type(model).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("no process group: run on ranks started by labkit.collectives.launch.run")
        self.group, self.sequence_parallel = group, bool(sequence_parallel)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        whole = copy.deepcopy(model)  # deepcopy keeps the embedding tied to the LM head
        self.embed, self.norm, self.lm_head, self.rope = whole.embed, whole.norm, whole.lm_head, whole.rope
        self.blocks = nn.ModuleList(TensorParallelBlock(b, group, self.sequence_parallel) for b in model.blocks)
        if self.sequence_parallel:
            for p in self.replicated_parameters():
                setattr(p, PARTIAL_GRAD, True)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole: norms, embedding (tied LM head)."""
        sharded = {id(p) for b in self.blocks for m in (b.attn, b.mlp)
                   for name, p in m.named_parameters(recurse=False)}
        return [p for p in self.parameters() if id(p) not in sharded]

    def tokens(self, length: int) -> slice:
        """The positions of a length-``length`` sequence this rank embeds and scores."""
        return sequence_slice(length, self.rank, self.world_size) if self.sequence_parallel else slice(0, length)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for this rank's tokens (all of them, or its ``s/t`` under sequence parallelism)."""
        length = input_ids.shape[1]
        x = self.embed(input_ids[:, self.tokens(length)])
        cos, sin = self.rope(torch.arange(length, device=x.device), x.dtype)  # attention sees every position
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of :func:`labkit.models.lm_loss` of ``ids`` ``[b, s+1]``.

        Without sequence parallelism every rank computes the whole loss; with it, the
        ranks' shares (their tokens' cross-entropy over the batch's token count) sum to it.
        """
        inputs, targets = ids[:, :-1], ids[:, 1:][:, self.tokens(ids.shape[1] - 1)]
        every_target = torch.ones_like(targets, dtype=torch.bool)
        return masked_cross_entropy_sum(self(inputs), targets, every_target) / ids[:, 1:].numel()

    def sync_replicated_grads(self) -> None:
        """All-reduce the gradients that each rank holds only a part of (see the module docstring)."""
        for p in self.parameters():
            if getattr(p, PARTIAL_GRAD, False) and p.grad is not None:
                comm.all_reduce(p.grad, self.group)
