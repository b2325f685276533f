"""Checks of the ranks' results against one process, run in the process that launched them.

Each function takes what every rank of one program of :mod:`labkit.parallel.programs`
returned, rebuilds the single-process reference (the book's decoder from the same seed,
``lm_loss`` on the same batch, ``backward()``; full causal attention in float64), checks
every loss, gradient and output with :func:`labkit.check.assert_close` (so a wrong result
raises, saying which), and returns a summary with the largest relative errors seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import check
from ..models import Decoder, DecoderConfig, lm_loss
from . import programs
from .ring_attention import token_positions
from .schedules import in_flight, make_schedule


def reference(config: dict, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process: the loss of ``ids`` and the gradient of every parameter, by name."""
    model = Decoder(DecoderConfig(**config), seed=0, init_std=0.1)
    loss = lm_loss(model, ids)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _compare(got: torch.Tensor, want: torch.Tensor, name: str) -> float:
    check.assert_close(got, want, name=name)
    return check.rel_error(got, want)


def tensor_parallel(per_rank: list[dict], config: dict, rows: int, seq: int) -> dict:
    """Every rank's loss, and each gradient (shards concatenated along their cut), against one process."""
    loss, grads = reference(config, programs.batch(config["vocab_size"], rows, seq, 0))
    loss_error = max(_compare(torch.tensor(r["loss"]), loss, "loss") for r in per_rank)
    grad_error = 0.0
    if set(per_rank[0]["grads"]) != set(grads):
        raise AssertionError(f"the ranks' gradients name {sorted(per_rank[0]['grads'])}, the model {sorted(grads)}")
    for name, (dim, _) in per_rank[0]["grads"].items():
        shards = [r["grads"][name][1] for r in per_rank]
        whole = shards[0] if dim is None else torch.cat(shards, dim)
        grad_error = max(grad_error, _compare(whole, grads[name], f"grad of {name}"))
        if dim is None and not all(torch.equal(s, whole) for s in shards):
            raise AssertionError(f"replicated {name}: the ranks hold different gradients after the sync")
    return {"loss_rel_error": loss_error, "grad_rel_error": grad_error, "gradients_checked": len(grads)}


def against_torch(ours: list[dict], theirs: list[dict]) -> dict:
    """Our TP step against torch's ``parallelize_module`` (``programs.torch_tensor_parallel_step``), rank by rank.

    The losses and every sharded weight's local gradient must agree. The q/k-norm weights
    are plain tensors in torch's plan, so each rank's gradient there is its partial one:
    their sum must equal our synced gradient; ``norm_partial_rel_error`` says how far one
    rank's partial is from it (what an optimizer step would use without the sync).
    """
    loss_error = max(_compare(torch.tensor(t["loss"]), torch.tensor(o["loss"]), "loss vs torch")
                     for o, t in zip(ours, theirs))
    shard_error = partial_error = 0.0
    for name, (dim, _) in theirs[0]["grads"].items():
        if dim is None:
            total = sum(t["grads"][name][1] for t in theirs)
            shard_error = max(shard_error, _compare(total, ours[0]["grads"][name][1], f"sum of torch's {name} grads"))
            partial_error = max(partial_error, check.rel_error(theirs[0]["grads"][name][1], ours[0]["grads"][name][1]))
            continue
        for rank, (o, t) in enumerate(zip(ours, theirs)):
            shard_error = max(shard_error, _compare(o["grads"][name][1], t["grads"][name][1], f"rank {rank}'s {name} grad vs torch"))
    return {"loss_rel_error": loss_error, "grad_rel_error": shard_error, "gradients_checked": len(theirs[0]["grads"]),
            "norm_partial_rel_error": partial_error}


def against_torch_pipeline(ours: list[dict], theirs: list[dict]) -> dict:
    """Our 1F1B executor against torch's ``Schedule1F1B`` running the same stages, rank by rank."""
    loss_error = _compare(torch.tensor(sum(o["loss"] for o in ours)), torch.tensor(sum(t["loss"] for t in theirs)),
                          "loss vs torch")
    grad_error, bitwise, checked = 0.0, True, 0
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        if set(o["grads"]) != set(t["grads"]):
            raise AssertionError(f"rank {rank}: our stage has {sorted(o['grads'])}, torch's {sorted(t['grads'])}")
        for name, g in t["grads"].items():
            grad_error = max(grad_error, _compare(o["grads"][name], g, f"rank {rank}'s {name} grad vs torch"))
            bitwise &= torch.equal(o["grads"][name], g)
            checked += 1
    return {"loss_rel_error": loss_error, "grad_rel_error": grad_error, "gradients_checked": checked,
            "bitwise_equal": bitwise}


def pipeline(per_rank: list[dict], config: dict, schedule: str, microbatches: int, chunks: int, rows: int,
             seq: int) -> dict:
    """The ranks' summed loss and every stage's gradients against one process on the whole batch; the
    stashed micro-batches each rank measured against the schedule's count."""
    ids = torch.cat([programs.batch(config["vocab_size"], rows, seq, 1 + i) for i in range(microbatches)])
    loss, grads = reference(config, ids)
    loss_error = _compare(torch.tensor(sum(r["loss"] for r in per_rank)), loss, "loss")
    grad_error, checked = 0.0, set()
    for r in per_rank:
        for name, g in r["grads"].items():
            grad_error = max(grad_error, _compare(g, grads[name], f"grad of {name}"))
            checked.add(name)
    if checked != set(grads):
        raise AssertionError(f"no stage holds {sorted(set(grads) - checked)}")
    stashed = [r["peak_in_flight"] for r in per_rank]
    expected = [in_flight(a) for a in make_schedule(schedule, len(per_rank), microbatches, chunks)]
    if stashed != expected:
        raise AssertionError(f"{schedule}: ranks stashed {stashed} micro-batches at most, the schedule says {expected}")
    return {"loss_rel_error": loss_error, "grad_rel_error": grad_error, "gradients_checked": len(checked),
            "stashed": stashed}


def ring(per_rank: list[dict], rows: int, heads: int, kv_heads: int, seq: int, head_dim: int, layout: str,
         seed: int = 0) -> dict:
    """Each rank's ring-attention output against full causal attention (SDPA, float64) at its positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, seq, head_dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, seq, head_dim, generator=gen) for _ in range(2))
    full = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    error = 0.0
    for rank, r in enumerate(per_rank):
        if not torch.equal(r["positions"], token_positions(seq, rank, len(per_rank), layout)):
            raise AssertionError(f"rank {rank} holds positions {r['positions'].tolist()}")
        error = max(error, _compare(r["out"], full[:, :, r["positions"]], f"ring attention ({layout}), rank {rank}"))
    work = [r["score_elements"] for r in per_rank]
    if sum(work) != seq * (seq + 1) // 2:
        raise AssertionError(f"the ranks computed {sum(work)} query-key pairs, a causal mask has {seq * (seq + 1) // 2}")
    return {"out_rel_error": error, "score_elements": work}
