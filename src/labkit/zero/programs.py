"""What each rank runs (module-level, so :func:`labkit.collectives.launch.run` can start it).

- :func:`compare_with_torch`: the book's decoder trained by ours and by torch's peer side by
  side from the same weights on the same batches: ZeRO-1/2 against DDP +
  ``ZeroRedundancyOptimizer``, our FSDP against FSDP2's ``fully_shard``. Per step: both
  losses (averaged over ranks), the largest parameter difference, the bytes our
  collectives sent, and the peak bytes our rank held.
- :func:`simulated_rank_memory`: one process plays rank 0 of ``N`` on a fake process
  group (collectives that move nothing), to measure what one rank of a large job holds,
  on the CPU by counting storage and on a GPU also by the CUDA allocator's peak.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.programs import batch_for
from ..models import Decoder, DecoderConfig, lm_loss
from .comm import Communicator, Transfer, counting_torch_collectives
from .fsdp import FullyShard
from .memory import FP32_ADAMW, MIXED_ADAMW, fsdp_bytes_per_rank, state_bytes_per_rank
from .zero import ZeroDataParallel, trainable_parameters

WRAPPERS = ("zero1", "zero2", "fsdp2", "fsdp1")
PEERS = {"zero1": "DDP + ZeroRedundancyOptimizer", "zero2": "DDP + ZeroRedundancyOptimizer",
         "fsdp2": "FSDP2 fully_shard", "fsdp1": "FSDP2 fully_shard"}
# The book's AdamW betas (labkit.models.train.adamw), a learning rate that moves the weights visibly
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def wrap_ours(model: nn.Module, kind: str, comm: Communicator, *, bucket_cap_mb: float = 0.05,
              prefetch: bool = True, chunk_numel: int = 1 << 20) -> ZeroDataParallel | FullyShard:
    """Our wrapper of ``kind`` around the decoder ``model``."""
    if kind in ("zero1", "zero2"):
        return ZeroDataParallel(model, stage=int(kind[-1]), comm=comm, bucket_cap_mb=bucket_cap_mb,
                                chunk_numel=chunk_numel, **HYPER)
    if kind in ("fsdp1", "fsdp2"):
        return FullyShard(model, model.blocks, layout="flat" if kind == "fsdp1" else "per-parameter",
                          prefetch=prefetch, comm=comm, chunk_numel=chunk_numel, **HYPER)
    raise ValueError(f"kind must be one of {WRAPPERS}, got {kind!r}")


def wrap_torch(model: nn.Module, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torch's peer of ``kind``: DDP + ZeroRedundancyOptimizer, or FSDP2 on every block and the root."""
    if kind in ("zero1", "zero2"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **HYPER)
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)


def rank_batch(config: dict, step: int, rank: int, *, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step``: any process can rebuild any rank's batch."""
    return batch_for(config["vocab_size"], batch, seq, step=step, micro=0, rank=rank, seed=seed)


def compare_cases(cases: list[tuple[str, dict, int, dict]]) -> list[dict]:
    """:func:`compare_with_torch` for each ``(kind, config, steps, keyword arguments)``, in one group."""
    return [compare_with_torch(kind, config, steps, **kwargs) for kind, config, steps, kwargs in cases]


def _mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().clone().reshape(1)
    dist.all_reduce(t)  # bookkeeping, not training traffic: outside our communicator's count
    return t.item() / dist.get_world_size()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def compare_with_torch(kind: str, config: dict, steps: int, *, batch: int = 2, seq: int = 16, seed: int = 0,
                       impl: str = "torch", prefetch: bool = True) -> dict:
    """Train ours and torch's ``kind`` side by side for ``steps`` AdamW steps; see the module doc."""
    rank = dist.get_rank()
    comm = Communicator(impl)
    ours = wrap_ours(Decoder(DecoderConfig(**config), seed=seed), kind, comm, prefetch=prefetch)
    theirs, their_opt = wrap_torch(Decoder(DecoderConfig(**config), seed=seed), kind)
    report = {"kind": kind, "peer": PEERS[kind], "world_size": dist.get_world_size(), "impl": impl,
              "our_loss": [], "their_loss": [], "max_param_diff": [], "params_equal": [], "sent": [],
              "their_sent": []}
    def our_parameters() -> list[torch.Tensor]:
        return ours.full_parameters() if isinstance(ours, FullyShard) else [p.detach().clone() for p in ours.params]

    initial = our_parameters()
    for step in range(steps):
        ids = rank_batch(config, step, rank, batch=batch, seq=seq, seed=seed)
        comm.log.clear()
        loss = lm_loss(ours, ids)
        loss.backward()
        ours.step()
        ours.zero_grad()
        report["sent"].append({c: comm.sent_bytes(c) for c in ("reduce_scatter", "all_gather")})
        their_log: list[Transfer] = []
        with counting_torch_collectives(their_log):  # sees FSDP2's collectives (DDP's C++ reducer is not Python)
            their_loss = lm_loss(theirs, ids)
            their_loss.backward()
            their_opt.step()
            their_opt.zero_grad(set_to_none=True)
        report["their_sent"].append({c: sum(t.sent_bytes for t in their_log if t.collective == c)
                                     for c in ("reduce_scatter", "all_gather")})
        report["our_loss"].append(_mean_over_ranks(loss))
        report["their_loss"].append(_mean_over_ranks(their_loss))
        mine = our_parameters()
        ref = [_full(p).detach() for p in (theirs.module if kind.startswith("zero") else theirs).parameters()]
        report["max_param_diff"].append(max(float((a - b).abs().max()) for a, b in zip(mine, ref)))
        report["params_equal"].append(all(torch.equal(a, b) for a, b in zip(mine, ref)))
    report["moved"] = max(float((a - b).abs().max()) for a, b in zip(mine, initial))  # the weights did train
    report["final_params"] = mine
    report["peak"], report["peak_at"] = dict(ours.meter.peak), ours.meter.peak_at
    report["num_params"] = sum(p.numel() for p in ref)
    if isinstance(ours, FullyShard):
        report["root_params"] = ours.root.num_params if ours.root is not None else 0
        report["unit_params"] = [u.num_params for u in ours.units]
    return report


STAGE_OF = {"zero1": 1, "zero2": 2, "fsdp2": 3, "fsdp1": 3}
BUCKETS_PER_MODEL = 64  # ZeRO-2's transient bucket is then ~1/64 of the gradients, as 25 MB buckets are of a large model


def formula_bytes(kind: str, num_params: int, world_size: int, dtype: str,
                  unit_params: list[int] | None = None, root_params: int = 0, prefetch: bool = True) -> dict[str, float]:
    """What :mod:`labkit.zero.memory` says rank 0 of ``kind`` holds (FSDP's peak with its units)."""
    precision = FP32_ADAMW if dtype == "float32" else MIXED_ADAMW
    if STAGE_OF[kind] == 3:
        return fsdp_bytes_per_rank(unit_params, world_size, precision, root_params=root_params, prefetch=prefetch)
    return state_bytes_per_rank(num_params, world_size, STAGE_OF[kind], precision)


def simulated_rank_memory(config: dict, world_size: int, kind: str, dtype: str = "float32",
                          device: str = "cpu", batch: int = 1, seq: int = 32, steps: int = 2,
                          prefetch: bool = True) -> dict:
    """Rank 0 of ``world_size`` on a fake process group: the bytes it holds, measured.

    Runs ``steps`` training steps (the first creates the optimizer state) and returns the
    peak bytes held by kind (:class:`~labkit.zero.accounting.MemoryMeter`, over the last
    step) and, on CUDA, the allocator's peak over the last step, less what was allocated
    before the model was built.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device == "cuda":  # what earlier runs left (hooks make reference cycles) must not count as ours
        gc.collect()
        torch.cuda.empty_cache()
        already = torch.cuda.memory_allocated()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = Decoder(DecoderConfig(**config), dtype=getattr(torch, dtype), device=device)
        num_params = sum(p.numel() for p in trainable_parameters(model))
        model_mib = num_params * model.embed.weight.element_size() / 2**20
        ours = wrap_ours(model, kind, Communicator("torch"), bucket_cap_mb=model_mib / BUCKETS_PER_MODEL,
                         prefetch=prefetch)
        ids = torch.randint(config["vocab_size"], (batch, seq + 1), device=device)
        for step in range(steps):
            if step == steps - 1:
                ours.meter.reset()
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
            lm_loss(ours, ids).backward()
            ours.step()
            ours.zero_grad()
        allocator_peak = torch.cuda.max_memory_allocated() - already if device == "cuda" else None
        result = {"kind": kind, "world_size": world_size, "dtype": dtype, "num_params": num_params,
                  "held_peak": dict(ours.meter.peak), "peak_at": ours.meter.peak_at,
                  "allocator_peak": allocator_peak}
        units = ours.units if isinstance(ours, FullyShard) else None
        root = ours.root.num_params if isinstance(ours, FullyShard) and ours.root is not None else 0
        result["formula"] = formula_bytes(kind, num_params, world_size, dtype,
                                          [u.num_params for u in units] if units else None, root, prefetch)
        return result
    finally:
        dist.destroy_process_group()
        gc.collect()
