"""Two oracles for the chunked losses.

``full_batch_loss``: plain torch, float64, the whole batch's logits at once and each
method's formula written out again from the papers (no code shared with
:mod:`labkit.align.losses`). It is also the chapter's first, memory-hungry stage.

``liger_loss``: the same loss from Liger-Kernel's ``chunked_loss`` modules
(``LigerFusedLinear{DPO,ORPO,SimPO,KTO}Loss``), run on the CPU uncompiled. They accept
float64 inputs and return float64 gradients; their loss *value* is accumulated in a
float32 scalar, ~1e-7 relative, well inside the 1e-5 the chapter checks. Liger has no IPO
(its DPO raises ``NotImplementedError`` for ``loss_type="ipo"``), so IPO is checked
against ``full_batch_loss`` only.
"""

from __future__ import annotations

import torch


def _seq_logps(hidden, weight, targets, average, ignore_index=-100):
    logits = (hidden.double() @ weight.double().t())
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    scored = targets != ignore_index
    picked = torch.gather(logp, 2, targets.clamp(min=0).unsqueeze(2)).squeeze(2) * scored
    return picked.sum(1) / scored.sum(1) if average else picked.sum(1), picked, scored


def full_batch_loss(method, hidden, weight, targets, *, ref_hidden=None, ref_weight=None, desirable=None,
                    kl=0.0, beta, gamma=0.5):
    """The mean loss of the batch, every logit materialised, in float64."""
    average = method in ("ipo", "orpo", "simpo")
    logps, picked, scored = _seq_logps(hidden, weight, targets, average)
    if method in ("dpo", "ipo", "kto"):
        with torch.no_grad():
            ref, _, _ = _seq_logps(ref_hidden, ref_weight, targets, average)
        ratio = logps - ref
    if method == "kto":
        out = []
        for i in range(len(logps)):
            margin = ratio[i] - kl if desirable[i] else kl - ratio[i]
            out.append(1 - 1 / (1 + torch.exp(-beta * margin)))
        return sum(out) / len(out)
    b = len(logps) // 2
    out = []
    for i in range(b):
        if method == "dpo":
            z = beta * (ratio[i] - ratio[b + i])
            out.append(torch.log1p(torch.exp(-z)))  # -log sigmoid(z)
        elif method == "ipo":
            out.append((ratio[i] - ratio[b + i] - 1 / (2 * beta)) ** 2)
        elif method == "simpo":
            z = beta * (logps[i] - logps[b + i]) - gamma
            out.append(torch.log1p(torch.exp(-z)))
        elif method == "orpo":
            pc, pr = torch.exp(logps[i]), torch.exp(logps[b + i])
            z = torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr))
            out.append(beta * torch.log1p(torch.exp(-z)))
        else:
            raise ValueError(f"unknown method {method!r}")
    loss = sum(out) / b
    if method == "orpo":
        loss = loss - picked[:b].sum() / scored[:b].sum()
    return loss


def liger_loss(method, hidden, weight, targets, *, ref_hidden=None, ref_weight=None, desirable=None, kl=0.0,
               beta, gamma=0.5, chunk_size=1):
    """Liger-Kernel's chunked loss for ``method`` (not ``ipo``), uncompiled, on the inputs' device."""
    from liger_kernel.chunked_loss import (LigerFusedLinearDPOLoss, LigerFusedLinearKTOLoss,
                                           LigerFusedLinearORPOLoss, LigerFusedLinearSimPOLoss)

    common = dict(beta=beta, compiled=False, chunk_size=chunk_size)
    if method == "dpo":
        out = LigerFusedLinearDPOLoss(**common, use_ref_model=True, average_log_prob=False)(
            weight, hidden, targets, ref_input=ref_hidden, ref_weight=ref_weight)
    elif method == "orpo":
        out = LigerFusedLinearORPOLoss(**common, compute_nll_loss=True)(weight, hidden, targets)
    elif method == "simpo":
        out = LigerFusedLinearSimPOLoss(**common, gamma=gamma, compute_nll_loss=False)(weight, hidden, targets)
    elif method == "kto":
        out = LigerFusedLinearKTOLoss(**common, use_ref_model=True, average_log_prob=False)(
            hidden, weight, targets, preference_labels=desirable, ref_input=ref_hidden, ref_weight=ref_weight,
            kl=torch.as_tensor(kl, dtype=hidden.dtype))
    else:
        raise ValueError(f"Liger-Kernel has no chunked {method!r} loss; compare with full_batch_loss")
    return out[0] if isinstance(out, tuple) else out

