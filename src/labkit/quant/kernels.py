"""Weight-only dequantizing matmuls ``y = x @ dequant(W)^T`` in Triton: a GEMV and a small GEMM.

At batch 1 a linear layer is a streaming read of its weight: every weight byte is used
once, for one multiply-add. So the kernel's job is to read the packed codes at the copy
bandwidth and do the unpacking in the shadow of that read. Both kernels here:

- own a strip of output rows and loop over K in ``BLOCK_K`` chunks, loading each row's
  codes as one contiguous run of bytes (INT4: ``BLOCK_K / 2`` bytes, two codes each;
  INT8: ``BLOCK_K`` bytes);
- never build the dequantized weight. With ``w = (u - z) * s`` constant over a group,
  ``sum_k x_k w_k = s * (sum_k x_k u_k - z * sum_k x_k)`` over each group: the raw codes
  meet ``x`` directly, and the scale and zero point are applied once per (row, group);
- turn codes into floats without a conversion instruction. Integer-to-float conversion
  has a fraction of the fp32 FMA's throughput (the CUDA programming guide's table of
  arithmetic instruction throughput), and at batch 1 there would be one per weight.
  Instead a code ``u < 2^m`` is OR-ed into the
  mantissa of a float whose exponent makes the mantissa's last bit worth 1, which *is*
  ``offset + u`` exactly (:func:`_codes_as_float`); the offset is subtracted once per
  group with the zero point;
- at batch 1, read the codes either as bytes or as int32 words (``CODE_WORDS``:
  :func:`_chunk_dot_words`, one shift and one AND-OR per code, no subtraction per weight, and
  one reduction across threads after the last chunk instead of one per chunk); the
  autotuner times both for each strip configuration;
- split K across ``SPLIT_K`` programs only when the output tiles are too few to fill
  the GPU (:func:`split_k_for`), adding their fp32 partial sums with an atomic into an
  fp32 buffer that the launcher zeroes and casts. Otherwise each program stores its
  rows, cast to the output dtype, and nothing else is launched: at batch 1 the whole
  matmul takes tens of microseconds, so a zeroing kernel and a cast kernel would be a
  visible share of it.

The INT4 nibble order (element ``2j`` in the low nibble of byte ``j``) lets a kernel avoid
interleaving: the low nibbles meet ``x``'s even elements and the high nibbles the odd ones.

:func:`_gemv_kernel` serves batch 1 with fp32 multiply-and-sum (a tensor-core tile would
be 15/16 padding). :func:`_gemm_kernel` serves batches of 2 to a few dozen with ``tl.dot``
on integer-valued codes, exact in bf16/fp16 (every ``offset + u`` it forms is an integer
below 2^8 in bf16, 2^11 in fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import backend
from .reference import QuantizedWeight


@triton.jit
def _codes_as_float(u, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """``u + OFFSET`` in ``DTYPE`` for integer codes ``u`` (int32, ``0 <= u < 2^BITS``), exactly.

    The matching ``OFFSET`` is :func:`_code_offset`'s. In fp32 the magic float is
    ``0x4B000000`` = 2^23, whose mantissa's last bit is worth 1: ``OR u`` makes 2^23 + u,
    and one subtraction leaves u. 4-bit codes in bf16/fp16 keep their magic number as the
    offset: bf16 ``0x4300`` is 128 with a 7-bit mantissa, fp16 ``0x6400`` is 1024 with a
    10-bit one, so ``OR u`` is the whole job.
    """
    if DTYPE == tl.float32:
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    elif BITS == 4 and DTYPE == tl.bfloat16:
        return (u.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    elif BITS == 4:
        return (u.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    else:  # 8-bit codes exceed a bf16 mantissa: centre them on 0, where |u - 128| <= 128 is exact
        return ((u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + 128.0)).to(DTYPE)


@triton.jit
def _code_offset(DTYPE: tl.constexpr, BITS: tl.constexpr):
    if DTYPE == tl.float32:
        return 0.0
    elif BITS == 4 and DTYPE == tl.bfloat16:
        return 128.0
    elif BITS == 4:
        return 1024.0
    else:
        return -128.0


@triton.jit
def _word_code_as_float(words, j: tl.constexpr, BITS: tl.constexpr):
    """Code ``j`` of each int32 word (bits ``[BITS*j, BITS*(j+1))``) as the float32 ``OFFSET + u``.

    A float whose exponent makes mantissa bit ``P`` worth 1 is ``OFFSET + (bits above P)``:
    ``0x43000000`` is 128 with bit 16 worth 1 (4-bit codes), ``0x43800000`` is 256 with bit
    15 worth 1 (8-bit codes, bits 15-22). So one shift moves the code to bit ``P`` and one
    AND-OR (a single ``lop3``) keeps it and writes the exponent: two integer instructions
    per weight, none for the code already in place, and no subtraction (the offset leaves
    with the zero point, once per group).
    """
    P: tl.constexpr = 16 if BITS == 4 else 15
    SHIFT: tl.constexpr = BITS * j - P
    if SHIFT < 0:
        moved = words << -SHIFT
    elif SHIFT > 0:
        moved = words >> SHIFT  # arithmetic: the sign bits it brings in are masked off
    else:
        moved = words
    magic = 0x43000000 if BITS == 4 else 0x43800000
    return ((moved & (((1 << BITS) - 1) << P)) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _add_code(xu, xs, words, j: tl.constexpr, x, z, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
              OFFSET: tl.constexpr, EXACT_CODES: tl.constexpr):
    """One code of every word times its input: ``xu += (OFFSET + u) x`` and ``xs += x``, or,
    with ``EXACT_CODES``, ``xu += (u - z) x``."""
    code = _word_code_as_float(words, j, BITS)
    if EXACT_CODES:
        if HAS_ZEROS:
            code -= (OFFSET + z)[:, :, None]
        else:  # the implicit zero point of symmetric formats: a scalar
            code -= OFFSET + z
    else:
        xs += x
    return xu + code * x[None, :, :], xs


@triton.jit
def _chunk_codes(row_codes, rows_wanted, k0, grp, BITS: tl.constexpr, SUB: tl.constexpr,
                 CODE_WORDS: tl.constexpr):
    """One chunk's codes for the strip's rows where ``rows_wanted`` (zeros elsewhere), as
    stored: ``[BLOCK_N, PER_CHUNK, n]`` int32 words (``CODE_WORDS``, ``n = SUB * BITS / 32``)
    or bytes (``n = SUB * BITS / 8``), each group's along the last axis."""
    if CODE_WORDS:
        PER_WORD: tl.constexpr = 32 // BITS
        index = k0 // PER_WORD + grp[:, None] * (SUB // PER_WORD) + tl.arange(0, SUB // PER_WORD)[None, :]
    elif BITS == 4:
        index = k0 // 2 + grp[:, None] * (SUB // 2) + tl.arange(0, SUB // 2)[None, :]
    else:
        index = k0 + grp[:, None] * SUB + tl.arange(0, SUB)[None, :]
    return tl.load(row_codes + index[None, :, :], mask=rows_wanted[:, None, None], other=0)


@triton.jit
def _chunk_dot_words(words, x_ptr, x_pairs, k0, grp, z, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     SUB: tl.constexpr, PER_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, X_BF16_PAIRS: tl.constexpr):
    """``x (u - z)`` of one chunk, summed over the codes of each word: ``[BLOCK_N, PER_CHUNK, WORDS]``,
    each group's words along the last axis, from the chunk's codes read as int32 words
    (:func:`_chunk_codes`).

    Word ``c`` of a row holds inputs ``c * PER_WORD`` to ``c * PER_WORD + PER_WORD - 1``, code
    ``j`` in bits ``BITS * j`` onwards (the packing is little-endian). Each code becomes
    ``OFFSET + u`` (:func:`_word_code_as_float`) and meets its input in one FMA; per group,
    ``sum x (u - z) = sum x (OFFSET + u) - (OFFSET + z) sum x``, and ``sum x`` is shared by
    every row of the strip. The caller scales and accumulates the result as it is, and sums
    it over words and groups once, after the last chunk: no reduction across threads (and
    no barrier) per chunk. The products are exact in fp32 (a bf16 or fp16 input times a
    9-bit integer), and the subtraction costs about log2(OFFSET / |u - z|) of fp32's 24 bits.
    An fp32 input's products are not exact, so fp32 inputs (the tests' exact reference
    runs) subtract ``OFFSET + z`` from each code instead, which is exact.
    """
    EXACT_CODES: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
    OFFSET: tl.constexpr = 128.0 if BITS == 4 else 256.0
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = SUB // PER_WORD
    word = k0 // PER_WORD + grp[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [PER_CHUNK, WORDS]
    xu = tl.zeros([BLOCK_N, PER_CHUNK, WORDS], tl.float32)
    xs = tl.zeros([PER_CHUNK, WORDS], tl.float32)
    for i in tl.static_range(PER_WORD // 2):  # codes 2i and 2i + 1 meet inputs k and k + 1
        k = word * PER_WORD + 2 * i
        if X_BF16_PAIRS:
            pair = tl.load(x_pairs + k // 2)
            x_lo = (pair << 16).to(tl.float32, bitcast=True)
            x_hi = (pair & -65536).to(tl.float32, bitcast=True)
        else:
            x_lo = tl.load(x_ptr + k).to(tl.float32)
            x_hi = tl.load(x_ptr + k + 1).to(tl.float32)
        xu, xs = _add_code(xu, xs, words, 2 * i, x_lo, z, BITS, HAS_ZEROS, OFFSET, EXACT_CODES)
        xu, xs = _add_code(xu, xs, words, 2 * i + 1, x_hi, z, BITS, HAS_ZEROS, OFFSET, EXACT_CODES)
    if not EXACT_CODES:
        if HAS_ZEROS:
            xu -= (OFFSET + z)[:, :, None] * xs[None, :, :]
        else:
            xu -= (OFFSET + z) * xs[None, :, :]
    return xu


# Symmetric INT4's zero point, 8, as the bf16x2 pair (128 + 8, 128 + 8): 136 is bf16 0x4308.
_SYMMETRIC_INT4_PAIR = tl.constexpr(0x43084308)


@triton.jit
def _prmt(a, b, SELECT: tl.constexpr):
    """PTX ``prmt``: four bytes picked from the eight of ``a`` (bytes 0-3) and ``b`` (4-7) by
    ``SELECT``'s nibbles; ``0x5410`` joins the low halves, ``0x7632`` the high halves."""
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECT};", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _word_dot_bf16x2(words, x04, x15, x26, x37, zero_pair):
    """The eight INT4 codes of each int32 word times their inputs, as a bf16x2 pair of sums.

    Word bits ``4i`` to ``4i + 3`` hold code ``i`` (input ``i`` of the word). One lop3 per
    pair, ``(word >> 4i) & 0x000F000F | 0x43004300``, makes the bf16x2 (128 + u_i, 128 +
    u_(i+4)); one ``sub.bf16x2`` of ``zero_pair`` (128 + z in each half) leaves (u - z) exactly;
    one ``fma.bf16x2`` multiplies the pair by its inputs ``x_(i, i+4)`` and adds: the low
    half sums inputs 0-3 of the word, the high half inputs 4-7. Eight weights in fifteen
    instructions; each product and sum is rounded to bf16, where the other paths round
    nothing before fp32.
    """
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t0, t1, t2, t3, s;
        lop3.b32 t0, $1, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $1, 4;
        lop3.b32 t1, s, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $1, 8;
        lop3.b32 t2, s, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $1, 12;
        lop3.b32 t3, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 t0, t0, $6;
        sub.rn.bf16x2 t1, t1, $6;
        sub.rn.bf16x2 t2, t2, $6;
        sub.rn.bf16x2 t3, t3, $6;
        mul.rn.bf16x2 t0, t0, $2;
        fma.rn.bf16x2 t0, t1, $3, t0;
        fma.rn.bf16x2 t0, t2, $4, t0;
        fma.rn.bf16x2 $0, t3, $5, t0;
        }""", "=r,r,r,r,r,r,r", [words, x04, x15, x26, x37, zero_pair], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _chunk_dot_packed(words, x_pairs, k0, grp, z, HAS_ZEROS: tl.constexpr, SUB: tl.constexpr,
                      PER_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """``x (u - z)`` of one chunk of INT4 codes read as int32 words, summed over each word:
    ``[BLOCK_N, PER_CHUNK, WORDS]`` in fp32, as :func:`_chunk_dot_words` returns, but with two
    weights an instruction (:func:`_word_dot_bf16x2`). bf16 inputs only, and GPU only:
    Triton's interpreter cannot run inline PTX.

    A word's pairs are inputs (i, i + 4), so the inputs are paired the same way, once per
    word column (``prmt`` of the word's first and third input pairs, and of its second and
    fourth), and shared by every row of the strip.
    """
    WORDS: tl.constexpr = SUB // 8
    word = k0 // 8 + grp[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [PER_CHUNK, WORDS]
    x01 = tl.load(x_pairs + 4 * word)
    x23 = tl.load(x_pairs + 4 * word + 1)
    x45 = tl.load(x_pairs + 4 * word + 2)
    x67 = tl.load(x_pairs + 4 * word + 3)
    if HAS_ZEROS:  # 128 + z is an integer below 144: exact in bf16, whose bits fill both halves
        half = (128.0 + z).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        zero_pair = tl.broadcast_to((half | (half << 16))[:, :, None], [BLOCK_N, PER_CHUNK, WORDS])
    else:
        zero_pair = tl.full([BLOCK_N, PER_CHUNK, WORDS], _SYMMETRIC_INT4_PAIR, tl.int32)
    sums = _word_dot_bf16x2(words, _prmt(x01, x45, 0x5410)[None, :, :], _prmt(x01, x45, 0x7632)[None, :, :],
                            _prmt(x23, x67, 0x5410)[None, :, :], _prmt(x23, x67, 0x7632)[None, :, :], zero_pair)
    # A bf16 is the top half of the fp32 it stands for.
    return (sums << 16).to(tl.float32, bitcast=True) + (sums & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, y_ptr,
    codes_desc,              # TMA: the codes as int32 words [N, K / SUB, SUB * BITS / 32], boxed by chunk
    N, K, stride_cn, stride_sn,
    implicit_zero,           # 2^(bits-1): the zero point of symmetric formats
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SUB: tl.constexpr,       # inputs per scale inside one chunk: min(GROUP, BLOCK_K)
    CODE_WORDS: tl.constexpr,  # read the codes as int32 words (32 / BITS codes each): _chunk_dot_words
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # load the next chunk's codes before working on this one's
    LOOP_STAGES: tl.constexpr = 1,   # software-pipeline the K loop this deep (tl.range's num_stages)
    PACKED: tl.constexpr = False,    # CODE_WORDS of INT4 with bf16 inputs, two weights an instruction
    TMA: tl.constexpr = False,       # CODE_WORDS read by the Tensor Memory Accelerator, LOOP_STAGES deep
    TMA_OK: tl.constexpr = False,    # codes_desc is a descriptor (an autotuning key: see _GEMV_KEY)
):
    tl.static_assert(TMA_OK or not TMA, "a TMA launch needs the codes as a descriptor")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)  # 28672 rows x 8192 bytes passes 2^31
    PER_CHUNK: tl.constexpr = BLOCK_K // SUB   # scales one chunk spans
    # A chunk is a [rows, scale groups, inputs per group] tile, so each group's sum is a
    # reduction over the last axis (no reshape, which would shuffle registers).
    grp = tl.arange(0, PER_CHUNK)
    chunks = K // BLOCK_K                      # the launcher makes BLOCK_K divide K
    per_split = tl.cdiv(chunks, SPLIT_K)
    acc = tl.zeros([BLOCK_N, PER_CHUNK], tl.float32)
    acc_words = tl.zeros([BLOCK_N, PER_CHUNK, SUB * BITS // 32], tl.float32)  # CODE_WORDS: reduced at the end
    # bf16 inputs are read two at a time, as int32 words: x[2i] in the low half, x[2i+1] in
    # the high half. A bf16 is the top half of the float32 it stands for, so a shift or a mask
    # widens each, where strided 2-byte loads would cost a load per input.
    X_BF16_PAIRS: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32))
    if CODE_WORDS:  # check_quantized saw the codes start on a 4-byte boundary; rows are K/2 or K bytes, K % 32 == 0
        row_codes = codes_ptr.to(tl.pointer_type(tl.int32)) + rows64[:, None, None] * (stride_cn // 4)
    else:
        row_codes = codes_ptr + rows64[:, None, None] * stride_cn
    first = pid_k * per_split
    end = tl.minimum(first + per_split, chunks)
    # A kernel's num_stages pipelines only the loads that feed a tl.dot, and this loop has
    # none: left alone, each chunk's loads are issued and waited for in its own iteration,
    # with nothing in flight while its arithmetic runs. Three ways to keep loads in flight:
    # LOOP_STAGES > 1 asks Triton to pipeline this loop's loads (tl.range's num_stages:
    # asynchronous copies into shared memory, LOOP_STAGES - 1 chunks ahead); with TMA the
    # codes' copies are the Tensor Memory Accelerator's, one instruction a chunk for the whole
    # strip instead of one per 16 bytes a thread; and PREFETCH double-buffers the codes in
    # registers (the next chunk's loads issued before this chunk's arithmetic). The autotuner
    # times each, and none.
    if PREFETCH:
        # (rows < N, or no rows past the split's last chunk; a comparison, not `row_ok & scalar`,
        # which Triton's interpreter refuses as a mask)
        codes_next = _chunk_codes(row_codes, rows < tl.where(first < end, N, 0), first * BLOCK_K, grp,
                                  BITS, SUB, CODE_WORDS)
    for c in tl.range(first, end, num_stages=LOOP_STAGES):
        k0 = c * BLOCK_K
        if PREFETCH:
            codes = codes_next
            codes_next = _chunk_codes(row_codes, rows < tl.where(c + 1 < end, N, 0), k0 + BLOCK_K, grp,
                                      BITS, SUB, CODE_WORDS)
        elif TMA:  # rows past N come back as zeros, and their sums are never stored
            codes = codes_desc.load([pid_n * BLOCK_N, c * PER_CHUNK, 0])
        else:
            codes = _chunk_codes(row_codes, row_ok, k0, grp, BITS, SUB, CODE_WORDS)
        # The PER_CHUNK groups this chunk touches (one when the group spans several chunks).
        group = (k0 + grp * SUB) // GROUP
        sidx = rows64[:, None] * stride_sn + group[None, :]
        s = tl.load(scales_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        else:
            z = implicit_zero
        if PACKED:
            acc_words += s[:, :, None] * _chunk_dot_packed(codes, x_pairs, k0, grp, z, HAS_ZEROS, SUB, PER_CHUNK,
                                                           BLOCK_N)
        elif CODE_WORDS:
            acc_words += s[:, :, None] * _chunk_dot_words(codes, x_ptr, x_pairs, k0, grp, z, BITS,
                                                          HAS_ZEROS, SUB, PER_CHUNK, BLOCK_N, X_BF16_PAIRS)
        else:
            # OR-ing a code into 2^23's mantissa and subtracting 2^23 + z gives u - z exactly:
            # the zero point costs nothing extra, and sum(x) is never needed.
            if HAS_ZEROS:
                magic_z = (8388608.0 + z)[:, :, None]
            else:
                magic_z = 8388608.0 + z
            if BITS == 4:
                j = tl.arange(0, SUB // 2)
                byte = k0 // 2 + grp[:, None] * (SUB // 2) + j[None, :]            # [PER_CHUNK, SUB/2]
                packed = codes.to(tl.int32)
                if X_BF16_PAIRS:  # byte j's two codes meet x[2j] and x[2j+1]: one word
                    pair = tl.load(x_pairs + byte)
                    x_even = (pair << 16).to(tl.float32, bitcast=True)
                    x_odd = (pair & -65536).to(tl.float32, bitcast=True)
                else:
                    x_even = tl.load(x_ptr + 2 * byte).to(tl.float32)
                    x_odd = tl.load(x_ptr + 2 * byte + 1).to(tl.float32)
                lo = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - magic_z
                hi = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - magic_z
                xw = tl.sum(lo * x_even[None, :, :] + hi * x_odd[None, :, :], 2)  # [BLOCK_N, PER_CHUNK]
            else:
                k = k0 + grp[:, None] * SUB + tl.arange(0, SUB)[None, :]
                u = codes.to(tl.int32)
                x = tl.load(x_ptr + k).to(tl.float32)
                xw = tl.sum(((u | 0x4B000000).to(tl.float32, bitcast=True) - magic_z) * x[None, :, :], 2)
            acc += s * xw
    if CODE_WORDS:
        out = tl.sum(tl.sum(acc_words, 2), 1)
    else:
        out = tl.sum(acc, 1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=row_ok)
    else:  # y is fp32 and zeroed
        tl.atomic_add(y_ptr + rows, out, mask=row_ok, sem="relaxed")


@triton.jit
def _gemm_chunk_loads(row_codes, x_rows, c, rows_wanted, x_rows_wanted, BLOCK_K: tl.constexpr,
                      CODE_BYTES: tl.constexpr):
    """Chunk ``c``'s codes ``[BLOCK_N, CODE_BYTES]`` for the rows where ``rows_wanted``, and its
    inputs ``[BLOCK_M, BLOCK_K]`` for the rows of x where ``x_rows_wanted``, each row one
    contiguous run (:func:`_gemm_kernel` says why)."""
    codes = tl.load(row_codes + c * CODE_BYTES, mask=rows_wanted[:, None], other=0)
    x = tl.load(x_rows + c * BLOCK_K, mask=x_rows_wanted[:, None], other=0.0)
    return codes, x


@triton.jit
def _gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, y_ptr,
    M, N, K, stride_xm, stride_cn, stride_sn, stride_ym,
    implicit_zero,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # load the next chunk's codes before working on this one's
):
    """``y^T = W x^T`` tile by tile: the weight is the dot's *first* operand.

    A tensor-core MMA's first operand may come straight from registers, where the codes
    were just turned into floats; the second must be staged through shared memory. So the
    large operand, the weight, goes first, and the few activation rows second, which also
    lets BLOCK_N (the MMA's 64-row side) be the big one while BLOCK_M stays at 16.
    BLOCK_K divides GROUP here: each chunk lies in one group, so one scale per row of W.
    """
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    n64 = n.to(tl.int64)
    chunks = K // BLOCK_K
    per_split = tl.cdiv(chunks, SPLIT_K)
    # x is read a chunk at a time as [BLOCK_M, BLOCK_K], each row one contiguous run of inputs.
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    offset = _code_offset(dtype, BITS)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # Triton's pipeliner turns the K loop's loads that feed a dot into asynchronous copies
    # issued stages ahead, through arithmetic or not: INT4's codes through the nibble
    # arithmetic, INT8's through a cast, and x through the split below. INT4's even and odd
    # inputs read apart, with a stride of two inputs, would be 2-byte loads, and an
    # asynchronous copy moves at least 4 bytes: they stayed plain loads, waited for in their
    # own iteration (the quantization chapter counts both kinds in the sm_90 code). So x is
    # read whole and split in registers.
    # PREFETCH double-buffers a chunk's codes and inputs in registers instead, as the GEMV
    # does: the next chunk's loads are issued before this chunk's arithmetic. (The
    # loop-carried registers take the loop out of the pipeliner's hands.)
    CODE_BYTES: tl.constexpr = BLOCK_K * BITS // 8
    row_codes = codes_ptr + n64[:, None] * stride_cn + tl.arange(0, CODE_BYTES)[None, :]
    first = pid_k * per_split
    end = tl.minimum(first + per_split, chunks)
    if PREFETCH:  # nothing is loaded for a chunk past the split's last (a comparison: see _gemv_kernel)
        codes_next, x_next = _gemm_chunk_loads(row_codes, x_rows, first, n < tl.where(first < end, N, 0),
                                               m < tl.where(first < end, M, 0), BLOCK_K, CODE_BYTES)
    for c in range(first, end):
        k0 = c * BLOCK_K
        if PREFETCH:
            codes, x = codes_next, x_next
            codes_next, x_next = _gemm_chunk_loads(row_codes, x_rows, c + 1, n < tl.where(c + 1 < end, N, 0),
                                                   m < tl.where(c + 1 < end, M, 0), BLOCK_K, CODE_BYTES)
        else:
            codes, x = _gemm_chunk_loads(row_codes, x_rows, c, n_ok, m_ok, BLOCK_K, CODE_BYTES)
        if BITS == 4:  # the low nibbles meet x's even inputs, the high nibbles its odd ones
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
            packed = codes.to(tl.int32)                                          # [BLOCK_N, BLOCK_K/2]
            uw = tl.dot(_codes_as_float(packed & 0xF, dtype, BITS), tl.trans(x_even),
                        input_precision=DOT_PRECISION)
            uw = tl.dot(_codes_as_float(packed >> 4, dtype, BITS), tl.trans(x_odd), acc=uw,
                        input_precision=DOT_PRECISION)
        else:
            uw = tl.dot(_codes_as_float(codes.to(tl.int32), dtype, BITS), tl.trans(x),
                        input_precision=DOT_PRECISION)
        xs = tl.sum(x.to(tl.float32), 1)
        sidx = n64 * stride_sn + k0 // GROUP
        s = tl.load(scales_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)[:, None] + offset
        else:
            z = implicit_zero + offset
        acc += s[:, None] * (uw - z * xs[None, :])
    out = y_ptr + m[None, :].to(tl.int64) * stride_ym + n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


def gemv_config(block_n: int, *, code_words: bool, prefetch: bool = False, loop_stages: int = 1,
                num_warps: int = 4, packed: bool = False, tma: bool = False) -> triton.Config:
    """One launch of the GEMV: ``block_n`` rows a program, codes read as bytes or as int32 words
    (and with ``packed``, INT4 words multiplied two weights at a time in bf16x2: GPU only, bf16
    inputs), and loads kept in flight by a register double buffer (``prefetch``), by Triton's
    pipelining of the K loop (``loop_stages`` > 1: asynchronous copies, or with ``tma`` the
    words copied by the Tensor Memory Accelerator), or not at all (pass it to
    :func:`dequant_matmul`'s ``gemv_config``)."""
    if prefetch and loop_stages > 1:
        raise ValueError("prefetch and loop_stages > 1 are two ways to do one thing: pick one")
    if packed and not code_words:
        raise ValueError("packed reads the codes as int32 words: it needs code_words=True")
    if tma and not (code_words and loop_stages > 1):
        raise ValueError("tma copies int32 words loop_stages - 1 chunks ahead: it needs code_words=True and "
                         f"loop_stages > 1, got code_words={code_words}, loop_stages={loop_stages}")
    return triton.Config({"BLOCK_N": block_n, "CODE_WORDS": code_words, "PREFETCH": prefetch,
                          "LOOP_STAGES": loop_stages, "PACKED": packed, "TMA": tma}, num_warps=num_warps,
                         pre_hook=fit_codes_box)


def fit_codes_box(nargs: dict) -> None:
    """A TMA copy's box is part of its descriptor: the codes' box follows the launch's strip."""
    if nargs.get("TMA"):
        box = nargs["codes_desc"].block_shape
        nargs["codes_desc"].block_shape = [nargs["BLOCK_N"], *box[1:]]


def _gemv_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [gemv_config(16, code_words=True)]
    return [gemv_config(bn, code_words=words, prefetch=prefetch, loop_stages=stages, num_warps=w, packed=packed,
                        tma=tma)
            for bn, w in GEMV_STRIPS for words, packed in GEMV_CODE_READS
            for prefetch, stages, tma in GEMV_LOADS_AHEAD if words or not tma]


def packed_unsupported(bits: int, x_dtype: torch.dtype) -> str | None:
    """Why the bf16x2 GEMV (``PACKED``) cannot serve these codes and inputs, or None if it can."""
    if not backend.on_gpu():
        return "it runs inline PTX, which Triton's interpreter cannot run: it needs a CUDA GPU"
    if bits != 4:
        return f"it unpacks 4-bit codes (bf16 holds 128 + u exactly only for u < 128), got {bits}-bit"
    if x_dtype != torch.bfloat16:
        return f"it multiplies in bf16x2: x must be bfloat16, got {x_dtype}"
    return None


def tma_unsupported(codes: torch.Tensor) -> str | None:
    """Why the Tensor Memory Accelerator cannot copy these codes (a [N, K/2] or [N, K] uint8 tensor),
    or None if it can."""
    if codes.device.type == "cuda" and torch.cuda.get_device_capability(codes.device)[0] < 9:
        return "TMA copies need a Hopper GPU or later (compute capability 9.0)"
    if codes.data_ptr() % 16:
        return f"a TMA copy starts on a 16-byte boundary; the codes start at byte {codes.data_ptr() % 16} of one"
    return None


def tma_box_unsupported(block_n: int, block_k: int, bits: int) -> str | None:
    """Why a TMA launch of ``block_n`` rows cannot copy chunks of ``block_k`` ``bits``-bit codes,
    or None if it can. A TMA copy writes its box to shared memory starting on a 128-byte boundary,
    and the pipelined loop keeps one box a stage (presumably back to back): a box of a multiple of
    128 bytes keeps every stage on one. On an H100, every TMA launch of 4 rows at a 32-input chunk
    of INT4 codes (64-byte boxes) failed with a misaligned address; 8 and 16 rows ran."""
    box = block_n * block_k * bits // 8
    if box % 128:
        return (f"a TMA box of {block_n} rows x {block_k} {bits}-bit codes is {box} bytes; each stage's box "
                "starts on a 128-byte boundary only if the box is a multiple of 128 bytes")
    return None


def _applicable(configs, bits: int, x_dtype: torch.dtype, tma_ok: bool, block_k: int) -> list[triton.Config]:
    packed_ok = packed_unsupported(bits, x_dtype) is None
    return [c for c in configs if (packed_ok or not c.kwargs.get("PACKED"))
            and (not c.kwargs.get("TMA") or tma_ok and tma_box_unsupported(c.kwargs["BLOCK_N"], block_k, bits) is None)]


def prune_gemv_configs(configs, named_args, **kwargs):
    """The bf16x2 configs only where they apply (:func:`packed_unsupported`), and the TMA ones
    only where the launcher made the codes a descriptor (:func:`tma_unsupported`) and the strip's
    box fits (:func:`tma_box_unsupported`)."""
    # Triton's autotuner hands the pruner the positional arguments as named_args and the named
    # ones as kwargs; the launcher passes every argument by name.
    args = {**named_args, **kwargs}
    return _applicable(configs, args["BITS"], args["x_ptr"].dtype, args["codes_desc"] is not None, args["BLOCK_K"])


def gemv_launches(qw: QuantizedWeight, x_dtype: torch.dtype) -> list[triton.Config]:
    """Every launch the GEMV's autotuner times for ``qw`` and ``x_dtype`` inputs (each can be
    passed to :func:`dequant_matmul`'s ``gemv_config``)."""
    return _applicable(_gemv_configs(), qw.bits, x_dtype, tma_unsupported(qw.codes) is None,
                       gemv_block_k(qw.shape[1], qw.group_size))


def gemv_autotuned(qw: QuantizedWeight) -> triton.Config | None:
    """The launch the GEMV's autotuner chose for ``qw`` (its shape, bits, group and zero points),
    or None before its first call for such a weight."""
    if len(_gemv.configs) == 1:  # nothing to choose among (the interpreter's one launch): no cache kept
        return _gemv.configs[0]
    n, k = qw.codes.shape[0], qw.codes.shape[1] * 8 // qw.bits
    wanted = (n, k, qw.bits, qw.group_size, qw.zeros is not None)  # the head of _KEY
    tma_ok = tma_unsupported(qw.codes) is None
    at = _GEMV_KEY.index("TMA_OK")
    return next((config for key, config in _gemv.cache.items() if tuple(key[:5]) == wanted and key[at] == tma_ok),
                None)


def gemv_code_read(launch: dict) -> str:
    """How a GEMV launch (its ``PACKED`` and ``CODE_WORDS`` fields) reads its codes: "bytes",
    "words", or "packed" (words multiplied two weights at a time in bf16x2)."""
    return "packed" if launch["PACKED"] else "words" if launch["CODE_WORDS"] else "bytes"


def gemv_loads_ahead(launch: dict) -> str:
    """How a GEMV launch (its ``PREFETCH``, ``LOOP_STAGES`` and ``TMA`` fields) keeps loads in flight
    during a chunk's arithmetic: "PREFETCH" (a register double buffer), "LOOP_STAGES n" (Triton's
    pipelining of the K loop with asynchronous copies), "TMA n" (the same, copied by the Tensor
    Memory Accelerator), or "neither"."""
    if launch["PREFETCH"]:
        return "PREFETCH"
    if launch["LOOP_STAGES"] == 1:
        return "neither"
    return f"{'TMA' if launch.get('TMA') else 'LOOP_STAGES'} {launch['LOOP_STAGES']}"


def gemm_config(block_m: int, block_n: int, *, prefetch: bool = False, num_warps: int = 4,
                num_stages: int = 1) -> triton.Config:
    """One launch of the small-batch GEMM (pass it to :func:`dequant_matmul`'s ``gemm_config``)."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": prefetch},
                         num_warps=num_warps, num_stages=num_stages)


def _gemm_configs() -> list[triton.Config]:
    if not backend.on_gpu():
        return [gemm_config(16, 16)]
    return [gemm_config(bm, bn, prefetch=prefetch, num_warps=w, num_stages=st)
            for bm, bn, w, st in GEMM_CONFIGS for prefetch in (False, True)]


# The candidates autotuning measures on a GPU: (BLOCK_N, warps) strips for the GEMV and
# (BLOCK_M, BLOCK_N, warps, stages) for the GEMM, the fastest of wider sweeps on an H200
# (bf16, 8192x8192 and 28672x8192, INT4 g128 and INT8 per channel; not recorded). The GEMV
# wants short strips of 4-16 rows: 512-7168 programs at those shapes, without splitting K.
# (Those sweeps also varied the GEMV's num_stages, which leaves its compiled loop as it is:
# the kernel says why.) Each GEMV strip is tried with the codes read as bytes and as int32
# words (:func:`_chunk_dot_words`, which came after those sweeps), and for INT4 with bf16 inputs
# as words multiplied in bf16x2 (:func:`_chunk_dot_packed`, later still), and each of those with
# the three ways of GEMV_LOADS_AHEAD.
GEMV_STRIPS = [(4, 2), (4, 4), (8, 2), (8, 4), (16, 4)]
# How the GEMV reads and multiplies its codes: (CODE_WORDS, PACKED).
GEMV_CODE_READS = [(False, False), (True, False), (True, True)]
# (PREFETCH, LOOP_STAGES, TMA): nothing in flight during a chunk's arithmetic, the next chunk's
# codes in registers, or Triton's pipelining with two chunks in flight, copied asynchronously
# by the threads or (words only) by the Tensor Memory Accelerator, two and three chunks ahead.
# The TMA launches joined after the last H200 record of quant.gemv. quant.gemv_launches, recorded
# on an H100 (7e467e5), times every candidate: for INT4 the packed words copied by TMA 3 chunks
# ahead were fastest at both shapes, 1.10-1.11x faster than the best launch without TMA; for INT8
# the fastest launches with and without TMA were within 1% of each other.
GEMV_LOADS_AHEAD = [(False, 1, False), (True, 1, False), (False, 3, False), (False, 3, True), (False, 4, True)]
GEMM_CONFIGS = [(16, 64, 4, 3), (16, 64, 4, 5), (16, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3)]
# The K chunks, in inputs. The GEMV's 1024 (512 bytes of INT4 codes per row, 1 KB of INT8)
# was those sweeps' best for both formats; the GEMM's is bounded by the group (INT4 g128),
# and for INT8 per channel 256 beat 128 and 512 there.
GEMV_CHUNK = 1024
GEMM_CHUNK = {4: 128, 8: 256}

_KEY = ["N", "K", "BITS", "GROUP", "HAS_ZEROS", "SPLIT_K", "BLOCK_K"]
# reset_to_zero: autotuning runs the kernel once per config; split-K atomics must start from 0.
# Whether the codes could be a descriptor is part of the GEMV's key, so that a TMA launch chosen
# for 16-byte-aligned codes is never reused for codes that are not.
_GEMV_KEY = _KEY + ["SUB", "TMA_OK"]
_gemv = triton.autotune(_gemv_configs(), key=_GEMV_KEY, reset_to_zero=["y_ptr"],
                        prune_configs_by={"early_config_prune": prune_gemv_configs})(_gemv_kernel)


def prune_gemm_configs(configs, named_args, **kwargs):
    """PREFETCH only for INT4: with it some INT8 tiles spill registers in the sm_90 code, and
    without it the pipeliner already issues INT8's loads stages ahead."""
    bits = kwargs.get("BITS", named_args.get("BITS"))
    return [c for c in configs if bits == 4 or not c.kwargs.get("PREFETCH")]


_gemm = triton.autotune(_gemm_configs(), key=_KEY + ["M"], reset_to_zero=["y_ptr"],
                        prune_configs_by={"early_config_prune": prune_gemm_configs})(_gemm_kernel)


def autotuned_choices() -> dict[str, dict[str, str]]:
    """What the GEMV's and the GEMM's autotuners chose so far, by key (for the benchmarks' records)."""
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in (("gemv", _gemv), ("gemm", _gemm)) if tuner.cache}


def split_k_for(tiles: int, chunks: int, programs_per_sm: int) -> int:
    """K splits (1, 2 or 4) so that ``tiles`` output tiles make about ``programs_per_sm`` programs per SM.

    With enough tiles already (the usual case for the GEMV: 8192 rows in strips of 16),
    1: no atomics, no zeroing, no cast. The interpreter always splits in two, so the tests
    cover both paths.
    """
    if not backend.on_gpu():
        return min(2, chunks)
    wanted = min(4, chunks, max(1, programs_per_sm * backend.sm_count() // tiles))
    return 1 << (wanted.bit_length() - 1)


def _largest_pow2_dividing(n: int) -> int:
    return n & -n


def _block_k(k: int, group_size: int, target: int) -> int:
    """The largest power-of-two chunk up to ``target`` that divides K and either holds whole
    groups or lies inside one: then no chunk needs a K mask or straddles a scale."""
    if group_size & (group_size - 1) == 0:
        return min(target, _largest_pow2_dividing(k))
    return min(target, _largest_pow2_dividing(group_size))


def gemv_block_k(k: int, group_size: int) -> int:
    """The GEMV's K chunk in inputs: ``GEMV_CHUNK``, fitted to K and the groups."""
    return _block_k(k, group_size, backend.pick(cpu=32, gpu=GEMV_CHUNK))


def gemm_block_k(bits: int, group_size: int) -> int:
    """The GEMM's K chunk: inside one group (group sizes are multiples of 32, so INT4's
    half-chunks are at least the 16 that ``tl.dot`` needs)."""
    return min(backend.pick(cpu=32, gpu=GEMM_CHUNK[bits]), _largest_pow2_dividing(group_size))


def dequant_matmul(x: torch.Tensor, qw: QuantizedWeight, *, gemv_config: triton.Config | None = None,
                   gemm_config: triton.Config | None = None) -> torch.Tensor:
    """Launch on validated inputs (see :func:`labkit.quant.dequant_matmul`): ``x`` ``[M, K]`` contiguous.

    At batch 1 the GEMV runs the autotuner's choice among :data:`GEMV_STRIPS`, or
    ``gemv_config`` (from :func:`gemv_config`) when given; larger batches the GEMM's among
    :data:`GEMM_CONFIGS`, or ``gemm_config`` (from :func:`gemm_config`)."""
    m, k = x.shape
    n = qw.codes.shape[0]
    zeros = qw.zeros if qw.zeros is not None else qw.scales  # never read without HAS_ZEROS
    common = dict(BITS=qw.bits, GROUP=qw.group_size, HAS_ZEROS=qw.zeros is not None)
    implicit_zero = float(2 ** (qw.bits - 1))
    if m == 1:
        block_k = gemv_block_k(k, qw.group_size)
        split = split_k_for(triton.cdiv(n, 16), k // block_k, programs_per_sm=2)
        y = _output(m, n, x, split)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
        if x.dtype == torch.bfloat16 and x.data_ptr() % 4:
            x = x.clone()  # the kernel reads bf16 inputs in pairs, as 4-byte words
        sub = min(qw.group_size, block_k)
        if gemv_config is not None:
            box = tma_box_unsupported(gemv_config.kwargs["BLOCK_N"], block_k, qw.bits)
            for field, why in (("PACKED", packed_unsupported(qw.bits, x.dtype)),
                               ("TMA", tma_unsupported(qw.codes) or box)):
                if gemv_config.kwargs.get(field) and why is not None:
                    raise ValueError(f"the {field.lower()} GEMV config cannot run here: {why}")
        tma_ok = tma_unsupported(qw.codes) is None
        codes_desc = codes_descriptor(qw.codes, qw.bits, sub, block_k) if tma_ok else None
        kernel, meta = (_gemv, {}) if gemv_config is None else (_gemv.fn, gemv_config.all_kwargs())
        args = dict(x_ptr=x, codes_ptr=qw.codes, scales_ptr=qw.scales, zeros_ptr=zeros, y_ptr=y, codes_desc=codes_desc,
                    N=n, K=k, stride_cn=qw.codes.stride(0), stride_sn=qw.scales.stride(0), implicit_zero=implicit_zero,
                    SUB=sub, BLOCK_K=block_k, SPLIT_K=split, TMA_OK=tma_ok, **common)
        if gemv_config is not None:
            fit_codes_box({**args, **meta})  # the autotuner runs a config's pre_hook; a direct launch does not
        kernel[grid](**args, **meta)
    else:
        block_k = gemm_block_k(qw.bits, qw.group_size)
        split = split_k_for(triton.cdiv(m, 64) * triton.cdiv(n, 64), k // block_k, programs_per_sm=8)
        y = _output(m, n, x, split)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
        kernel, meta = (_gemm, {}) if gemm_config is None else (_gemm.fn, gemm_config.all_kwargs())
        kernel[grid](x, qw.codes, qw.scales, zeros, y, m, n, k, x.stride(0), qw.codes.stride(0),
                     qw.scales.stride(0), y.stride(0), implicit_zero, BLOCK_K=block_k, SPLIT_K=split,
                     DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common, **meta)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def codes_descriptor(codes: torch.Tensor, bits: int, sub: int, block_k: int) -> TensorDescriptor:
    """``bits``-bit codes as int32 words ``[N, K / sub, words per group]`` for TMA copies of one
    chunk's ``[rows, groups, words]`` tile; the box's rows are the launch's strip (:func:`fit_codes_box`)."""
    words = codes.view(torch.int32)  # rows of K/2 or K bytes, K % 32 == 0: whole words, 16-byte strides
    per_group = sub * bits // 32
    return TensorDescriptor(words, [words.shape[0], words.shape[1] // per_group, per_group],
                            [words.stride(0), per_group, 1], [1, block_k // sub, per_group])


def _output(m: int, n: int, x: torch.Tensor, split: int) -> torch.Tensor:
    """The final output when one program owns each element; a zeroed fp32 buffer for split-K atomics."""
    if split == 1:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    return torch.zeros(m, n, dtype=torch.float32, device=x.device)
