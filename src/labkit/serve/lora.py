"""Multi-LoRA serving: one base model, many adapters, each request of a batch with its own.

Merging an adapter into the weights serves one adapter at a time. A multi-tenant engine
keeps the base weights shared and adds each token's own low-rank update after every adapted
layer, as Punica, S-LoRA and vLLM do (see the LoRA chapter, and vLLM's ``LoRAModelManager``):

- :class:`AdapterSlots` replaces each target linear of the model by a
  :class:`MultiLoRALinear` holding stacked ``A`` ``[slots, r, K]`` and ``B`` ``[slots, N, r]``
  buffers, one slot per loaded adapter; loading an adapter copies its weights into a free
  slot (smaller ranks are padded with zeros, which add nothing). The buffers never move, so
  a captured CUDA graph stays valid whichever adapters are loaded.
- Before each forward the model runner sets :attr:`AdapterSlots.step` (a :class:`LoRAStep`):
  each token's slot (``-1``: the base model alone) and, for a step with a prefill, the
  sequences' rows. Every adapted layer then computes its base output for the whole batch
  and adds the adapters' part with one shrink and one expand: BGMV per token for decode
  steps, SGMV per sequence otherwise (:mod:`labkit.lora.kernels`).

Adapters come from a model adapted with :func:`labkit.lora.add_lora` (plain LoRA or rsLoRA:
DoRA's magnitude, PiSSA's altered base and QLoRA's quantized base change the base layer,
which the requests share).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..lora import kernels as lora_kernels
from ..lora.layers import lora_layers
from ..validate import check_positive_int

TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


@dataclass
class LoRAStep:
    """What the adapted layers read during one forward pass of ``N`` packed tokens."""

    token_slots: torch.Tensor             # [N] int32: each token's adapter slot, -1 for none
    seg_starts: torch.Tensor | None = None  # [B + 1] int32: where each sequence's rows start (SGMV), or
    seg_slots: torch.Tensor | None = None   # [B] int32: each sequence's slot;  None: per token (BGMV)
    max_segment: int = 1                  # the most rows of one sequence (on the host: it sizes SGMV's grid)


def adapter_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{layer name: (A [r, K], B [N, r], scale)}`` of a model adapted with
    :func:`labkit.lora.add_lora`: what :meth:`AdapterSlots.load` takes."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA layers: adapt it with labkit.lora.add_lora first")
    for name, layer in layers.items():
        if layer.dora or layer.init == "pissa" or layer.quantize is not None:
            kind = "DoRA" if layer.dora else "PiSSA" if layer.init == "pissa" else "QLoRA"
            raise ValueError(f"layer {name} is a {kind} layer: its base differs from the shared base model; "
                             f"serve plain LoRA or rsLoRA")
        if layer.merged:
            raise ValueError(f"layer {name} has its adapter merged into its weight: unmerge it first")
    return {name: (layer.lora_A.detach(), layer.lora_B.detach(), layer.scaling) for name, layer in layers.items()}


class MultiLoRALinear(nn.Module):
    """A base linear layer plus, per token, the adapter of its request (see the module docstring)."""

    def __init__(self, base: nn.Linear, slots: AdapterSlots) -> None:
        super().__init__()
        if type(base) is not nn.Linear or base.bias is not None:
            raise TypeError(f"only a bias-free nn.Linear takes adapters here, got {base!r}")
        self.base = base
        self.slots = slots
        w = base.weight
        out_features, in_features = w.shape
        self.register_buffer("lora_a", torch.zeros(slots.max_loras, slots.max_rank, in_features, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots.max_loras, out_features, slots.max_rank, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.register_buffer("scalings", torch.zeros(slots.max_loras, dtype=torch.float32, device=w.device),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.slots.step
        if step is None:
            return y
        rows = y.reshape(-1, y.shape[-1])  # a view: the kernels add to y in place
        tokens = x.reshape(-1, x.shape[-1])
        if step.seg_starts is None:
            lora_kernels.bgmv(rows, tokens, self.lora_a, self.lora_b, step.token_slots, self.scalings)
        else:
            lora_kernels.sgmv(rows, tokens, self.lora_a, self.lora_b, step.seg_starts, step.seg_slots,
                              self.scalings, step.max_segment)
        return y


class AdapterSlots:
    """``max_loras`` adapter slots of rank up to ``max_rank`` over the ``targets`` linears of
    ``model`` (replaced, in place, by :class:`MultiLoRALinear` layers that share this object)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, targets: tuple[str, ...] = TARGETS) -> None:
        self.max_loras = check_positive_int(max_loras, "max_loras")
        self.max_rank = check_positive_int(max_rank, "max_rank")
        self.layers: dict[str, MultiLoRALinear] = {}
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if name in targets and type(child) is nn.Linear:
                    layer = MultiLoRALinear(child, self)
                    setattr(parent, name, layer)
                    self.layers[f"{parent_name}.{name}" if parent_name else name] = layer
        if not self.layers:
            raise ValueError(f"no nn.Linear named one of {targets} in {type(model).__name__}")
        self.slot_of: dict[str, int] = {}
        self.step: LoRAStep | None = None  # set by the model runner around each forward

    def load(self, name: str, weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> int:
        """Copy adapter ``name``'s weights (as :func:`adapter_weights` gives them) into a free slot;
        its slot. Layers the adapter does not cover get nothing added for its requests."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter needs a non-empty name, got {name!r}")
        if name in self.slot_of:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        unknown = sorted(set(weights) - set(self.layers))
        if unknown:
            raise ValueError(f"adapter {name!r} has layers this engine does not adapt: {unknown[:3]}")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"all {self.max_loras} adapter slots are in use (max_loras): remove one first")
        for layer_name, (lora_a, lora_b, scale) in weights.items():
            layer = self.layers[layer_name]
            rank = lora_a.shape[0]
            if rank > self.max_rank:
                raise ValueError(f"adapter {name!r} has rank {rank} at {layer_name}, "
                                 f"above max_lora_rank {self.max_rank}")
            if lora_a.shape[1:] != layer.lora_a.shape[2:] or lora_b.shape != (layer.lora_b.shape[1], rank):
                raise ValueError(f"adapter {name!r} at {layer_name}: A {tuple(lora_a.shape)} and B "
                                 f"{tuple(lora_b.shape)} do not fit the layer's {tuple(layer.base.weight.shape)}")
        slot = free[0]
        for layer_name, layer in self.layers.items():
            with torch.no_grad():
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
                layer.scalings[slot] = 0.0
                if layer_name in weights:
                    lora_a, lora_b, scale = weights[layer_name]
                    rank = lora_a.shape[0]
                    layer.lora_a[slot, :rank].copy_(lora_a)
                    layer.lora_b[slot, :, :rank].copy_(lora_b)
                    layer.scalings[slot] = float(scale)
        self.slot_of[name] = slot
        return slot

    def remove(self, name: str) -> None:
        """Free adapter ``name``'s slot (its weights stay until another adapter overwrites them)."""
        if name not in self.slot_of:
            raise KeyError(f"no adapter named {name!r} is loaded")
        del self.slot_of[name]


__all__ = ["AdapterSlots", "LoRAStep", "MultiLoRALinear", "TARGETS", "adapter_weights"]
