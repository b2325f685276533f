"""What each rank runs (module-level, so :func:`labkit.collectives.launch.run` can start it).

Every program builds the book's decoder from a seed on every rank (the same weights), runs
its strategy on a batch any process can rebuild, and returns what the caller compares with
one process: losses, gradients (each rank's shard, named as in the whole model), and what
the rank put on its links (:class:`~labkit.parallel.comm.CommLog`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ddp import DataParallel
from ..models import Decoder, DecoderConfig, lm_loss
from . import comm
from .pipeline import PipelineStage, run_schedule, sync_tied_embedding
from .ring_attention import ring_attention, token_positions
from .schedules import make_schedule
from .tensor_parallel import TensorParallelDecoder

# Each sharded weight of a TP block, and the dimension of the whole weight it is cut along.
SHARD_DIM = {"wq": 0, "wk": 0, "wv": 0, "gate": 0, "up": 0, "wo": 1, "down": 1}


def batch(vocab: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    """Token ids ``[rows, seq + 1]``: the same on every process that asks for them."""
    return torch.randint(vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def tp_name(name: str) -> tuple[str, int | None]:
    """A TP decoder's parameter name -> (the whole model's name, the shard dimension or None)."""
    leaf = name.rsplit(".", 1)[-1]
    return (name + ".weight", SHARD_DIM[leaf]) if leaf in SHARD_DIM else (name, None)


def saved_activation_bytes(fn, *args):
    """Run ``fn(*args)``; return its result and the bytes autograd saved for backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter):  # weights are not activations
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values())


def tensor_parallel_step(config: dict, rows: int, seq: int, sequence_parallel: bool, seed: int = 0) -> dict:
    """One forward and backward of the decoder, tensor-parallel over all ranks."""
    model = Decoder(DecoderConfig(**config), seed=seed, init_std=0.1)
    tp = TensorParallelDecoder(model, sequence_parallel=sequence_parallel)
    ids = batch(config["vocab_size"], rows, seq, seed)
    log = comm.CommLog()
    with comm.logging_to(log):
        loss, saved = saved_activation_bytes(tp.loss, ids)
        loss.backward()
        activation_calls = len(log.calls)
        tp.sync_replicated_grads()
    total = loss.detach().clone()
    if sequence_parallel:
        dist.all_reduce(total)  # outside the log: reporting, not training traffic
    grads = {}
    for name, p in tp.named_parameters():
        whole, dim = tp_name(name)
        grads[whole] = (dim, p.grad)
    activation_log = comm.CommLog(log.calls[:activation_calls])
    grad_log = comm.CommLog(log.calls[activation_calls:])
    return {"loss": total.item(), "grads": grads, "activation_link_bytes": activation_log.link_bytes(),
            "grad_sync_link_bytes": grad_log.link_bytes(), "calls": activation_log.counts(),
            "saved_bytes": saved}


def torch_tensor_parallel_step(config: dict, rows: int, seq: int, seed: int = 0) -> dict:
    """The practitioner's way: the same step with torch's ``parallelize_module`` (DTensor) instead of ours.

    ``ColwiseParallel`` on ``wq``/``wk``/``wv``/``gate``/``up``, ``RowwiseParallel`` on
    ``wo``/``down``, as PyTorch's tensor-parallel tutorial does for Llama; each attention
    module is told its local head counts, since it reshapes by them. Returns the loss, each
    sharded weight's local gradient, and the (partial, unsynced) q/k-norm gradients.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = Decoder(DecoderConfig(**config), seed=seed, init_std=0.1)
    plan = {**{f"attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}, "attn.wo": RowwiseParallel(),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
        block.attn.num_heads //= n
        block.attn.num_kv_heads //= n
    loss = lm_loss(model, batch(config["vocab_size"], rows, seq, seed))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)[-2]
        if leaf in SHARD_DIM:
            grads[name] = (SHARD_DIM[leaf], p.grad.to_local())
        elif leaf in ("q_norm", "k_norm"):
            grads[name] = (None, p.grad)
    return {"loss": loss.item(), "grads": grads}


def pipeline_step(config: dict, schedule_name: str, microbatches: int, chunks: int, rows: int, seq: int,
                  seed: int = 0) -> dict:
    """One step of ``microbatches`` micro-batches of ``rows`` sequences through a pipeline over all ranks."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = Decoder(DecoderConfig(**config), seed=seed, init_std=0.1)
    stages = {c: PipelineStage(model, c * p + rank, p * chunks) for c in range(chunks)}
    tie_group = dist.new_group([0, p - 1])  # every rank creates every group
    actions = make_schedule(schedule_name, p, microbatches, chunks)[rank]
    mbs = [batch(config["vocab_size"], rows, seq, seed + 1 + i) for i in range(microbatches)]
    log = comm.CommLog()
    with comm.logging_to(log):
        run = run_schedule(stages, actions, mbs, p)
        sends = log.link_bytes()
        sync_tied_embedding(stages, p, tie_group)
    grads = {}
    for module in stages.values():
        for name, param in module.named_parameters():
            grads[module.original_name(name)] = param.grad
    return {"loss": run.loss, "grads": grads, "peak_in_flight": run.peak_in_flight, "events": run.events,
            "p2p_link_bytes": sends}


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_pipeline_step(config: dict, microbatches: int, rows: int, seq: int, seed: int = 0) -> dict:
    """The practitioner's way: our stages run by ``torch.distributed.pipelining``'s ``Schedule1F1B``.

    Torch splits the batch into ``microbatches`` along dim 0, applies the loss to each
    micro-batch (a mean over its tokens) and scales the gradients by ``1 / microbatches``:
    with equal micro-batches, the gradient of the whole batch's mean, as ours.
    """
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
    from torch.distributed.pipelining import Schedule1F1B

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(Decoder(DecoderConfig(**config), seed=seed, init_std=0.1), rank, p)
    tie_group = dist.new_group([0, p - 1])
    schedule = Schedule1F1B(TorchPipelineStage(stage, rank, p, torch.device("cpu")), n_microbatches=microbatches,
                            loss_fn=_mean_cross_entropy)
    ids = torch.cat([batch(config["vocab_size"], rows, seq, seed + 1 + i) for i in range(microbatches)])
    losses: list[torch.Tensor] = []
    if stage.is_first:
        schedule.step(ids[:, :-1])
    elif stage.is_last:
        schedule.step(target=ids[:, 1:], losses=losses)
    else:
        schedule.step()
    sync_tied_embedding({0: stage}, p, tie_group)
    return {"loss": sum(loss.item() for loss in losses) / microbatches,
            "grads": {stage.original_name(name): param.grad for name, param in stage.named_parameters()}}


def ring_attention_check(rows: int, heads: int, kv_heads: int, seq: int, head_dim: int, layout: str,
                         seed: int = 0) -> dict:
    """Ring attention of this rank's tokens of a random sequence; the caller compares with full attention."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, seq, head_dim, generator=gen)
    k = torch.randn(rows, kv_heads, seq, head_dim, generator=gen)
    v = torch.randn(rows, kv_heads, seq, head_dim, generator=gen)
    mine = token_positions(seq, rank, n, layout)
    stats: dict = {}
    log = comm.CommLog()
    with comm.logging_to(log):
        out = ring_attention(q[:, :, mine].contiguous(), k[:, :, mine].contiguous(), v[:, :, mine].contiguous(),
                             layout=layout, stats=stats)
    return {"positions": mine, "out": out, "score_elements": stats["score_elements"],
            "link_bytes": log.link_bytes()}


def data_parallel_step(config: dict, rows: int, seq: int, seed: int = 0) -> dict:
    """One step of :class:`labkit.ddp.DataParallel` (the DDP chapter's) with logged bucket all-reduces."""
    # The decoder's only buffer (RoPE's frequencies) is a constant: no per-forward broadcast.
    model = DataParallel(Decoder(DecoderConfig(**config), seed=seed, init_std=0.1), broadcast_buffers=False,
                         all_reduce=comm.all_reduce_async)
    log = comm.CommLog()
    with comm.logging_to(log):
        lm_loss(model, batch(config["vocab_size"], rows, seq, seed + 100 + dist.get_rank())).backward()
    return {"link_bytes": log.link_bytes(), "calls": log.counts(),
            "params": sum(p.numel() for p in model.module.parameters())}


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Several programs in one process group (one start-up): ``(program name, args)`` each."""
    programs = {"tensor_parallel_step": tensor_parallel_step, "pipeline_step": pipeline_step,
                "ring_attention_check": ring_attention_check, "data_parallel_step": data_parallel_step,
                "torch_tensor_parallel_step": torch_tensor_parallel_step, "torch_pipeline_step": torch_pipeline_step}
    return [programs[name](*args) for name, args in calls]
