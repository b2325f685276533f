"""Alignment without RL: DPO, IPO, ORPO, KTO and SimPO as memory-frugal chunked losses,
a preference dataset made from a verifiable task, and runs that compare them.

``losses`` holds each method's formula on sequence log-probs; ``chunked`` applies them
through the LM head a chunk of sequences at a time (forward and backward fused per chunk,
as Liger-Kernel's ``chunked_loss`` does); ``reference`` the oracles (a float64 full-batch
version and Liger-Kernel itself); ``data`` the preference pairs; ``runs`` the training
runs. :func:`preference_loss` is the function to call: it checks its arguments.
"""

from __future__ import annotations

import torch

from ..validate import check_choice, check_positive_int, check_tensor
from . import chunked
from .chunked import DEFAULT_BETA, IGNORE_INDEX
from .losses import METHODS, USES_REFERENCE, implicit_rewards

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def preference_loss(method: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                    desirable: torch.Tensor | None = None, kl: float | torch.Tensor = 0.0,
                    beta: float | None = None, gamma: float = 0.5, chunk_size: int = 1,
                    fuse_backward: bool = True, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean ``method`` loss (one of :data:`METHODS`) of a batch, computed through the LM
    head ``weight`` ``[V, H]`` a chunk at a time, so the ``[rows, T, V]`` logits never exist.

    ``hidden`` ``[rows, T, H]`` are the policy's final hidden states; ``targets`` ``[rows, T]``
    the token each position predicts, ``ignore_index`` where nothing is scored. Paired methods
    take ``2B`` rows, the ``B`` chosen completions first, then the ``B`` rejected ones in the
    same prompt order. KTO takes any rows and ``desirable`` ``[rows]`` (bool), with ``kl`` its
    reference point. DPO, IPO and KTO need the frozen reference's ``ref_hidden`` and
    ``ref_weight``. ``beta`` defaults to :data:`DEFAULT_BETA`; ``gamma`` is SimPO's margin.
    """
    check_choice(method, "method", METHODS)
    check_tensor(hidden, "hidden", ndim=3, dtypes=FLOATS)
    check_tensor(weight, "weight", ndim=2, dtypes=FLOATS)
    check_tensor(targets, "targets", ndim=2, dtypes=[torch.int64])
    rows, length, width = hidden.shape
    if weight.shape[1] != width:
        raise ValueError(f"weight must be [vocab, {width}] for hidden of width {width}, got {tuple(weight.shape)}")
    if targets.shape != (rows, length):
        raise ValueError(f"targets must be [{rows}, {length}] like hidden's first two dims, got {tuple(targets.shape)}")
    scored = targets != ignore_index
    if ((targets[scored] < 0) | (targets[scored] >= weight.shape[0])).any():
        raise ValueError(f"targets must be token ids in [0, {weight.shape[0]}) or ignore_index {ignore_index}")
    if not scored.any(dim=1).all():
        raise ValueError("every row needs at least one scored target (a completion token)")
    check_positive_int(chunk_size, "chunk_size")
    if beta is not None and not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta must be a positive number, got {beta!r}")
    if USES_REFERENCE[method]:
        if ref_hidden is None or ref_weight is None:
            raise ValueError(f"{method} compares with a frozen reference model: pass ref_hidden and ref_weight")
        check_tensor(ref_hidden, "ref_hidden", ndim=3, dtypes=FLOATS)
        check_tensor(ref_weight, "ref_weight", ndim=2, dtypes=FLOATS)
        if ref_hidden.shape[:2] != hidden.shape[:2] or ref_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"ref_hidden {tuple(ref_hidden.shape)} / ref_weight {tuple(ref_weight.shape)} must "
                             f"match hidden's rows and length {tuple(hidden.shape[:2])} and the vocab {weight.shape[0]}")
        if ref_hidden.requires_grad or ref_weight.requires_grad:
            raise ValueError("the reference model is frozen: pass ref_hidden and ref_weight detached")
    elif ref_hidden is not None or ref_weight is not None:
        raise ValueError(f"{method} uses no reference model; ref_hidden/ref_weight were given")
    if method == "kto":
        check_tensor(desirable, "desirable", ndim=1, dtypes=[torch.bool])
        if len(desirable) != rows:
            raise ValueError(f"desirable must hold one label per row ({rows}), got {len(desirable)}")
        if isinstance(kl, torch.Tensor) and kl.requires_grad:
            raise ValueError("KTO's reference point kl carries no gradient: pass it detached")
    else:
        if desirable is not None:
            raise ValueError(f"desirable labels are KTO's; {method} takes chosen/rejected pairs")
        if rows % 2:
            raise ValueError(f"{method} takes 2B rows (B chosen, then B rejected), got {rows}")
    return chunked.chunked_preference_loss(method, hidden, weight, targets, ref_hidden=ref_hidden,
                                           ref_weight=ref_weight, desirable=desirable, kl=kl, beta=beta,
                                           gamma=gamma, chunk_size=chunk_size, fuse_backward=fuse_backward,
                                           ignore_index=ignore_index)


__all__ = ["DEFAULT_BETA", "IGNORE_INDEX", "METHODS", "USES_REFERENCE", "implicit_rewards", "preference_loss"]
