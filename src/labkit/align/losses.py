"""Preference losses written on per-sequence log-probabilities, one formula per method.

Every method here scores a completion ``y`` of a prompt ``x`` by a sequence log-probability
``log pi(y|x)`` (a sum over the completion's tokens, or their mean where the method says so)
and turns scores into a loss. What differs is the *implicit reward* each one pushes apart:

- DPO, IPO and KTO: ``beta * (log pi(y|x) - log pi_ref(y|x))``, the reward for which the
  KL-constrained optimum is ``pi`` (so a frozen reference model is needed);
- ORPO: the log-odds of the mean token probability, no reference;
- SimPO: ``beta`` times the mean token log-probability, no reference.

These functions return the mean loss over pairs (over examples for KTO). They are the
formulas :mod:`labkit.align.chunked` applies chunk by chunk, so that the full vocabulary
logits of a batch are never alive at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("dpo", "ipo", "orpo", "kto", "simpo")
USES_REFERENCE = {"dpo": True, "ipo": True, "orpo": False, "kto": True, "simpo": False}
AVERAGES_TOKENS = {"dpo": False, "ipo": True, "orpo": True, "kto": False, "simpo": True}


def dpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """``-log sigmoid(beta * ((c - c_ref) - (r - r_ref)))`` per pair: the Bradley-Terry
    likelihood of the preference under DPO's implicit reward."""
    return -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


def ipo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """``(h - 1/(2 beta))^2`` with ``h`` the difference of log-ratios, here of mean token
    log-probs (Liger-Kernel's DPO declines ``ipo`` because it would need each sequence's
    token count to length-normalise): a squared loss that stops at a finite margin instead
    of pushing ``h`` to infinity as DPO's log-sigmoid does on deterministic preferences."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    return (h - 1 / (2 * beta)) ** 2


def orpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """``-beta * log sigmoid(log odds(c) - log odds(r))`` per pair, with ``odds = p/(1-p)`` and
    ``log p`` the mean token log-prob. ORPO adds the chosen completions' NLL (SFT) term."""
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return -beta * F.logsigmoid(log_odds)


def simpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """``-log sigmoid(beta * (c - r) - gamma)`` per pair, ``c, r`` mean token log-probs: the
    length-normalised policy itself is the reward, and ``gamma`` a target margin."""
    return -F.logsigmoid(beta * (chosen - rejected) - gamma)


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float,
               beta: float) -> torch.Tensor:
    """``1 - sigmoid(beta * (r - z))`` for a desirable example, ``1 - sigmoid(beta * (z - r))``
    for an undesirable one, with ``r`` the log-ratio and ``z`` the reference point: an
    estimate of KL(pi || pi_ref) that carries no gradient."""
    sign = torch.where(desirable, 1.0, -1.0).to(logps.dtype)
    return 1 - torch.sigmoid(beta * ((logps - ref_logps) - kl) * sign)


def implicit_rewards(method: str, logps: torch.Tensor, ref_logps: torch.Tensor | None, beta: float) -> torch.Tensor:
    """The reward each method ranks completions by (higher = preferred).

    ``logps`` are sums over tokens for DPO and KTO, means for IPO, ORPO and SimPO (see
    :data:`AVERAGES_TOKENS`). ORPO's log-odds is a monotone function of the mean log-prob,
    so it ranks like SimPO's reward; both are given in their own units.
    """
    if method in ("dpo", "ipo", "kto"):
        if ref_logps is None:
            raise ValueError(f"{method} rewards are log-ratios against the reference: pass ref_logps")
        return beta * (logps - ref_logps)
    if method == "orpo":
        return logps - torch.log1p(-torch.exp(logps))
    if method == "simpo":
        return beta * logps
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
