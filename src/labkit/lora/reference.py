"""The LoRA family in plain torch: the definitions every kernel and layer is checked against.

A frozen linear layer ``y = x W^T`` (``W`` ``[N, K]``, nn.Linear's layout) gets a trainable
low-rank update ``Delta W = s * B A`` with ``A`` ``[r, K]``, ``B`` ``[N, r]`` and the scale
``s = alpha / r`` (LoRA) or ``alpha / sqrt(r)`` (rsLoRA):

    y = x W^T + s * (x A^T) B^T.

The update is applied as two thin matmuls, never as the ``[N, K]`` matrix ``B A``: that is
``2 r (N + K)`` multiply-adds a token instead of ``2 N K``. Merging folds it into the weight
(``W' = W + s B A``), after which the layer costs what the base layer did; unmerging
subtracts it again.

DoRA (Liu et al., 2024) splits the adapted weight into a magnitude per output row and a
direction: ``W' = m * (W + s B A) / ||W + s B A||_row``, with ``m`` initialised to the base
weight's row norms and trained. As in the paper (section 4.3) and in peft, the row norm
is treated as a constant in the backward pass, which saves memory and barely changes the
gradient.

Multi-LoRA (Punica's BGMV): a batch of tokens, token ``b`` with its own adapter
``idx[b]``, adds ``s[idx[b]] * B[idx[b]] (A[idx[b]] x_b)`` to its row of the output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def lora_scaling(alpha: float, rank: int, rslora: bool = False) -> float:
    """``alpha / r`` (LoRA), or ``alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + s (x A^T) B^T (+ bias)``: the unfused LoRA forward, as peft computes it."""
    return F.linear(x, weight, bias) + scaling * F.linear(F.linear(x, lora_a), lora_b)


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + s B A``, computed in fp32 and rounded once to ``W``'s dtype."""
    return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def unmerge(merged: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W' - s B A``: the base weight back (exactly, up to one rounding in ``W``'s dtype)."""
    return (merged.float() - scaling * (lora_b.float() @ lora_a.float())).to(merged.dtype)


def dora_weight_norm(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """``||W + s B A||`` per output row ``[N]`` (fp32)."""
    return torch.linalg.vector_norm(weight.float() + scaling * (lora_b.float() @ lora_a.float()), dim=1)


def dora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                magnitude: torch.Tensor, scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """DoRA's forward: ``(m / ||W + s B A||) * (x W^T + s (x A^T) B^T) (+ bias)``, the norm detached."""
    norm = dora_weight_norm(weight, lora_a.detach(), lora_b.detach(), scaling).detach()
    row_scale = (magnitude.float() / norm).to(x.dtype)
    out = row_scale * (F.linear(x, weight) + scaling * F.linear(F.linear(x, lora_a), lora_b))
    return out if bias is None else out + bias


def dora_merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, magnitude: torch.Tensor,
               scaling: float) -> torch.Tensor:
    """``m * (W + s B A) / ||W + s B A||_row``: the weight a merged DoRA layer multiplies by."""
    adapted = weight.float() + scaling * (lora_b.float() @ lora_a.float())
    norm = torch.linalg.vector_norm(adapted, dim=1, keepdim=True)
    return (magnitude.float()[:, None] * adapted / norm).to(weight.dtype)


def pissa_init(weight: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PiSSA (Meng et al., 2024): ``(A, B, W_res)`` from the top ``rank`` singular triplets of ``W``.

    With ``W = U S V^T``: ``B = U_r sqrt(S_r / s)``, ``A = sqrt(S_r / s) V_r^T`` so that
    ``s B A`` is ``W``'s best rank-``r`` approximation, and the frozen residual is
    ``W_res = W - s B A``. The layer starts out computing exactly ``W``; training moves the
    principal directions instead of a zero-initialised ``B``. fp32 SVD, as peft does.
    """
    u, s_vals, vh = torch.linalg.svd(weight.float(), full_matrices=False)
    root = torch.sqrt(s_vals[:rank] / scaling)
    lora_a = root[:, None] * vh[:rank]
    lora_b = u[:, :rank] * root[None, :]
    residual = weight.float() - scaling * lora_b @ lora_a
    return lora_a.to(weight.dtype), lora_b.to(weight.dtype), residual.to(weight.dtype)


def bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         indices: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """``y[b] + s[i] B[i] A[i] x[b]`` with ``i = indices[b]``, in float64; ``indices[b] < 0``: no adapter.

    ``x`` ``[T, K]``, ``y`` ``[T, N]``, ``lora_a`` ``[L, r, K]``, ``lora_b`` ``[L, N, r]``,
    ``scalings`` ``[L]``. Gathering each token's adapter is the whole definition; a kernel
    must not build the ``[T, r, K]`` gather it implies.
    """
    safe = indices.clamp(min=0).long()
    a, b = lora_a.double()[safe], lora_b.double()[safe]
    shrunk = torch.einsum("trk,tk->tr", a, x.double())
    delta = torch.einsum("tnr,tr->tn", b, shrunk) * scalings.double()[safe][:, None]
    return y.double() + delta * (indices >= 0).double()[:, None]


def lora_loop(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              indices: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """The same as :func:`bgmv`, computed the way peft's mixed-batch forward does: one pass
    per adapter present in the batch, over the rows that use it (a new tensor; ``y`` unchanged)."""
    out = y.clone()
    for adapter in indices.unique().tolist():
        if adapter < 0:
            continue
        rows = (indices == adapter).nonzero().squeeze(1)
        delta = F.linear(F.linear(x[rows], lora_a[adapter]), lora_b[adapter]) * scalings[adapter]
        out[rows] += delta.to(out.dtype)
    return out
