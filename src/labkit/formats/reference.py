"""Floating-point formats bit by bit, in plain torch: the oracle for every cast in the chapter.

A binary floating-point format with ``e`` exponent bits, ``m`` mantissa bits and bias ``b``
stores a sign ``s``, an exponent field ``E`` and a mantissa field ``M``; it stands for

    (-1)^s * 2^(E - b) * (1 + M / 2^m)       if E > 0   (normal)
    (-1)^s * 2^(1 - b) * (M / 2^m)           if E == 0  (subnormal)

Formats differ in what the all-ones exponent means (``specials``):

* ``"ieee"`` (FP32, TF32, BF16, FP16, FP8 E5M2): infinities (M = 0) and NaNs (M != 0).
* ``"fn"`` (FP8 E4M3, OCP's ``E4M3FN``): finite only; the all-ones exponent holds normal
  numbers, except S.1111.111, the one NaN. That buys 448 instead of 240 as the maximum.
* ``"none"`` (FP6 E3M2 and E2M3, FP4 E2M1): every code is a finite number; no infinity, no NaN.

Rounding is to nearest, ties to even (IEEE 754's default, and the OCP MX spec's): the
value is rounded at the quantum of its binade, ``2^(max(floor(log2|x|), 1 - b) - m)``,
with ``torch.round`` (which rounds halves to even) in float64, where dividing and
multiplying by a power of two is exact.

Block formats (OCP Microscaling v1.0 and NVIDIA's NVFP4) store elements in one of these
formats plus a scale shared by a block: :func:`mx_quantize`, :func:`nvfp4_quantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign bit, ``exponent_bits``, ``mantissa_bits``."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    specials: str                      # "ieee", "fn" or "none" (see the module docstring)
    torch_dtype: torch.dtype | None    # the torch dtype of the same format, where there is one

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_exponent(self) -> int:
        """The exponent of the smallest normal number (and of every subnormal's binade)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """The exponent of the largest finite number's binade."""
        top_field = 2**self.exponent_bits - 1
        return top_field - self.bias - (1 if self.specials == "ieee" else 0)

    @property
    def max(self) -> float:
        """The largest finite value: all-ones mantissa, minus the NaN code in ``"fn"`` formats."""
        top_mantissa = 2**self.mantissa_bits - 1 - (1 if self.specials == "fn" else 0)
        return 2.0**self.max_exponent * (1 + top_mantissa / 2**self.mantissa_bits)

    @property
    def min_normal(self) -> float:
        return 2.0**self.min_exponent

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """The gap between 1 and the next value: the relative precision, 2^-m."""
        return 2.0**-self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "none"


FP32 = FloatFormat("fp32", 8, 23, "ieee", torch.float32)
TF32 = FloatFormat("tf32", 8, 10, "ieee", None)   # 19 bits, kept in a 32-bit register by the tensor cores
BF16 = FloatFormat("bf16", 8, 7, "ieee", torch.bfloat16)
FP16 = FloatFormat("fp16", 5, 10, "ieee", torch.float16)
E4M3 = FloatFormat("fp8_e4m3", 4, 3, "fn", torch.float8_e4m3fn)
E5M2 = FloatFormat("fp8_e5m2", 5, 2, "ieee", torch.float8_e5m2)
E3M2 = FloatFormat("fp6_e3m2", 3, 2, "none", None)   # MXFP6's two element formats (OCP MX v1.0)
E2M3 = FloatFormat("fp6_e2m3", 2, 3, "none", None)
E2M1 = FloatFormat("fp4_e2m1", 2, 1, "none", None)
FORMATS = {f.name: f for f in (FP32, TF32, BF16, FP16, E4M3, E5M2, E3M2, E2M3, E2M1)}

E8M0_BIAS = 127
E8M0_NAN = 0xFF


def decode(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The float64 values of integer bit patterns ``codes`` (low ``fmt.bits`` bits used)."""
    c = codes.to(torch.int64)
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    sign = (c >> (e + m)) & 1
    exp_field = (c >> m) & (2**e - 1)
    man_field = c & (2**m - 1)
    frac = man_field.double() / 2**m
    magnitude = torch.where(exp_field == 0, frac * 2.0**fmt.min_exponent,
                            (1 + frac) * torch.exp2((exp_field - fmt.bias).double()))
    top = exp_field == 2**e - 1
    if fmt.specials == "ieee":
        magnitude = torch.where(top & (man_field == 0), torch.inf, magnitude)
        magnitude = torch.where(top & (man_field != 0), torch.nan, magnitude)
    elif fmt.specials == "fn":
        magnitude = torch.where(top & (man_field == 2**m - 1), torch.nan, magnitude)
    return torch.where(sign == 1, -magnitude, magnitude)


def round_to_format(x: torch.Tensor, fmt: FloatFormat, saturate: bool = False) -> torch.Tensor:
    """``x`` rounded to the nearest value of ``fmt`` (ties to even), as float64.

    Overflow (a value that rounds past ``fmt.max``): ``saturate`` clamps it, and infinities
    too, to ``+-fmt.max``; otherwise it becomes infinity in ``"ieee"`` formats and NaN in
    ``"fn"`` ones (OCP FP8's non-saturating mode). ``"none"`` formats (FP4) always
    saturate: they have nothing else to become. NaN stays NaN.
    """
    x64 = x.double()
    magnitude = x64.abs()
    _, frexp_exp = torch.frexp(magnitude)  # magnitude = mantissa * 2^frexp_exp, mantissa in [0.5, 1)
    binade = torch.clamp(frexp_exp - 1, min=fmt.min_exponent)
    quantum = torch.exp2((binade - fmt.mantissa_bits).double())
    rounded = torch.round(magnitude / quantum) * quantum
    rounded = torch.where(torch.isfinite(magnitude), rounded, magnitude)
    overflow = rounded > fmt.max
    if saturate or fmt.specials == "none":
        rounded = torch.where(overflow, fmt.max, rounded)
    elif fmt.specials == "fn":
        rounded = torch.where(overflow, torch.nan, rounded)
    else:
        rounded = torch.where(overflow, torch.inf, rounded)
    return torch.copysign(rounded, x64)


def encode(values: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit patterns (int64) of ``values``, which must already be values of ``fmt``.

    Use :func:`quantize` to round arbitrary numbers first. NaN encodes as the format's
    canonical NaN (positive sign, quiet bit set); FP4 has no NaN and refuses one.
    """
    v = values.double()
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    magnitude = v.abs()
    _, frexp_exp = torch.frexp(magnitude)
    exponent = frexp_exp - 1
    normal = magnitude >= fmt.min_normal
    exp_field = torch.where(normal, exponent + fmt.bias, torch.zeros_like(exponent))
    scale = torch.exp2(torch.where(normal, exponent, torch.full_like(exponent, fmt.min_exponent)).double())
    man_real = torch.where(normal, magnitude / scale - 1, magnitude / scale) * 2**m
    man_field = torch.round(man_real).to(torch.int64)
    finite = torch.isfinite(magnitude)
    if bool((finite & (man_real != torch.round(man_real))).any()) or bool((finite & (magnitude > fmt.max)).any()):
        raise ValueError(f"encode() takes values of {fmt.name}; round them with quantize() first")
    all_ones = 2**e - 1
    if fmt.specials == "ieee":
        inf_code = all_ones << m
        nan_code = inf_code | (1 << (m - 1))
    elif fmt.specials == "fn":
        inf_code = None
        nan_code = (all_ones << m) | (2**m - 1)
    else:
        inf_code = nan_code = None
    if not bool(finite.all()):
        if inf_code is None and bool(torch.isinf(magnitude).any()):
            raise ValueError(f"{fmt.name} has no infinity; quantize with saturate=True to clamp to {fmt.max}")
        if nan_code is None and bool(torch.isnan(magnitude).any()):
            raise ValueError(f"{fmt.name} has no NaN; its inputs must be numbers")
    code = (exp_field.clamp(min=0) << m) | man_field.clamp(min=0)
    code = torch.where(torch.isinf(magnitude), inf_code or 0, code)
    code = torch.where(torch.isnan(magnitude), nan_code or 0, code)
    sign = torch.signbit(v) & ~torch.isnan(v)
    return torch.where(sign, code | (1 << (e + m)), code)


def quantize(x: torch.Tensor, fmt: FloatFormat, saturate: bool = False) -> torch.Tensor:
    """Bit patterns (int64) of ``x`` rounded to ``fmt``: :func:`round_to_format` then :func:`encode`."""
    return encode(round_to_format(x, fmt, saturate), fmt)


def all_values(fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code of a format of at most 16 bits, and its value: ``(codes, values)``."""
    codes = torch.arange(2**fmt.bits, dtype=torch.int64)
    return codes, decode(codes, fmt)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (OCP MX): code ``c`` is ``2^(c - 127)``; 0xFF is NaN. No sign, no mantissa."""
    c = codes.to(torch.int64)
    return torch.where(c == E8M0_NAN, torch.nan, torch.exp2((c - E8M0_BIAS).double()))


# -- block scaling: OCP MX (MXFP8, MXFP4) and NVIDIA's NVFP4 ---------------------------------

MX_BLOCK = 32
NVFP4_BLOCK = 16
MX_ELEMENTS = {"mxfp8_e4m3": E4M3, "mxfp8_e5m2": E5M2, "mxfp6_e3m2": E3M2, "mxfp6_e2m3": E2M3, "mxfp4": E2M1}


@dataclass(frozen=True)
class BlockScaled:
    """A ``[..., K]`` tensor as element codes with one scale per ``block`` consecutive elements.

    ``codes``: uint8 ``[..., K]``, one element's bit pattern per byte (FP4 codes unpacked:
    :func:`labkit.formats.pack_fp4` packs them two per byte). ``scales``: uint8
    ``[..., K / block]``, E8M0 codes (MX) or E4M3 codes (NVFP4). ``tensor_scale``: NVFP4's
    fp32 per-tensor factor (``None`` for MX).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    format: str
    block: int
    tensor_scale: torch.Tensor | None = None

    @property
    def element_format(self) -> FloatFormat:
        return E2M1 if self.format == "nvfp4" else MX_ELEMENTS[self.format]

    @property
    def bits_per_element(self) -> float:
        """Storage per element, scales included (the per-tensor fp32 scale is negligible)."""
        return self.element_format.bits + 8 / self.block


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.double().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def mx_quantize(x: torch.Tensor, fmt: str = "mxfp8_e4m3") -> BlockScaled:
    """OCP MX v1.0 quantization of ``x`` ``[..., K]`` along its last axis (blocks of 32).

    Each block's shared scale is ``X = 2^(floor(log2 max|v|) - emax)``, where ``emax`` is
    the exponent of the element format's largest normal (8 for E4M3, 15 for E5M2, 2 for
    E2M1), stored as E8M0; the elements are ``v / X`` rounded to nearest-even, saturating
    at the format's maximum (the largest value of a block can land above it: up to
    ``1.99 * 2^emax`` before clamping). An all-zero block gets the smallest scale, 2^-127.
    """
    elem = MX_ELEMENTS[fmt]
    blocks = _blocks(x, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    _, frexp_exp = torch.frexp(amax)
    shared = torch.where(amax > 0, frexp_exp - 1 - elem.max_exponent, torch.full_like(frexp_exp, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    elements = round_to_format(blocks / torch.exp2(shared.double())[..., None], elem, saturate=True)
    codes = encode(elements, elem).to(torch.uint8).reshape(x.shape)
    return BlockScaled(codes, (shared + E8M0_BIAS).to(torch.uint8), fmt, MX_BLOCK)


def nvfp4_quantize(x: torch.Tensor) -> BlockScaled:
    """NVFP4: E2M1 elements, an E4M3 scale per 16 elements, and one fp32 scale per tensor.

    The two-level recipe of NVIDIA's TensorRT Model Optimizer and Transformer Engine: the
    per-tensor scale ``t = max|x| / (448 * 6)`` maps the tensor's largest value onto the
    largest (E4M3 scale x E2M1 element) product; each block's scale is
    ``max|block| / (6 t)`` rounded to E4M3, so that the block's largest element lands on
    FP4's 6 (up to the scale's rounding); elements are ``x / (scale t)`` rounded to E2M1,
    saturating.
    """
    blocks = _blocks(x, NVFP4_BLOCK)
    amax = x.double().abs().amax()
    tensor_scale = (amax / (E4M3.max * E2M1.max)).float()
    t = tensor_scale.double() if float(tensor_scale) > 0 else torch.ones((), dtype=torch.float64)
    block_scale = round_to_format(blocks.abs().amax(-1) / (E2M1.max * t), E4M3, saturate=True)
    divisor = torch.where(block_scale > 0, block_scale * t, 1.0)[..., None]
    elements = round_to_format(blocks / divisor, E2M1)
    codes = encode(elements, E2M1).to(torch.uint8).reshape(x.shape)
    return BlockScaled(codes, encode(block_scale, E4M3).to(torch.uint8), "nvfp4", NVFP4_BLOCK, tensor_scale)


def block_dequantize(q: BlockScaled) -> torch.Tensor:
    """The float64 values a :class:`BlockScaled` stands for (``[..., K]``)."""
    elements = decode(q.codes, q.element_format)
    elements = elements.reshape(*q.codes.shape[:-1], q.codes.shape[-1] // q.block, q.block)
    if q.format == "nvfp4":
        scale = decode(q.scales, E4M3) * q.tensor_scale.double()
    else:
        scale = decode_e8m0(q.scales)
    return (elements * scale[..., None]).reshape(q.codes.shape)
