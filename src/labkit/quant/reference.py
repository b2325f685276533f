"""Integer and FP8 weight formats in plain torch: the oracle every kernel is checked against.

A weight ``W`` is ``[N, K]`` (``nn.Linear``'s layout: N outputs, K inputs). Its K axis is
cut into groups of ``group_size`` consecutive inputs (``group_size == K`` is per-channel);
each (row, group) has a scale ``s`` and a zero point ``z``, and each weight is stored as an
unsigned code ``u`` in ``[0, 2^bits - 1]`` with

    w ~= (u - z) * s.

Symmetric formats fix ``z = 2^(bits-1)`` (8 for INT4, 128 for INT8) and store no zeros:
``s = max|w| / (2^(bits-1) - 1)``, so ``+-max|w|`` land on codes exactly. Asymmetric
formats spend the whole range on ``[min w, max w]``: ``s = (max - min) / (2^bits - 1)``
and ``z = round(-min / s)``, stored per group (here as integer-valued floats).

INT4 codes are packed two per byte along K: byte ``j`` of a row holds element ``2j`` in
its low nibble and element ``2j + 1`` in its high nibble (the order AWQ's and GPTQ's
packers do not share; ours is the simple one, and the exercise tests it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[N, K]`` weight as codes, one scale (and zero point) per (row, group)."""

    codes: torch.Tensor          # uint8 [N, K] for 8 bits; [N, K/2] packed for 4 bits
    scales: torch.Tensor         # [N, K / group_size], float
    zeros: torch.Tensor | None   # [N, K / group_size], integer-valued float; None: symmetric
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        n, stored = self.codes.shape
        return n, stored * 8 // self.bits

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads for this weight: codes, scales and zero points."""
        extra = 0 if self.zeros is None else self.zeros.numel() * self.zeros.element_size()
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + extra


def group_params(groups: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) for each group along the last axis of ``groups`` (fp32)."""
    g = groups.float()
    if symmetric:
        scale = g.abs().amax(-1) / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)  # keep 0 representable
        scale = (hi - lo) / (2**bits - 1)
        zero = torch.round(-lo / torch.where(scale > 0, scale, 1.0))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    return scale, zero


def encode(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest codes ``clamp(round(w / s) + z, 0, 2^bits - 1)`` (scale, zero broadcast)."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, 2**bits - 1).to(torch.uint8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes in [0, 15] -> ``[N, K/2]`` bytes: element 2j low nibble, 2j+1 high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
                 scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Round-to-nearest quantization of ``w`` ``[N, K]`` with one scale per ``group_size`` inputs."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    scale, zero = group_params(groups, bits, symmetric)
    codes = encode(groups, scale[..., None], zero[..., None], bits).reshape(n, k)
    return _store(codes, scale, zero, bits, group_size, symmetric, scale_dtype)


def _store(codes, scale, zero, bits, group_size, symmetric, scale_dtype) -> QuantizedWeight:
    return QuantizedWeight(
        codes=pack_int4(codes) if bits == 4 else codes,
        scales=scale.to(scale_dtype),
        zeros=None if symmetric else zero.to(scale_dtype),
        bits=bits, group_size=group_size,
    )


def codes_of(qw: QuantizedWeight) -> torch.Tensor:
    """The unpacked ``[N, K]`` codes."""
    return unpack_int4(qw.codes) if qw.bits == 4 else qw.codes


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """``(u - z) * s`` as a ``[N, K]`` fp32 tensor."""
    codes = codes_of(qw).float()
    n, k = codes.shape
    zero = (torch.full_like(qw.scales, 2 ** (qw.bits - 1), dtype=torch.float32) if qw.zeros is None
            else qw.zeros.float())
    groups = codes.reshape(n, k // qw.group_size, qw.group_size)
    return ((groups - zero[..., None]) * qw.scales.float()[..., None]).reshape(n, k)


def dequant_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``x @ dequantize(qw)^T`` in float64: what a dequantizing kernel must compute."""
    return x.double() @ dequantize(qw).double().T


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def packed_gemv_rounding(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The batch-1 INT4 GEMV with the bf16x2 kernel's roundings (``PACKED``), in float64 otherwise.

    Per int32 word of 8 codes the kernel pairs inputs ``(i, i + 4)``: the low half of its
    bf16x2 sums ``(u_i - z) x_i`` over ``i = 0..3``, the high half over ``i = 4..7``, each product
    and each running sum rounded to bf16 (``mul``, then ``fma``, round to nearest even: the
    exact result, rounded once). The two halves, scaled by their group's scale, are then added
    in fp32, which this model takes as exact. ``x`` ``[1, K]`` in bf16; returns ``[1, N]`` float64.
    """
    codes = codes_of(qw).double()
    n, k = codes.shape
    zero = (torch.full_like(qw.scales, 2 ** (qw.bits - 1), dtype=torch.float64) if qw.zeros is None
            else qw.zeros.double())
    centred = (codes - zero.repeat_interleave(qw.group_size, 1)).view(n, k // 8, 8)
    inputs = x.double().view(k // 8, 8)
    low, high = _round_bf16(centred[..., 0] * inputs[:, 0]), _round_bf16(centred[..., 4] * inputs[:, 4])
    for i in range(1, 4):
        low = _round_bf16(centred[..., i] * inputs[:, i] + low)
        high = _round_bf16(centred[..., i + 4] * inputs[:, i + 4] + high)
    word_scales = qw.scales.double().repeat_interleave(qw.group_size // 8, 1)
    return ((low + high) * word_scales).sum(1)[None, :]


def quantize_fp8(w: torch.Tensor, fmt: str = "e4m3",
                 block: int | tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as FP8 with an fp32 scale per tensor (``block=None``) or per tile: ``block x block``
    for an int, ``rows x cols`` for a pair (``(1, K)`` is per row, ``(1, 128)`` DeepSeek-V3's
    activation tiles).

    The scale maps each tile's ``max|w|`` onto the format's largest finite value (448 for
    E4M3, 57344 for E5M2); values then round to the nearest representable FP8 number.
    """
    dtype = FP8_FORMATS[fmt]
    top = torch.finfo(dtype).max
    w32 = w.float()
    if block is None:
        scale = (w32.abs().amax() / top).clamp(min=torch.finfo(torch.float32).tiny)
        return (w32 / scale).to(dtype), scale
    n, k = w.shape
    rows, cols = (block, block) if isinstance(block, int) else block
    tiles = w32.reshape(n // rows, rows, k // cols, cols)
    scale = (tiles.abs().amax(dim=(1, 3)) / top).clamp(min=torch.finfo(torch.float32).tiny)
    q = (tiles / scale[:, None, :, None]).to(dtype).reshape(n, k)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8` (fp32)."""
    if scale.ndim == 0:
        return q.float() * scale
    n, k = q.shape
    bn, bk = n // scale.shape[0], k // scale.shape[1]
    tiles = q.float().reshape(scale.shape[0], bn, scale.shape[1], bk)
    return (tiles * scale[:, None, :, None]).reshape(n, k)
