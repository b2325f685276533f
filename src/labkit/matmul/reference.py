"""Matmul in plain torch: the float64 oracles, the tiled loop the kernels follow, and the
arithmetic of tiling (bytes a tile loads, FLOPs per byte)."""

from __future__ import annotations

import math

import torch

from ..quant.reference import quantize_fp8


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64: the oracle every kernel is checked against."""
    return a.double() @ b.double()


def fp8_matmul_reference(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor,
                         w_scale: torch.Tensor) -> torch.Tensor:
    """``(a_fp8 * a_scale[:, None]) @ (w_fp8 * w_scale[:, None])^T`` in float64."""
    a = a_fp8.double() * a_scale.double()[:, None]
    w = w_fp8.double() * w_scale.double()[:, None]
    return a @ w.T


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, K]`` as E4M3 codes with one fp32 scale per row (``[R]``), so that
    ``codes * scale[:, None]`` approximates ``x`` (the quantization chapter's quantizer)."""
    codes, scale = quantize_fp8(x, "e4m3", (1, x.shape[1]))
    return codes, scale[:, 0].contiguous()


def tiled_matmul(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    """``a @ b`` computed tile by tile, as one program of the tiled kernel computes its tile:
    for each ``block_m x block_n`` tile of C, a running fp32 sum of ``block_k``-wide
    products of a band of A and a band of B. Edges are partial tiles."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    for m0 in range(0, M, block_m):
        for n0 in range(0, N, block_n):
            acc = torch.zeros(min(block_m, M - m0), min(block_n, N - n0), dtype=torch.float32, device=a.device)
            for k0 in range(0, K, block_k):
                acc += a[m0:m0 + block_m, k0:k0 + block_k].float() @ b[k0:k0 + block_k, n0:n0 + block_n].float()
            c[m0:m0 + block_m, n0:n0 + block_n] = acc
    return c.to(a.dtype)


def tile_intensity(block_m: int, block_n: int, element_size: int) -> float:
    """FLOPs per byte a tile loads from memory: each ``block_k`` step loads
    ``(block_m + block_n) * block_k`` elements and does ``2 * block_m * block_n * block_k``
    FLOPs, so ``block_k`` cancels and only the tile's shape counts."""
    return 2 * block_m * block_n / ((block_m + block_n) * element_size)


def tiled_traffic_bytes(M: int, N: int, K: int, block_m: int, block_n: int, element_size: int) -> int:
    """Bytes the tiles of a tiled matmul load and store with no cache: every tile row reads
    all of A's band once per tile column, every tile column all of B's band once per tile row,
    and C is written once."""
    tiles_m, tiles_n = math.ceil(M / block_m), math.ceil(N / block_n)
    return element_size * (M * K * tiles_n + K * N * tiles_m + M * N)


def minimum_traffic_bytes(M: int, N: int, K: int, element_size: int) -> int:
    """Bytes no matmul can avoid: read A and B once, write C once."""
    return element_size * (M * K + K * N + M * N)
