"""LoRA as a module: one class for LoRA, rsLoRA, DoRA, PiSSA and QLoRA, and the model surgery.

>>> layer = LoRALinear.from_linear(nn.Linear(1024, 1024), rank=16, alpha=32, dora=True)
>>> model = add_lora(decoder, rank=8, alpha=16, variant="qlora")   # base frozen, adapters trainable
>>> merge_all(model); ...; unmerge_all(model)

The variants differ in three independent places, which is how the papers define them:

- the *scale*: ``alpha / r`` (LoRA) or ``alpha / sqrt(r)`` (rsLoRA), so that the update's
  size does not shrink as the rank grows;
- the *initialisation*: ``A`` random (Kaiming-uniform as in peft, or Gaussian) and
  ``B = 0``, so that training starts from the base model exactly; or PiSSA's principal
  singular vectors, with their part removed from the frozen weight;
- the *parametrisation*: plain ``W + s B A``; DoRA's magnitude times direction; QLoRA's
  frozen base stored in NF4 (:mod:`labkit.quant.nf4`) and dequantized at each forward.

Names follow peft's (``lora_A``, ``lora_B``, ``magnitude``) so that weights copy across.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import nf4
from ..validate import check_choice, check_positive_int
from . import reference

INITS = ("kaiming", "gaussian", "pissa")
QUANTIZE = (None, "nf4")
# The variants the chapter compares, as the options that make each one.
VARIANTS: dict[str, dict] = {
    "lora": {},
    "rslora": {"rslora": True},
    "dora": {"dora": True},
    "pissa": {"init": "pissa"},
    "qlora": {"quantize": "nf4"},
}


class LoRALinear(nn.Module):
    """A frozen linear layer ``W`` ``[N, K]`` plus a trainable rank-``rank`` update.

    ``fused=True`` runs plain LoRA (not DoRA) through :func:`labkit.lora.lora_linear`'s
    Triton kernel; otherwise the layer computes :mod:`labkit.lora.reference`'s formulas.
    A QLoRA layer's NF4 weight is a plain attribute, not a buffer: ``.to()`` does not move
    it and the state dict holds only the adapters, so build the layer where it will run.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rank: int, alpha: float,
                 init: str = "kaiming", rslora: bool = False, dora: bool = False, quantize: str | None = None,
                 fused: bool = False, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(f"weight must be a 2-D tensor [N, K], got {got}")
        check_positive_int(rank, "rank")
        n, k = weight.shape
        if rank > min(n, k):
            raise ValueError(f"rank {rank} exceeds min(N, K) = {min(n, k)} of the {n}x{k} weight: "
                             "it would not be low-rank")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        check_choice(init, "init", INITS)
        check_choice(quantize, "quantize", QUANTIZE)
        for name, flag in (("rslora", rslora), ("dora", dora), ("fused", fused)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.rank, self.alpha, self.init = rank, alpha, init
        self.rslora, self.dora, self.quantize = rslora, dora, quantize
        self.fused = fused
        self.scaling = reference.lora_scaling(alpha, rank, rslora)
        factory = dict(dtype=weight.dtype, device=weight.device)
        base = weight.detach()
        if init == "pissa":
            lora_a, lora_b, base = reference.pissa_init(base, rank, self.scaling)
        else:
            gen = torch.Generator(device=weight.device).manual_seed(seed)
            lora_a = torch.empty(rank, k, **factory)
            if init == "kaiming":  # peft's default: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(K), 1/sqrt(K))
                nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=gen)
            else:
                nn.init.normal_(lora_a, std=1 / rank, generator=gen)
            lora_b = torch.zeros(n, rank, **factory)
        self.lora_A = nn.Parameter(lora_a)
        self.lora_B = nn.Parameter(lora_b)
        self.nf4_weight = nf4.quantize_nf4(base) if quantize == "nf4" else None
        self.weight = nn.Parameter(base.clone(), requires_grad=False) if quantize is None else None
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        if dora:
            # DoRA starts at m = ||W + s B A||_row, so the layer starts out as the base layer
            # (for PiSSA's init that is the original W's norm, since W_res + s B A = W).
            self.magnitude = nn.Parameter(reference.dora_weight_norm(self.base_weight(), lora_a, lora_b,
                                                                     self.scaling).to(weight.dtype))
        self.merged = False
        self._merged_norm: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "LoRALinear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias, **kwargs)

    @property
    def in_features(self) -> int:
        return self.lora_A.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_B.shape[0]

    def base_weight(self) -> torch.Tensor:
        """The frozen weight the layer adds to: stored, or dequantized from NF4 in the adapters' dtype."""
        if self.nf4_weight is not None:
            return nf4.dequantize_nf4(self.nf4_weight, self.lora_A.dtype)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return F.linear(x, self.weight, self.bias)
        weight = self.base_weight()
        if self.dora:
            return reference.dora_linear(x, weight, self.lora_A, self.lora_B, self.magnitude, self.scaling, self.bias)
        if self.fused:
            from . import lora_linear  # the checked entry point (the package imports this module)
            return lora_linear(x.contiguous(), weight, self.lora_A, self.lora_B, self.scaling, self.bias)
        return reference.lora_linear(x, weight, self.lora_A, self.lora_B, self.scaling, self.bias)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the weight: afterwards a forward is one plain matmul."""
        if self.merged:
            raise RuntimeError("the adapter is already merged")
        if self.nf4_weight is not None:
            raise RuntimeError("a QLoRA layer cannot merge into its NF4 base without re-quantizing it "
                               "(which would not be the trained model); merge into a dequantized copy instead")
        if self.dora:
            self._merged_norm = reference.dora_weight_norm(self.weight, self.lora_A, self.lora_B, self.scaling)
            self.weight.copy_(reference.dora_merge(self.weight, self.lora_A, self.lora_B, self.magnitude, self.scaling))
        else:
            self.weight.copy_(reference.merge(self.weight, self.lora_A, self.lora_B, self.scaling))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update out of the weight again (to train on, or to switch adapters)."""
        if not self.merged:
            raise RuntimeError("the adapter is not merged")
        if self.dora:
            # W' = m (W + s B A) / norm per row, so W = W' norm / m - s B A, with the norm kept at merge time.
            rescaled = self.weight.float() * (self._merged_norm / self.magnitude.float())[:, None]
            self.weight.copy_(reference.unmerge(rescaled, self.lora_A, self.lora_B, self.scaling).to(self.weight.dtype))
            self._merged_norm = None
        else:
            self.weight.copy_(reference.unmerge(self.weight, self.lora_A, self.lora_B, self.scaling))
        self.merged = False

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, rank={self.rank}, alpha={self.alpha}, init={self.init}, "
                f"rslora={self.rslora}, dora={self.dora}, quantize={self.quantize}, merged={self.merged}")


def _linear_children(model: nn.Module, targets: tuple[str, ...] | None):
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and (targets is None or name in targets):
                yield f"{parent_name}.{name}" if parent_name else name, parent, name, child


def add_lora(model: nn.Module, rank: int, alpha: float, *, variant: str = "lora",
             targets: tuple[str, ...] | None = ("wq", "wk", "wv", "wo", "gate", "up", "down"),
             fused: bool = False, seed: int = 0) -> nn.Module:
    """Freeze ``model`` and replace its linear layers named in ``targets`` (``None``: every
    one) by :class:`LoRALinear` of ``variant`` (a key of :data:`VARIANTS`), in place.

    The defaults target the book's decoder blocks (attention and MLP), not the LM head,
    as the LoRA and QLoRA papers do. Each layer's ``A`` gets its own seed.
    """
    check_choice(variant, "variant", tuple(VARIANTS))
    found = list(_linear_children(model, targets))
    if not found:
        raise ValueError(f"no nn.Linear named one of {targets} in {type(model).__name__}")
    for p in model.parameters():
        p.requires_grad_(False)
    for i, (_, parent, name, child) in enumerate(found):
        setattr(parent, name, LoRALinear.from_linear(child, rank=rank, alpha=alpha, fused=fused, seed=seed + i,
                                                     **VARIANTS[variant]))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def trainable_parameters(model: nn.Module) -> int:
    """Parameters that receive gradients (each shared tensor counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def merge_all(model: nn.Module) -> None:
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_all(model: nn.Module) -> None:
    for layer in lora_layers(model).values():
        layer.unmerge()
