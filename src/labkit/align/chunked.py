"""Preference losses through the LM head, a chunk of sequences at a time (Liger's chunked_loss).

A preference batch holds ``2B`` sequences of ``T`` tokens; its logits are ``2B x T x V``
numbers, and autograd keeps the log-softmax of all of them for the backward pass. With a
128k vocabulary that is the largest tensor of the step. The losses here never build it:

1. the final hidden states ``[2B, T, H]`` come in instead of logits, with the LM head's
   weight ``[V, H]``;
2. the batch is cut into chunks of pairs (chunk ``c`` holds chosen rows ``i..j`` and the
   matching rejected rows ``B+i..B+j``, since a pair's loss needs both);
3. each chunk's logits, loss *and gradients* are computed inside the forward pass
   (``torch.autograd.grad`` on the chunk), added to running sums, and dropped; the
   backward pass only scales the summed gradients.

Every method's loss is a sum of per-pair (per-example for KTO) terms divided by a constant
of the whole batch, so the chunks' gradients add up to the full batch's exactly.

Row layout (as Liger's): chosen sequences first, then rejected ones. ``targets[:, t]`` is
the token that ``hidden[:, t]`` predicts, ``ignore_index`` where nothing is scored (the
prompt, padding).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import losses

IGNORE_INDEX = -100
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "orpo": 0.1, "kto": 0.1, "simpo": 2.0}

# (hidden rows, weight, row indices) -> this chunk's share of the batch loss
ChunkLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log p(target)`` ``[rows, T]`` (0 where ignored) and the mask of scored tokens.

    The log-softmax runs in float32 at least, as trainers do: bf16 log-probs are off by ~1e-2.
    """
    logits = hidden @ weight.t()
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    scored = targets != ignore_index
    logp = torch.log_softmax(logits.to(compute_dtype), dim=-1)
    picked = logp.gather(-1, torch.where(scored, targets, 0)[..., None]).squeeze(-1)
    return picked * scored, scored


def sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, average: bool,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``log pi(y|x)`` per row: the sum of its scored tokens' log-probs, or their mean."""
    picked, scored = token_logps(hidden, weight, targets, ignore_index)
    total = picked.sum(-1)
    return total / scored.sum(-1).clamp(min=1) if average else total


@torch.no_grad()
def chunked_sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, average: bool,
                           chunk_rows: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """:func:`sequence_logps` without gradients, ``chunk_rows`` rows of logits at a time
    (the reference model's pass, and evaluation)."""
    return torch.cat([sequence_logps(h, weight, t, average=average, ignore_index=ignore_index)
                      for h, t in zip(hidden.split(chunk_rows), targets.split(chunk_rows))])


class _FusedChunks(torch.autograd.Function):
    """Forward runs every chunk's forward *and* backward; backward scales the sums."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk_loss, row_chunks):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        total = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        w = weight.detach().requires_grad_(want_weight)
        for rows in row_chunks:
            h = hidden[rows].detach().requires_grad_(want_hidden)
            with torch.enable_grad():
                loss = chunk_loss(h, w, rows)
            inputs = [x for x, want in ((h, want_hidden), (w, want_weight)) if want]
            if inputs:
                grads = list(torch.autograd.grad(loss, inputs))
                if want_hidden:
                    grad_hidden.index_add_(0, rows, grads.pop(0))
                if want_weight:
                    grad_weight += grads.pop(0)
            total += loss.detach()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_total,
                None if grad_weight is None else grad_weight * grad_total, None, None)


def run_chunks(hidden: torch.Tensor, weight: torch.Tensor, chunk_loss: ChunkLoss, row_chunks: list[torch.Tensor],
               *, fuse_backward: bool) -> torch.Tensor:
    """The batch loss as the sum of ``chunk_loss`` over ``row_chunks``.

    ``fuse_backward=False`` is the plain loop: autograd keeps every chunk's log-softmax
    until backward, so chunking alone saves nothing. ``True`` computes each chunk's
    gradients on the spot and keeps only ``[2B, T, H]`` + ``[V, H]`` of gradient sums.
    """
    if fuse_backward:
        return _FusedChunks.apply(hidden, weight, chunk_loss, row_chunks)
    return sum(chunk_loss(hidden[rows], weight, rows) for rows in row_chunks)


def pair_chunks(n_pairs: int, chunk_pairs: int, device: torch.device) -> list[torch.Tensor]:
    """Row indices of each chunk: chosen rows ``i..j`` and their rejected rows ``B+i..B+j``."""
    starts = range(0, n_pairs, chunk_pairs)
    return [torch.cat([torch.arange(s, min(s + chunk_pairs, n_pairs), device=device),
                       torch.arange(n_pairs + s, n_pairs + min(s + chunk_pairs, n_pairs), device=device)])
            for s in starts]


def chunked_preference_loss(method: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                            desirable: torch.Tensor | None = None, kl: float | torch.Tensor = 0.0,
                            beta: float | None = None, gamma: float = 0.5, chunk_size: int = 1,
                            fuse_backward: bool = True, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean ``method`` loss of a batch; arguments as :func:`labkit.align.preference_loss`
    (which checks them). ``chunk_size`` counts pairs (examples for KTO) per chunk."""
    beta = DEFAULT_BETA[method] if beta is None else beta
    average = losses.AVERAGES_TOKENS[method]
    n_rows = hidden.shape[0]
    if losses.USES_REFERENCE[method]:
        ref_logps = chunked_sequence_logps(ref_hidden, ref_weight, targets, average=average,
                                           chunk_rows=2 * chunk_size, ignore_index=ignore_index)
    if method == "kto":
        row_chunks = [torch.arange(s, min(s + chunk_size, n_rows), device=hidden.device)
                      for s in range(0, n_rows, chunk_size)]
        kl = torch.as_tensor(kl, dtype=hidden.dtype, device=hidden.device)

        def chunk_loss(h, w, rows):
            logps = sequence_logps(h, w, targets[rows], average=average, ignore_index=ignore_index)
            return losses.kto_losses(logps, ref_logps[rows], desirable[rows], kl, beta).sum() / n_rows

        return run_chunks(hidden, weight, chunk_loss, row_chunks, fuse_backward=fuse_backward)

    n_pairs = n_rows // 2
    chosen_tokens = (targets[:n_pairs] != ignore_index).sum()

    def chunk_loss(h, w, rows):
        k = len(rows) // 2
        if method == "orpo":  # the SFT term needs per-token sums, not only the mean
            picked, scored = token_logps(h, w, targets[rows], ignore_index)
            logps = picked.sum(-1) / scored.sum(-1).clamp(min=1)
            nll = -picked[:k].sum() / chosen_tokens
            return nll + losses.orpo_pair_losses(logps[:k], logps[k:], beta).sum() / n_pairs
        logps = sequence_logps(h, w, targets[rows], average=average, ignore_index=ignore_index)
        if method == "simpo":
            per_pair = losses.simpo_pair_losses(logps[:k], logps[k:], beta, gamma)
        else:
            formula = losses.dpo_pair_losses if method == "dpo" else losses.ipo_pair_losses
            ref = ref_logps[rows]
            per_pair = formula(logps[:k], logps[k:], ref[:k], ref[k:], beta)
        return per_pair.sum() / n_pairs

    return run_chunks(hidden, weight, chunk_loss, pair_chunks(n_pairs, chunk_size, hidden.device),
                      fuse_backward=fuse_backward)


def autograd_saved_bytes(loss_fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd still keeps for backward once ``loss_fn()`` returns.

    What a loss costs in memory between forward and backward, measured rather than
    derived: every tensor a graph saves passes through ``saved_tensors_hooks``; those a
    fused loss saved only inside its own forward (and freed there) are dead by the end and
    not counted. Storages shared by several saved tensors count once; the inputs' own
    storages count too, alike for every variant.
    """
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in saved) if t is not None}
    del loss
    return sum(alive.values())
