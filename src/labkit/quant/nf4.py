"""NF4 with double quantization: QLoRA's storage format for a frozen base weight (Dettmers et al., 2023).

NormalFloat4 spends its 16 codes on the quantiles of a standard normal, since trained
weights are close to normal: each code has about the same share of the weights (the
information-theoretically optimal allocation for that distribution). The levels are
normalised to [-1, 1] and contain an exact 0 (asymmetric: 8 positive levels, 7 negative),
built as in the paper's Appendix and bitsandbytes' ``create_normal_map``.

A weight is flattened and cut into blocks of 64; each block stores its ``absmax`` and 64
four-bit codes (the level nearest ``w / absmax``). That costs 4 + 32/64 = 4.5 bits a
weight. *Double quantization* then quantizes the fp32 ``absmax`` values themselves, in
blocks of 256, to 8 bits after subtracting their mean: 4 + 8/64 + 32/(64*256) ~ 4.127
bits. bitsandbytes stores the second-level codes in its 8-bit "dynamic" float format;
here they are plain symmetric int8 (``labkit.quant``'s per-group RTN), which is simpler; the
LoRA chapter measures the error the second level adds. The codes are packed two per byte
with :func:`labkit.quant.reference.pack_int4`'s nibble order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import dequantize, pack_int4, quantize_rtn, unpack_int4

BLOCK_SIZE = 64
ABSMAX_BLOCK_SIZE = 256
# The quantiles' outer edge: levels at the quantiles of [1 - OFFSET, OFFSET] rather than of
# (0, 1), whose ends are infinite. bitsandbytes' value, the mean of the two offsets that
# make the outermost level land at the middle of the last bin for 15 and for 16 bins.
OFFSET = 0.9677083


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels in ascending order, fp32, from -1 to 1 with an exact 0."""
    def quantiles(lo: float, hi: float, n: int) -> torch.Tensor:
        return torch.special.ndtri(torch.linspace(lo, hi, n, dtype=torch.float64)[:-1])

    positive = quantiles(OFFSET, 0.5, 9)                   # 8 levels above 0
    negative = -quantiles(OFFSET, 0.5, 8)                  # 7 below
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (levels / levels.max()).float()


@dataclass(frozen=True)
class NF4Weight:
    """A weight of ``shape`` as packed NF4 codes, block absmaxes and (if double quantized) their codes."""

    codes: torch.Tensor                 # uint8 [blocks, block_size / 2]: two codes a byte
    absmax: torch.Tensor | None         # fp32 [blocks]; None when double quantized
    absmax_codes: torch.Tensor | None   # uint8 [1, padded blocks]: int8 codes of absmax - mean
    absmax_scales: torch.Tensor | None  # fp32 [1, padded blocks / ABSMAX_BLOCK_SIZE]
    absmax_mean: float
    shape: tuple[int, int]

    @property
    def blocks(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, then either fp32 absmaxes or their int8 codes and fp32 scales."""
        extra = (self.absmax.numel() * 4 if self.absmax is not None
                 else self.absmax_codes.numel() + self.absmax_scales.numel() * 4 + 4)
        return self.codes.numel() + extra

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])


def quantize_nf4(w: torch.Tensor, double_quant: bool = True, block_size: int = BLOCK_SIZE) -> NF4Weight:
    """NF4 codes for ``w`` ``[N, K]``, ``block_size`` weights a block (the last block zero-padded)."""
    n, k = w.shape
    flat = w.detach().float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).reshape(-1, block_size)
    absmax = padded.abs().amax(dim=1)
    normalised = padded / torch.where(absmax > 0, absmax, 1.0)[:, None]
    levels = nf4_levels().to(w.device)
    # the nearest level: levels are sorted, so compare with the midpoints between them
    codes = torch.bucketize(normalised, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
    packed = pack_int4(codes)
    if not double_quant:
        return NF4Weight(packed, absmax, None, None, 0.0, (n, k))
    mean = absmax.mean()
    centred = torch.nn.functional.pad(absmax - mean, (0, -absmax.numel() % ABSMAX_BLOCK_SIZE))
    second = quantize_rtn(centred[None, :], bits=8, group_size=ABSMAX_BLOCK_SIZE)
    return NF4Weight(packed, None, second.codes, second.scales, mean.item(), (n, k))


def nf4_absmax(qw: NF4Weight) -> torch.Tensor:
    """The blocks' absmax values ``[blocks]`` (fp32), decoded from the second level if double quantized."""
    if qw.absmax is not None:
        return qw.absmax
    from .reference import QuantizedWeight

    second = QuantizedWeight(qw.absmax_codes, qw.absmax_scales, None, bits=8, group_size=ABSMAX_BLOCK_SIZE)
    return dequantize(second)[0, :qw.blocks] + qw.absmax_mean


def dequantize_nf4(qw: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight ``level[code] * absmax`` in ``dtype``."""
    levels = nf4_levels().to(qw.codes.device)
    values = levels[unpack_int4(qw.codes).long()] * nf4_absmax(qw)[:, None]
    n, k = qw.shape
    return values.reshape(-1)[: n * k].reshape(n, k).to(dtype)
