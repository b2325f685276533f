"""FP8 scaling recipes: which scale each element is divided by before the cast to FP8.

An FP8 number has 3 (E4M3) or 2 (E5M2) mantissa bits and a narrow range, so a tensor is
stored as ``q = fp8(x / s)`` with a scale ``s`` chosen so that the largest magnitude the
scale covers lands on the format's maximum. The recipes differ in how much a scale covers
and when it is known:

* per-tensor *current* scaling: one scale from this tensor's own ``max|x|``;
* per-tensor *delayed* scaling (Transformer Engine's default on Hopper): one scale from
  the largest ``max|x|`` of the previous ``history`` steps, so the cast needs no extra
  pass over the tensor, but a tensor that grew since then is clipped (saturated);
* per-row scaling: one scale per row (``(1, K)`` tiles, what ``torch._scaled_mm``
  takes as row-wise scales);
* DeepSeek-V3's fine-grained scaling: ``128 x 128`` tiles for weights and ``1 x 128``
  tiles for activations, so one outlier spoils at most 128 of its neighbours.

The tile quantizer is :func:`labkit.quant.reference.quantize_fp8` (the quantization
chapter's); this module names the recipes and adds delayed scaling.
"""

from __future__ import annotations

from collections import deque

import torch

from ..quant.reference import FP8_FORMATS, dequantize_fp8, quantize_fp8

DEEPSEEK_TILE = 128
RECIPES = ("per_tensor", "per_row", "block_128x128", "tile_1x128")


def recipe_tile(recipe: str, shape: tuple[int, int]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` a recipe's scale covers for a ``shape`` tensor (``None``: all of it)."""
    return {"per_tensor": None, "per_row": (1, shape[1]), "block_128x128": (DEEPSEEK_TILE, DEEPSEEK_TILE),
            "tile_1x128": (1, DEEPSEEK_TILE)}[recipe]


def fp8_roundtrip(x: torch.Tensor, recipe: str, fmt: str = "e4m3") -> torch.Tensor:
    """``x`` quantized to FP8 with ``recipe``'s scales and back, as fp32."""
    q, scale = quantize_fp8(x, fmt, recipe_tile(recipe, tuple(x.shape)))
    return dequantize_fp8(q, scale)


class DelayedScaling:
    """Per-tensor FP8 scaling from an amax history, as Transformer Engine's ``DelayedScaling``.

    Each call quantizes with ``s = max(history) / fp8_max * 2^margin`` (the history of the
    previous calls' ``max|x|``; the first call, with an empty history, uses its own), then
    appends this tensor's ``max|x|``. Values beyond ``fp8_max * s`` saturate.
    """

    def __init__(self, history: int = 16, fmt: str = "e4m3", margin: int = 0):
        self.fmt = fmt
        self.margin = margin
        self.amax_history: deque[float] = deque(maxlen=history)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = FP8_FORMATS[self.fmt]
        top = torch.finfo(dtype).max
        amax = float(x.abs().amax())
        reference = max(self.amax_history) if self.amax_history else amax
        scale = torch.tensor(max(reference, torch.finfo(torch.float32).tiny) / top * 2.0**self.margin)
        self.amax_history.append(amax)
        # Saturate explicitly: torch's cast to E5M2 (and some versions' to E4M3) overflows to inf/NaN.
        q = (x.float() / scale).clamp(-top, top).to(dtype)
        return q, scale


def heavy_tailed_activations(rows: int, cols: int, *, outlier_channels: int = 4, outlier_scale: float = 50.0,
                             seed: int = 0) -> torch.Tensor:
    """Activations shaped like an LLM's: Student-t (3 degrees of freedom) noise, plus a few
    channels (columns) ``outlier_scale`` times larger, as LLM.int8() found in every layer."""
    gen = torch.Generator().manual_seed(seed)
    x = _student_t(rows, cols, gen)
    channels = torch.randperm(cols, generator=gen)[:outlier_channels]
    x[:, channels] *= outlier_scale
    return x


def _student_t(rows: int, cols: int, gen: torch.Generator, dof: int = 3) -> torch.Tensor:
    """Student-t samples from a seeded generator: a normal over the root of a chi-square / dof."""
    normal = torch.randn(rows, cols, generator=gen)
    chi2 = torch.randn(dof, rows, cols, generator=gen).pow(2).sum(0)
    return normal / (chi2 / dof).sqrt()
