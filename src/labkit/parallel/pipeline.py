"""Pipeline parallelism: the book's decoder cut into stages, run by any schedule on real processes.

:class:`PipelineStage` is a contiguous slice of a :class:`~labkit.models.Decoder`'s layers
(the first stage also embeds, the last also applies the final norm and the LM head).
:func:`run_schedule` executes one rank's list of :class:`~labkit.parallel.schedules.Action`
on its stages: a forward receives the previous virtual stage's activation, runs, and sends
its output on; a backward receives the gradient of that output, runs autograd, and sends
the gradient of its input back. Sends are asynchronous (``isend``), receives block, and
every message is tagged with its micro-batch, virtual stage and direction, so any schedule
that :func:`~labkit.parallel.schedules.simulate` can run without deadlock runs here too.

The loss is the mean over every micro-batch's tokens, so the accumulated gradient is the
gradient of the whole batch: the check against one process is exact up to rounding.
A tied embedding lives on the first and the last stage; :func:`sync_tied_embedding` sums
its two gradients, as Megatron's embedding group does.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models import Decoder, masked_cross_entropy_sum
from . import comm
from .schedules import Action


class PipelineStage(nn.Module):
    """Virtual stage ``stage`` of ``num_stages``: layers ``[stage*L/S, (stage+1)*L/S)`` of ``model``."""

    def __init__(self, model: Decoder, stage: int, num_stages: int) -> None:
        super().__init__()
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit.models.Decoder, got {type(model).__name__}")
        layers = model.config.num_layers
        if not 0 <= stage < num_stages or layers % num_stages:
            raise ValueError(f"stage {stage} of {num_stages}: the stages must split {layers} layers evenly")
        per_stage = layers // num_stages
        self.stage, self.num_stages, self.first_layer = stage, num_stages, stage * per_stage
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.tied = model.config.tie_word_embeddings
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[self.first_layer:self.first_layer + per_stage]))
        self.rope = copy.deepcopy(model.rope)
        self.embed = copy.deepcopy(model.embed) if self.is_first else None
        if self.is_last:
            self.norm = copy.deepcopy(model.norm)
            self.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    def original_name(self, name: str) -> str:
        """The name in the whole model of this stage's parameter ``name``."""
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            return f"blocks.{self.first_layer + int(index)}.{rest}"
        if name == "lm_head.weight" and self.tied:
            return "embed.weight"
        return name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states ``[b, s, h]`` -> hidden states, or logits (last stage)."""
        if self.is_first:
            x = self.embed(x)
        cos, sin = self.rope(torch.arange(x.shape[1], device=x.device), x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, None, 0, False)
        return self.lm_head(self.norm(x)) if self.is_last else x


@dataclass
class PipelineRun:
    """What one rank did: its loss share, stashed-activation peak, and each pass's wall-clock span."""

    loss: float = 0.0
    peak_in_flight: int = 0
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, mb, chunk, start, end


def _tag(microbatch: int, stage: int, kind: str, num_virtual: int) -> int:
    """A message's tag: unique per (micro-batch, receiving virtual stage, direction)."""
    return (microbatch * num_virtual + stage) * 2 + (kind == "B")


def run_schedule(stages: dict[int, PipelineStage], actions: list[Action], microbatches: list[torch.Tensor],
                 num_ranks: int) -> PipelineRun:
    """Run this rank's ``actions`` on its ``stages`` (chunk -> stage) over ``microbatches`` of ids ``[b, s+1]``.

    The pipeline is the default process group's ranks ``0 .. num_ranks - 1``.
    """
    if num_ranks < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {num_ranks}")
    if not stages or not all(isinstance(m, PipelineStage) for m in stages.values()):
        raise TypeError("stages must map each chunk index to its PipelineStage")
    if {a.chunk for a in actions} - set(stages):
        raise ValueError(f"the actions use chunks {sorted({a.chunk for a in actions})}, this rank holds {sorted(stages)}")
    if not microbatches or len({tuple(ids.shape) for ids in microbatches}) != 1:
        raise ValueError("microbatches must be a non-empty list of token-id tensors of one shape [b, s+1]")
    rank = dist.get_rank()
    num_virtual = next(iter(stages.values())).num_stages
    batch, length = microbatches[0].shape[0], microbatches[0].shape[1] - 1
    hidden = next(iter(stages.values())).blocks[0].attn.wq.in_features
    total_tokens = sum(ids[:, 1:].numel() for ids in microbatches)
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    pending_sends, result = [], PipelineRun()
    start = time.perf_counter()

    def send(t: torch.Tensor, to_stage: int, microbatch: int, kind: str) -> None:
        t = t.detach().contiguous()
        comm.send_bytes(t)
        pending_sends.append((t, dist.isend(t, to_stage % num_ranks, tag=_tag(microbatch, to_stage, kind, num_virtual))))

    def receive(from_stage: int, my_stage: int, microbatch: int, kind: str) -> torch.Tensor:
        buffer = torch.empty(batch, length, hidden)
        dist.recv(buffer, from_stage % num_ranks, tag=_tag(microbatch, my_stage, kind, num_virtual))
        return buffer

    for action in actions:
        module = stages[action.chunk]
        s, mb = module.stage, action.microbatch
        began = time.perf_counter() - start
        if action.kind == "F":
            ids = microbatches[mb]
            inp = ids[:, :-1] if module.is_first else receive(s - 1, s, mb, "F").requires_grad_()
            out = module(inp)
            if module.is_last:
                targets = ids[:, 1:]
                out = masked_cross_entropy_sum(out, targets, torch.ones_like(targets, dtype=torch.bool)) / total_tokens
                result.loss += out.item()
            else:
                send(out, s + 1, mb, "F")
            stash[(mb, action.chunk)] = (inp, out)
            result.peak_in_flight = max(result.peak_in_flight, len(stash))
        else:
            inp, out = stash.pop((mb, action.chunk))
            grad = None if module.is_last else receive(s + 1, s, mb, "B")
            torch.autograd.backward(out, grad)
            if not module.is_first:
                send(inp.grad, s - 1, mb, "B")
        result.events.append((action.kind, mb, action.chunk, began, time.perf_counter() - start))
    for _, work in pending_sends:
        work.wait()
    return result


def sync_tied_embedding(stages: dict[int, PipelineStage], num_ranks: int, tie_group: dist.ProcessGroup | None) -> None:
    """Sum the tied embedding's gradients of the first and the last stage (ranks 0 and ``p - 1``).

    ``tie_group`` is ``dist.new_group([0, p - 1])``, made by every rank (group creation is
    collective); ranks that hold neither end pass through.
    """
    for module in stages.values():
        if not module.tied:
            continue
        weight = module.embed.weight if module.is_first else module.lm_head.weight if module.is_last else None
        if weight is not None and weight.grad is not None:
            comm.all_reduce(weight.grad, tie_group)
