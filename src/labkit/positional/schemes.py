"""Position schemes as small modules that plug into :class:`~labkit.positional.PositionalDecoder`.

A scheme can act at three places, and each acts at one:

- ``embed(x, positions)``: add an absolute encoding to the token embeddings
  (:class:`Sinusoidal`, :class:`Learned`);
- ``rotate(q, k, positions)``: rotate queries and keys by their positions
  (:class:`Rotary`: RoPE and its long-context variants);
- ``bias(num_heads, positions)``: add a bias to the attention scores (:class:`ALiBi`).

:class:`NoPE` does none of them. The defaults of :class:`PositionScheme` leave everything
unchanged, so each scheme overrides only its own hook.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.decoder import RotaryEmbedding, apply_rope
from ..validate import check_positive_int
from . import frequencies


class PositionScheme(nn.Module):
    """The do-nothing base: no absolute encoding, no rotation, no score bias."""

    name = "none"

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def bias(self, num_heads: int, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def extra_repr(self) -> str:
        return self.name


class NoPE(PositionScheme):
    """No position information at all: only the causal mask tells tokens apart by place."""

    name = "nope"


class Sinusoidal(PositionScheme):
    """The Transformer's fixed sin/cos table added to the embeddings, scaled to ``rms``.

    The paper scales embeddings and encodings to the same size; here the table is scaled so
    that its root-mean-square equals ``rms`` (the model passes its embeddings' initial RMS).
    It is a function of the position, so it has a value at every position, trained or not.
    """

    name = "sinusoidal"

    def __init__(self, hidden_size: int, rms: float, base: float = 10_000.0) -> None:
        super().__init__()
        self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        self.amplitude = rms * math.sqrt(2)  # a sin/cos pair has RMS 1/sqrt(2)
        self.base = base

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table = frequencies.sinusoidal_table(positions, self.hidden_size, self.base).to(x.device, x.dtype)
        return x + self.amplitude * table


class Learned(PositionScheme):
    """A trained vector per position (GPT-2, BERT), for positions below ``max_positions``.

    Positions the training never reached keep their random initial vectors: the model has
    a value there, but not one it learned to read.
    """

    name = "learned"

    def __init__(self, hidden_size: int, max_positions: int) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        self.max_positions = check_positive_int(max_positions, "max_positions")
        self.table = nn.Embedding(max_positions, hidden_size)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if int(positions.max()) >= self.max_positions:
            raise ValueError(f"a learned table of {self.max_positions} positions has no vector for position "
                             f"{int(positions.max())}; build it with max_positions above the longest sequence")
        return x + self.table(positions)


class Rotary(PositionScheme):
    """RoPE: queries and keys rotated pair by pair by ``position * inv_freq``, times ``attention_factor``.

    With the default speeds this is exactly the book model's rotary embedding
    (:class:`labkit.models.decoder.RotaryEmbedding` and :func:`labkit.models.apply_rope`);
    the long-context variants only change the speeds (and YaRN the factor). Build them with
    :func:`rope`, :func:`position_interpolation`, :func:`ntk_aware` and :func:`yarn`.
    """

    def __init__(self, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0, name: str = "rope") -> None:
        super().__init__()
        self.rope = RotaryEmbedding(head_dim, theta)
        if inv_freq is not None:
            if inv_freq.shape != self.rope.inv_freq.shape:
                raise ValueError(f"inv_freq must have head_dim/2 = {head_dim // 2} entries, got shape {tuple(inv_freq.shape)}")
            self.rope.inv_freq = inv_freq.float()
        self.attention_factor = attention_factor
        self.name = name

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope(positions, torch.float32)
        if self.attention_factor != 1.0:  # YaRN's temperature: both vectors scaled, so logits by its square
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # scaled in fp32, then rounded once, as HF does
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope(head_dim: int, theta: float) -> Rotary:
    """Plain RoPE, as trained."""
    return Rotary(head_dim, theta)


def position_interpolation(head_dim: int, theta: float, factor: float) -> Rotary:
    """RoPE with every position divided by ``factor`` (Chen et al.; HF ``linear``)."""
    return Rotary(head_dim, theta, frequencies.linear_inv_freq(head_dim, theta, factor), name="pi")


def ntk_aware(head_dim: int, theta: float, factor: float) -> Rotary:
    """RoPE with its base raised to stretch the slowest pair by ``factor`` (HF ``dynamic`` at that length)."""
    return Rotary(head_dim, theta, frequencies.ntk_inv_freq(head_dim, theta, factor), name="ntk")


def yarn(head_dim: int, theta: float, factor: float, original_max_positions: int, **ramp) -> Rotary:
    """YaRN: NTK-by-parts speeds and the attention temperature (Peng et al.; HF ``yarn``)."""
    speeds = frequencies.yarn_inv_freq(head_dim, theta, factor, original_max_positions, **ramp)
    return Rotary(head_dim, theta, speeds, frequencies.yarn_attention_factor(factor), name="yarn")


class ALiBi(PositionScheme):
    """No encoding of positions; attention scores pay ``slope_h * distance`` (Press et al.)."""

    name = "alibi"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", frequencies.alibi_slopes(num_heads), persistent=False)

    def bias(self, num_heads: int, positions: torch.Tensor) -> torch.Tensor:
        if num_heads != len(self.slopes):
            raise ValueError(f"ALiBi was built for {len(self.slopes)} heads, the attention has {num_heads}")
        return frequencies.alibi_bias(self.slopes, positions, positions)
