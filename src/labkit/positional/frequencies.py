"""The numbers behind each position scheme, as plain functions of their hyperparameters.

Every scheme in :mod:`labkit.positional.schemes` is one of these tables put to work:

- :func:`sinusoidal_table`: the Transformer's absolute encoding (Vaswani et al., 2017).
- :func:`rope_inv_freq`: RoPE's rotation speeds ``theta^(-2i/d)`` (Su et al., 2021), and the
  three ways of stretching them past the training length that ``rope_scaling`` offers in
  Hugging Face and vLLM: :func:`linear_inv_freq` (position interpolation, Chen et al., 2023),
  :func:`ntk_inv_freq` (NTK-aware scaling of the base, bloc97, 2023; HF's ``dynamic`` type
  picks its factor from the current length) and :func:`yarn_inv_freq` with
  :func:`yarn_attention_factor` (YaRN, Peng et al., 2023).
- :func:`alibi_slopes` and :func:`alibi_bias`: ALiBi's per-head distance penalty (Press et al., 2022).

The tests hold each to its paper's formula and to the implementation Hugging Face ships.
"""

from __future__ import annotations

import math

import torch

from ..models.decoder import RotaryEmbedding
from ..validate import check_choice, check_positive_int, check_tensor

YARN_RAMPS = ("dimension", "ratio")


def _check_positive_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _check_factor(factor: object) -> float:
    factor = _check_positive_number(factor, "factor")
    if factor < 1:
        raise ValueError(f"factor is how many times longer the context becomes, so at least 1, got {factor}")
    return factor


def _check_head_dim(head_dim: object, name: str = "head_dim") -> int:
    check_positive_int(head_dim, name)
    if head_dim % 2:
        raise ValueError(f"{name} must be even (the encoding works on pairs of coordinates), got {head_dim}")
    return head_dim


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float = 10_000.0) -> torch.Tensor:
    """``[len(positions), dim]`` fp32: ``PE[p, 2i] = sin(p / base^(2i/dim))``, ``PE[p, 2i+1] = cos(...)``.

    The Transformer's encoding, interleaved as in the paper. Each pair ``(2i, 2i+1)`` is a
    point on a circle turning at its own speed, so ``PE[p + k]`` is ``PE[p]`` rotated pair by
    pair: a fixed linear map for each offset ``k``, which attention could learn to use.
    """
    check_tensor(positions, "positions", ndim=1, dtypes=(torch.int32, torch.int64))
    _check_head_dim(dim, "dim")
    base = _check_positive_number(base, "base")
    speeds = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.double()[:, None] * speeds[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(positions), dim).float()


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's angular speed of each coordinate pair, ``theta^(-2i/head_dim)``: the book model's own table."""
    _check_head_dim(head_dim)
    return RotaryEmbedding(head_dim, _check_positive_number(theta, "theta")).inv_freq


def linear_inv_freq(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """Position interpolation: every speed divided by ``factor`` (position ``m`` is read as ``m / factor``).

    HF's ``rope_type: "linear"``. Positions ``factor`` times further than training land on
    angles the model has seen, at the price of squeezing neighbouring tokens together.
    """
    return rope_inv_freq(head_dim, theta) / _check_factor(factor)


def ntk_inv_freq(head_dim: int, theta: float, factor: float) -> torch.Tensor:
    """NTK-aware scaling: the same formula with base ``theta * factor^(d / (d - 2))``.

    The fastest pair (``i = 0``) keeps its speed; the slowest (``i = d/2 - 1``) is slowed by
    exactly ``factor``, as under interpolation; the ones between by less, geometrically.
    HF's ``dynamic`` type is this with the factor chosen from the current length ``n``:
    ``factor * n / max_positions - (factor - 1)`` once ``n`` passes ``max_positions``.
    """
    _check_head_dim(head_dim)
    if head_dim < 4:
        raise ValueError(f"NTK-aware scaling needs head_dim >= 4 (it divides by head_dim - 2), got {head_dim}")
    factor = _check_factor(factor)
    return rope_inv_freq(head_dim, theta * factor ** (head_dim / (head_dim - 2)))


def yarn_ramp(head_dim: int, theta: float, original_max_positions: int, beta_fast: float = 32.0,
              beta_slow: float = 1.0, *, ramp: str = "dimension", truncate: bool = True) -> torch.Tensor:
    """YaRN's ``gamma`` per coordinate pair: 1 keeps RoPE's speed, 0 interpolates fully.

    A pair that turns ``r = L / wavelength`` times over the original context ``L`` is left
    alone when ``r > beta_fast`` (it has seen every angle many times) and interpolated when
    ``r < beta_slow`` (it never completed a turn). Between the two the paper (eq. 18)
    ramps linearly *in r*: ``ramp="ratio"``. Its reference code, Hugging Face and vLLM ramp
    linearly in the pair's *index* between the two (fractional) indices where ``r`` equals
    ``beta_fast`` and ``beta_slow``, rounded outwards when ``truncate``: ``ramp="dimension"``.
    The two agree outside the ramp and differ inside it.
    """
    check_choice(ramp, "ramp", YARN_RAMPS)
    inv_freq = rope_inv_freq(head_dim, theta).double()
    check_positive_int(original_max_positions, "original_max_positions")
    beta_fast, beta_slow = _check_positive_number(beta_fast, "beta_fast"), _check_positive_number(beta_slow, "beta_slow")
    if beta_fast <= beta_slow:
        raise ValueError(f"beta_fast ({beta_fast}) must exceed beta_slow ({beta_slow}): pairs turning faster are kept")
    if ramp == "ratio":
        turns = original_max_positions * inv_freq / (2 * math.pi)
        return ((turns - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1).float()

    def index_where_turns(turns: float) -> float:  # solve L * theta^(-2i/d) / (2 pi) = turns for i
        return head_dim * math.log(original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_where_turns(beta_fast), index_where_turns(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 0.001  # as the reference code does: a ramp of width zero would divide by zero
    index = torch.arange(head_dim // 2, dtype=torch.float64)
    return (1 - ((index - low) / (high - low)).clamp(0, 1)).float()


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max_positions: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, *, ramp: str = "dimension",
                  truncate: bool = True) -> torch.Tensor:
    """YaRN's "NTK-by-parts" speeds: ``(1 - gamma) * speed / factor + gamma * speed`` per pair.

    High-frequency pairs keep RoPE's speed (local order stays sharp), low-frequency pairs
    are interpolated like PI, and :func:`yarn_ramp` blends the ones between. Pair it with
    :func:`yarn_attention_factor`. HF's ``rope_type: "yarn"``.
    """
    factor = _check_factor(factor)
    gamma = yarn_ramp(head_dim, theta, original_max_positions, beta_fast, beta_slow, ramp=ramp, truncate=truncate)
    speeds = rope_inv_freq(head_dim, theta)
    return (1 - gamma) * speeds / factor + gamma * speeds


def yarn_attention_factor(factor: float) -> float:
    """YaRN's temperature, ``0.1 ln(factor) + 1`` (1 for no extension), multiplying cos and sin.

    Scaling both rotated vectors by it scales every attention logit by its square:
    the paper's ``sqrt(1/t)``, fitted so the softmax stays as sharp at long range.
    """
    factor = _check_factor(factor)
    return 1.0 if factor == 1 else 0.1 * math.log(factor) + 1.0


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes: ``2^(-8k/n)`` for ``k = 1..n`` when ``n`` is a power of two.

    Otherwise, as the paper's code and Hugging Face do: the slopes of the largest power of
    two below ``n``, then every other slope of twice that power for the heads left over.
    """
    check_positive_int(num_heads, "num_heads")

    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * k / n) for k in range(1, n + 1)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``[heads, queries, keys]`` fp32 added to attention scores: ``-slope * (i - j)``, ``-inf`` for ``j > i``.

    The penalty grows linearly with distance, at a different rate per head; it carries the
    causal mask too, since a float mask replaces SDPA's ``is_causal``.
    """
    check_tensor(slopes, "slopes", ndim=1, dtypes=(torch.float32, torch.float64))
    check_tensor(query_positions, "query_positions", ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor(key_positions, "key_positions", ndim=1, dtypes=(torch.int32, torch.int64))
    distance = (query_positions[:, None] - key_positions[None, :]).float()
    bias = -slopes.float()[:, None, None] * distance[None]
    return bias.masked_fill(distance[None] < 0, float("-inf"))
