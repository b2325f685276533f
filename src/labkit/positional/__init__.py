"""Positional encodings: chapter "Positional encodings".

>>> model = PositionalDecoder(config, rope(config.head_dim, config.rope_theta))   # the book's model
>>> model = PositionalDecoder(config, ALiBi(config.num_heads))                    # the same, with ALiBi
>>> model.use_scheme(yarn(config.head_dim, config.rope_theta, factor=4, original_max_positions=256))

The schemes (:mod:`labkit.positional.schemes`): :class:`NoPE`, :class:`Sinusoidal`,
:class:`Learned`, :class:`Rotary` (built by :func:`rope`, :func:`position_interpolation`,
:func:`ntk_aware`, :func:`yarn`) and :class:`ALiBi`. The tables behind them
(:mod:`labkit.positional.frequencies`) are plain functions checked against their papers
and Hugging Face. :mod:`labkit.positional.extrapolation` trains a model per scheme and
measures its loss past the trained length; ``positional.extrapolation`` is its benchmark.
"""

from .extrapolation import (
    FINETUNED,
    ROPE_EXTENSIONS,
    SCHEMES,
    TRAINED_SCHEMES,
    ExtrapolationRun,
    loss_by_position,
    make_scheme,
    run_extrapolation,
    summarize,
)
from .frequencies import (
    alibi_bias,
    alibi_slopes,
    linear_inv_freq,
    ntk_inv_freq,
    rope_inv_freq,
    sinusoidal_table,
    yarn_attention_factor,
    yarn_inv_freq,
    yarn_ramp,
)
from .model import PositionalDecoder
from .schemes import (
    ALiBi,
    Learned,
    NoPE,
    PositionScheme,
    Rotary,
    Sinusoidal,
    ntk_aware,
    position_interpolation,
    rope,
    yarn,
)

__all__ = [
    "FINETUNED", "ROPE_EXTENSIONS", "SCHEMES", "TRAINED_SCHEMES", "ALiBi", "ExtrapolationRun", "Learned", "NoPE",
    "PositionScheme", "PositionalDecoder", "Rotary", "Sinusoidal", "alibi_bias", "alibi_slopes", "linear_inv_freq",
    "loss_by_position", "make_scheme", "ntk_aware", "ntk_inv_freq", "position_interpolation", "rope",
    "rope_inv_freq", "run_extrapolation", "sinusoidal_table", "summarize", "yarn", "yarn_attention_factor",
    "yarn_inv_freq", "yarn_ramp",
]
