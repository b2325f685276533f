"""Number formats from FP32 to NVFP4: bit layouts, exact rounding, block scaling, FP8 recipes.

>>> from labkit import formats
>>> formats.describe("fp8_e4m3")["max"]                       # 448.0, from the format's definition
>>> codes = formats.quantize(x, "fp8_e4m3", saturate=True)    # bit patterns, round-to-nearest-even
>>> q = formats.mx_quantize(x, "mxfp4")                        # OCP MX: 32-element blocks, E8M0 scales
>>> x_hat = formats.block_dequantize(q)
>>> formats.fp8_roundtrip(x, "tile_1x128")                      # DeepSeek-V3's activation scaling

Everything here is plain torch on any device, exact to the bit (float64 inside); see
:mod:`labkit.formats.reference` for the formats and :mod:`labkit.formats.scaling` for the
FP8 recipes.
"""

from __future__ import annotations

import torch

from ..quant.reference import pack_int4
from ..validate import check_choice, check_tensor
from . import reference, scaling
from .reference import (BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FORMATS, FP16, FP32, MX_BLOCK, MX_ELEMENTS, NVFP4_BLOCK, TF32,
                        BlockScaled, FloatFormat)
from .scaling import RECIPES, DelayedScaling, heavy_tailed_activations

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CODE_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
BLOCK_FORMATS = (*MX_ELEMENTS, "nvfp4")


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    """The :class:`FloatFormat` named ``fmt`` (one of ``FORMATS``), or ``fmt`` itself."""
    if isinstance(fmt, FloatFormat):
        return fmt
    check_choice(fmt, "fmt", tuple(FORMATS))
    return FORMATS[fmt]


def describe(fmt: str | FloatFormat) -> dict:
    """Range and precision of a format, computed from its definition: bits, bias, max,
    smallest normal and subnormal, epsilon, and which special values it has."""
    f = get_format(fmt)
    return {"format": f.name, "bits": f.bits, "exponent_bits": f.exponent_bits, "mantissa_bits": f.mantissa_bits,
            "bias": f.bias, "max": f.max, "min_normal": f.min_normal, "min_subnormal": f.min_subnormal,
            "epsilon": f.epsilon, "inf": f.has_inf, "nan": f.has_nan}


def decode(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """The float64 values of bit patterns ``codes`` (an integer tensor, each in ``[0, 2^bits)``)."""
    f = get_format(fmt)
    check_tensor(codes, "codes", dtypes=CODE_DTYPES)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**f.bits):
        raise ValueError(f"{f.name} codes must lie in [0, {2**f.bits - 1}], got [{int(codes.min())}, {int(codes.max())}]")
    return reference.decode(codes, f)


def round_to_format(x: torch.Tensor, fmt: str | FloatFormat, saturate: bool = False) -> torch.Tensor:
    """``x`` rounded to nearest-even in ``fmt`` (float64); see :func:`reference.round_to_format`."""
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    _check_bool(saturate, "saturate")
    return reference.round_to_format(x, get_format(fmt), saturate)


def quantize(x: torch.Tensor, fmt: str | FloatFormat, saturate: bool = False) -> torch.Tensor:
    """Bit patterns (int64) of ``x`` rounded to nearest-even in ``fmt``.

    Overflow saturates with ``saturate=True``, else becomes inf (IEEE formats) or NaN
    (E4M3); FP4 always saturates and refuses NaN.
    """
    f = get_format(fmt)
    values = round_to_format(x, f, saturate)
    return reference.encode(values, f)


def bit_fields(code: int, fmt: str | FloatFormat) -> dict:
    """Sign, exponent and mantissa fields of one bit pattern, as ints and as bit strings."""
    f = get_format(fmt)
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < 2**f.bits:
        raise ValueError(f"code must be an int in [0, {2**f.bits - 1}] for {f.name}, got {code!r}")
    m, e = f.mantissa_bits, f.exponent_bits
    bits = format(code, f"0{f.bits}b")
    exp_field = (code >> m) & (2**e - 1)
    return {"sign": code >> (e + m), "exponent": exp_field, "mantissa": code & (2**m - 1),
            "bits": f"{bits[0]} {bits[1:1 + e]} {bits[1 + e:]}", "unbiased_exponent":
            (exp_field if exp_field else 1) - f.bias, "subnormal": exp_field == 0,
            "value": float(reference.decode(torch.tensor([code]), f)[0])}


def mx_quantize(x: torch.Tensor, fmt: str = "mxfp8_e4m3") -> BlockScaled:
    """OCP MX quantization of ``x`` ``[..., K]`` (K a multiple of 32) along its last axis:
    ``fmt`` is one of ``MX_ELEMENTS`` (MXFP8 E4M3/E5M2, MXFP6 E3M2/E2M3, MXFP4)."""
    check_choice(fmt, "fmt", tuple(MX_ELEMENTS))
    _check_blocks(x, MX_BLOCK)
    return reference.mx_quantize(x, fmt)


def nvfp4_quantize(x: torch.Tensor) -> BlockScaled:
    """NVFP4 quantization of ``x`` ``[..., K]`` (K a multiple of 16): E2M1 elements, an E4M3
    scale per 16, one fp32 scale per tensor."""
    _check_blocks(x, NVFP4_BLOCK)
    return reference.nvfp4_quantize(x)


def block_dequantize(q: BlockScaled) -> torch.Tensor:
    """The float64 values of a :class:`BlockScaled` tensor."""
    if not isinstance(q, BlockScaled):
        raise TypeError(f"q must be a BlockScaled (from mx_quantize or nvfp4_quantize), got {type(q).__name__}")
    check_choice(q.format, "q.format", BLOCK_FORMATS)
    check_tensor(q.codes, "q.codes", dtypes=(torch.uint8,))
    check_tensor(q.scales, "q.scales", dtypes=(torch.uint8,))
    expected = (*q.codes.shape[:-1], q.codes.shape[-1] // q.block)
    if q.codes.ndim == 0 or q.codes.shape[-1] % q.block or tuple(q.scales.shape) != expected:
        raise ValueError(f"q.scales must hold one scale per {q.block} elements: expected shape {expected} for "
                         f"codes {tuple(q.codes.shape)}, got {tuple(q.scales.shape)}")
    if (q.format == "nvfp4") != (q.tensor_scale is not None):
        raise ValueError("q.tensor_scale must be set for nvfp4 and only for nvfp4")
    return reference.block_dequantize(q)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` FP4 codes (uint8 in [0, 15]) -> ``[N, K/2]`` bytes, element 2j in the low nibble
    (the layout of gpt-oss's MXFP4 ``blocks`` and of labkit.quant's INT4)."""
    check_tensor(codes, "codes", ndim=2, dtypes=(torch.uint8,))
    if codes.shape[1] % 2 or (codes.numel() and int(codes.max()) > 15):
        raise ValueError(f"codes must be [N, even K] in [0, 15], got shape {tuple(codes.shape)}")
    return pack_int4(codes)


def fp8_roundtrip(x: torch.Tensor, recipe: str, fmt: str = "e4m3") -> torch.Tensor:
    """``x`` ``[M, K]`` through FP8 and back with one of ``RECIPES``' scales (fp32)."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES[:3])
    check_choice(recipe, "recipe", RECIPES)
    tile = scaling.recipe_tile(recipe, tuple(x.shape))
    if tile is not None and (x.shape[0] % tile[0] or x.shape[1] % tile[1]):
        raise ValueError(f"recipe {recipe!r} needs {tile[0]} x {tile[1]} tiles to divide x, got {tuple(x.shape)}")
    return scaling.fp8_roundtrip(x, recipe, fmt)


def _check_blocks(x: torch.Tensor, block: int) -> None:
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"x's last axis must be a multiple of the block size {block}, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("block quantization needs finite inputs (a NaN or inf would poison its block's scale)")


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


__all__ = [
    "BF16", "BLOCK_FORMATS", "BlockScaled", "DelayedScaling", "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "FORMATS", "FP16", "FP32",
    "FloatFormat", "MX_BLOCK", "MX_ELEMENTS", "NVFP4_BLOCK", "RECIPES", "TF32", "bit_fields", "block_dequantize",
    "decode", "describe", "fp8_roundtrip", "get_format", "heavy_tailed_activations", "mx_quantize", "nvfp4_quantize",
    "pack_fp4", "quantize", "round_to_format",
]
