"""Weight-only dequantizing matmuls ``y = x @ dequant(W)^T`` in Triton: a GEMV and a small GEMM.

At batch 1 a linear layer is a streaming read of its weight: every weight byte is used
once, for one multiply-add. So the kernel's job is to read the packed codes at the copy
bandwidth and do the unpacking in the shadow of that read. Both kernels here:

- own a ``BLOCK_N``-row strip of the output and loop over K in ``BLOCK_K`` chunks, loading
  each row's codes as one contiguous run of bytes (INT4: ``BLOCK_K / 2`` bytes, two codes
  each; INT8: ``BLOCK_K`` bytes);
- never build the dequantized weight. With ``w = (u - z) * s`` constant over a group,
  ``sum_k x_k w_k = s * (sum_k x_k u_k - z * sum_k x_k)`` over each group: the raw codes
  meet ``x`` directly, and the scale and zero point are applied once per (row, group);
- split K across ``SPLIT_K`` programs only when ``N / BLOCK_N`` strips are too few to
  fill the GPU (:func:`split_k_for`), adding their fp32 partial sums with an atomic into
  an fp32 buffer that the launcher zeroes and casts. Otherwise each program stores its
  rows, cast to the output dtype, and nothing else is launched: at batch 1 an 8192x8192
  INT4 weight reads in about 10 us, so two extra tiny kernels would cost a third of it.

The INT4 nibble order (element ``2j`` in the low nibble of byte ``j``) lets a kernel avoid
interleaving: the low nibbles meet ``x``'s even elements and the high nibbles the odd ones.

:func:`_gemv_kernel` serves batch 1 with elementwise multiply-and-sum (a tensor-core tile
would be 15/16 padding). :func:`_gemm_kernel` serves batches of 2 to a few dozen with
``tl.dot`` on integer-valued codes, exact in bf16/fp16 (|u| <= 255 < 2^8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backend
from .reference import QuantizedWeight


@triton.jit
def _gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, y_ptr,
    N, K, stride_cn, stride_sn,
    implicit_zero,           # 2^(bits-1): the zero point of symmetric formats
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SUB: tl.constexpr,       # inputs per scale inside one chunk: min(GROUP, BLOCK_K)
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)  # 28672 rows x 8192 bytes passes 2^31
    PER_CHUNK: tl.constexpr = BLOCK_K // SUB   # scales one chunk spans
    chunks = K // BLOCK_K                      # the launcher makes BLOCK_K divide K
    per_split = tl.cdiv(chunks, SPLIT_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for c in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, chunks)):
        k0 = c * BLOCK_K
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(codes_ptr + rows64[:, None] * stride_cn + (k0 // 2 + j)[None, :],
                             mask=row_ok[:, None], other=0)
            x_even = tl.load(x_ptr + k0 + 2 * j).to(tl.float32)
            x_odd = tl.load(x_ptr + k0 + 2 * j + 1).to(tl.float32)
            lo = (packed & 0xF).to(tl.float32)
            hi = (packed >> 4).to(tl.float32)
            prod = lo * x_even[None, :] + hi * x_odd[None, :]         # [BLOCK_N, BLOCK_K/2]
            xu = tl.sum(tl.reshape(prod, (BLOCK_N, PER_CHUNK, SUB // 2)), 2)
            xs = tl.sum(tl.reshape(x_even + x_odd, (PER_CHUNK, SUB // 2)), 1)
        else:
            k = tl.arange(0, BLOCK_K)
            u = tl.load(codes_ptr + rows64[:, None] * stride_cn + (k0 + k)[None, :],
                        mask=row_ok[:, None], other=0).to(tl.float32)
            x = tl.load(x_ptr + k0 + k).to(tl.float32)
            xu = tl.sum(tl.reshape(u * x[None, :], (BLOCK_N, PER_CHUNK, SUB)), 2)
            xs = tl.sum(tl.reshape(x, (PER_CHUNK, SUB)), 1)
        # The PER_CHUNK groups this chunk touches (one when the group spans several chunks).
        group = (k0 + tl.arange(0, PER_CHUNK) * SUB) // GROUP
        sidx = rows64[:, None] * stride_sn + group[None, :]
        s = tl.load(scales_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        else:
            z = implicit_zero
        acc += tl.sum(s * (xu - z * xs[None, :]), 1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)
    else:  # y is fp32 and zeroed
        tl.atomic_add(y_ptr + rows, acc, mask=row_ok, sem="relaxed")


@triton.jit
def _gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, y_ptr,
    M, N, K, stride_xm, stride_cn, stride_sn, stride_ym,
    implicit_zero,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # BLOCK_K divides GROUP here: each chunk lies in one group, so one scale per column.
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    n64 = n.to(tl.int64)
    chunks = K // BLOCK_K
    per_split = tl.cdiv(chunks, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, chunks)):
        k0 = c * BLOCK_K
        x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(codes_ptr + n64[None, :] * stride_cn + (k0 // 2 + j)[:, None],
                             mask=n_ok[None, :], other=0)                      # [BLOCK_K/2, BLOCK_N]
            x_even = tl.load(x_rows + (k0 + 2 * j)[None, :], mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + (k0 + 2 * j + 1)[None, :], mask=m_ok[:, None], other=0.0)
            # Through fp32: exact either way, and the interpreter miscasts integers to bf16.
            lo = (packed & 0xF).to(tl.float32).to(x_even.dtype)
            hi = (packed >> 4).to(tl.float32).to(x_even.dtype)
            xu = tl.dot(x_even, lo, input_precision=DOT_PRECISION)
            xu = tl.dot(x_odd, hi, acc=xu, input_precision=DOT_PRECISION)
            xs = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), 1)
        else:
            k = tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + (k0 + k)[None, :], mask=m_ok[:, None], other=0.0)
            u = tl.load(codes_ptr + n64[None, :] * stride_cn + (k0 + k)[:, None],
                        mask=n_ok[None, :], other=0).to(tl.float32).to(x.dtype)  # [BLOCK_K, BLOCK_N]
            xu = tl.dot(x, u, input_precision=DOT_PRECISION)
            xs = tl.sum(x.to(tl.float32), 1)
        sidx = n64 * stride_sn + k0 // GROUP
        s = tl.load(scales_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            z = implicit_zero
        acc += s[None, :] * (xu - xs[:, None] * z)
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


def _gemv_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [triton.Config({"BLOCK_N": 16})]
    # Short strips make many programs (8192 rows / 16 = 512, about four per SM), each
    # streaming 128-byte runs of codes per row through a 3-4 stage load pipeline.
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn, w, st in [(8, 2, 4), (16, 4, 3), (16, 4, 4), (32, 4, 3), (32, 8, 4), (64, 8, 3)]]


def _gemm_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in [(16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 8, 3),
                                  (64, 64, 4, 3), (64, 128, 8, 3)]]


_KEY = ["N", "K", "BITS", "GROUP", "HAS_ZEROS", "SPLIT_K", "BLOCK_K"]
# reset_to_zero: autotuning runs the kernel once per config; split-K atomics must start from 0.
_gemv = triton.autotune(_gemv_configs(), key=_KEY + ["SUB"], reset_to_zero=["y_ptr"])(_gemv_kernel)
_gemm = triton.autotune(_gemm_configs(), key=_KEY + ["M"], reset_to_zero=["y_ptr"])(_gemm_kernel)


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if backend.on_gpu() else 4


def split_k_for(tiles: int, chunks: int) -> int:
    """K splits so that ``tiles`` output tiles become at least two programs per SM.

    With enough tiles already (the usual case: 8192 rows in strips of 16), 1: no atomics,
    no zeroing, no cast. The interpreter always splits in two, so the tests cover both paths.
    """
    if not backend.on_gpu():
        return min(2, chunks)
    return max(1, min(8, chunks, triton.cdiv(2 * _num_sms(), tiles)))


def _largest_pow2_dividing(n: int) -> int:
    return n & -n


def gemv_block_k(bits: int, group_size: int) -> int:
    """The K chunk of the GEMV: 128 bytes of codes per row, fitted to the group size.

    A chunk either holds whole groups (``group_size`` a power of two up to the chunk) or
    lies inside one group; either way it divides K, so no K mask is needed.
    """
    target = backend.pick(cpu=32, gpu=1024 // bits)
    if group_size & (group_size - 1) == 0 and group_size <= target:
        return target
    return min(target, _largest_pow2_dividing(group_size))


def gemm_block_k(bits: int, group_size: int) -> int:
    """The K chunk of the GEMM: inside one group (group sizes are multiples of 32, so INT4's
    half-chunks are at least the 16 that ``tl.dot`` needs)."""
    return min(backend.pick(cpu=32, gpu=64), _largest_pow2_dividing(group_size))


def dequant_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Launch on validated inputs (see :func:`labkit.quant.dequant_matmul`): ``x`` ``[M, K]`` contiguous."""
    m, k = x.shape
    n = qw.codes.shape[0]
    zeros = qw.zeros if qw.zeros is not None else qw.scales  # never read without HAS_ZEROS
    common = dict(BITS=qw.bits, GROUP=qw.group_size, HAS_ZEROS=qw.zeros is not None)
    implicit_zero = float(2 ** (qw.bits - 1))
    if m == 1:
        block_k = gemv_block_k(qw.bits, qw.group_size)
        split = split_k_for(triton.cdiv(n, 16), k // block_k)
        y = _output(m, n, x, split)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
        _gemv[grid](x, qw.codes, qw.scales, zeros, y, n, k, qw.codes.stride(0), qw.scales.stride(0),
                    implicit_zero, SUB=min(qw.group_size, block_k), BLOCK_K=block_k, SPLIT_K=split, **common)
    else:
        block_k = gemm_block_k(qw.bits, qw.group_size)
        split = split_k_for(triton.cdiv(m, 64) * triton.cdiv(n, 64), k // block_k)
        y = _output(m, n, x, split)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
        _gemm[grid](x, qw.codes, qw.scales, zeros, y, m, n, k, x.stride(0), qw.codes.stride(0),
                    qw.scales.stride(0), y.stride(0), implicit_zero, BLOCK_K=block_k, SPLIT_K=split,
                    DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _output(m: int, n: int, x: torch.Tensor, split: int) -> torch.Tensor:
    """The final output when one program owns each element; a zeroed fp32 buffer for split-K atomics."""
    if split == 1:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    return torch.zeros(m, n, dtype=torch.float32, device=x.device)
