"""The book's decoder with the position scheme made a part you can swap.

:class:`PositionalDecoder` is :class:`labkit.models.Decoder` without the KV cache and the
fused path: the same modules under the same names (so a ``Decoder``'s state dict loads
into it, and the same seed gives the same weights), with attention asking its
:class:`~labkit.positional.schemes.PositionScheme` where positions enter. With
:func:`~labkit.positional.schemes.rope` it *is* the book's model; the tests check the
logits. Swapping the scheme of a trained model (:meth:`PositionalDecoder.use_scheme`) is
how position interpolation, NTK-aware scaling and YaRN are applied at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import Decoder, DecoderConfig, attend
from ..models.decoder import MLP, Attention, RMSNorm
from .schemes import PositionScheme


class PositionalAttention(Attention):
    """The book's attention (its projections and q/k norms), positions left to the scheme."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, scheme: PositionScheme) -> torch.Tensor:
        batch, new, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, new, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(batch, new, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = scheme.rotate(q, k, positions)
        bias = scheme.bias(self.num_heads, positions)
        if bias is None:
            out = attend(q, k, v)  # the book model's causal attention, unchanged
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, new, -1))


class PositionalBlock(nn.Module):
    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.attn = PositionalAttention(config, **factory)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, scheme: PositionScheme) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, scheme)
        return x + self.mlp(self.mlp_norm(x))


class PositionalDecoder(nn.Module):
    """``PositionalDecoder(config, scheme)(ids)``: logits ``[batch, T, vocab]``, positions by ``scheme``."""

    # The book model's initializer: normal(0, init_std) for every Linear and Embedding (a
    # learned position table included), ones for the norms, drawn in module order from one seed.
    reset_parameters = Decoder.reset_parameters

    def __init__(self, config: DecoderConfig, scheme: PositionScheme, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, init_std: float = 0.02) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self._check_scheme(scheme)
        self.config = config
        factory = dict(dtype=dtype, device=device)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.blocks = nn.ModuleList(PositionalBlock(config, **factory) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # Registered last, like Decoder's rotary table: the weights before it are drawn alike.
        # Only its weights take the model's dtype; rotation speeds stay fp32, as in Decoder.
        self.scheme = scheme.to(device=device)
        for weight in self.scheme.parameters():
            weight.data = weight.data.to(dtype)
        self.reset_parameters(seed, init_std)

    @staticmethod
    def _check_scheme(scheme: object) -> None:
        if not isinstance(scheme, PositionScheme):
            raise TypeError(f"scheme must be a labkit.positional PositionScheme, got {type(scheme).__name__}")

    def use_scheme(self, scheme: PositionScheme) -> PositionalDecoder:
        """Swap the position scheme of this (trained) model in place, e.g. RoPE for YaRN; returns the model.

        Only a scheme without weights can be swapped in: a learned table would arrive untrained.
        """
        self._check_scheme(scheme)
        if any(True for _ in scheme.parameters()):
            raise ValueError(f"cannot swap in the {scheme.name} scheme: it has weights of its own, "
                             "which this model never trained; build a new model with it instead")
        weight = self.embed.weight
        self.scheme = scheme.to(device=weight.device)
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"input_ids must be an int32/int64 tensor, got {got}")
        if input_ids.ndim != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be [batch, tokens] and non-empty, got shape {tuple(input_ids.shape)}")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.scheme.embed(self.embed(input_ids), positions)
        for block in self.blocks:
            x = block(x, positions, self.scheme)
        return self.lm_head(self.norm(x))
