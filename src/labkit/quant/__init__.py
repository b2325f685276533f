"""Quantization for inference: INT8/INT4 weight formats, RTN/GPTQ/AWQ-style methods, FP8,
and dequantizing matmul kernels.

>>> from labkit import quant
>>> qw = quant.quantize(w, bits=4, group_size=128)            # RTN, symmetric, per group
>>> y = quant.dequant_matmul(x, qw)                             # Triton: x @ dequant(W)^T
>>> qw = quant.gptq_quantize(w, quant.hessian(x_calib), bits=4, group_size=128)

Weights are ``[N, K]`` (``nn.Linear``'s layout). Group sizes are multiples of 32 that
divide K (``group_size=None`` means per-channel, one group of K); see
:mod:`labkit.quant.reference` for the formats bit by bit.
"""

from __future__ import annotations

import torch

from .. import backend
from ..validate import check_choice, check_positive_int, check_tensor
from . import kernels
from .methods import awq_scales, gptq_quantize, hessian
from . import reference
from .reference import FP8_FORMATS, QuantizedWeight
from . import nf4
from .nf4 import NF4Weight, nf4_levels

BITS = (4, 8)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GROUP_MULTIPLE = 32


def check_group_size(k: int, group_size: int | None) -> int:
    """The group size to use for ``k`` inputs, or a ``ValueError`` that says why not."""
    if group_size is None:
        group_size = k
    check_positive_int(group_size, "group_size")
    if group_size % GROUP_MULTIPLE:
        raise ValueError(f"group_size must be a multiple of {GROUP_MULTIPLE} (the kernels' K chunk), "
                         f"got {group_size}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size {group_size}: pad the weight's inputs "
                         f"or pick a group size that divides K")
    return group_size


def quantize(w: torch.Tensor, bits: int = 4, group_size: int | None = 128, *, symmetric: bool = True,
             scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of ``w`` ``[N, K]``; ``group_size=None`` is per-channel.

    Scales (and zero points, if not ``symmetric``) are stored in ``scale_dtype``
    (default: ``w``'s dtype).
    """
    check_tensor(w, "w", ndim=2, dtypes=FLOAT_DTYPES)
    check_choice(bits, "bits", BITS)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    group_size = check_group_size(w.shape[1], group_size)
    scale_dtype = scale_dtype or w.dtype
    check_choice(scale_dtype, "scale_dtype", FLOAT_DTYPES)
    return reference.quantize_rtn(w, bits, group_size, symmetric, scale_dtype)


def check_quantized(qw: object, name: str = "qw") -> QuantizedWeight:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{name} must be a QuantizedWeight (from labkit.quant.quantize), got {type(qw).__name__}")
    check_choice(qw.bits, f"{name}.bits", BITS)
    check_tensor(qw.codes, f"{name}.codes", ndim=2, dtypes=(torch.uint8,), contiguous=True)
    if qw.codes.data_ptr() % 4:
        raise ValueError(f"{name}.codes must start on a 4-byte boundary (the GEMV reads them as int32 words); "
                         f"it starts at byte {qw.codes.data_ptr() % 4} of a word: pass a copy (.clone())")
    n, k = qw.shape
    check_group_size(k, qw.group_size)
    check_tensor(qw.scales, f"{name}.scales", ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    if tuple(qw.scales.shape) != (n, k // qw.group_size):
        raise ValueError(f"{name}.scales must be [{n}, {k // qw.group_size}], got {tuple(qw.scales.shape)}")
    if qw.zeros is not None:
        check_tensor(qw.zeros, f"{name}.zeros", ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
        if qw.zeros.shape != qw.scales.shape:
            raise ValueError(f"{name}.zeros must have the scales' shape {tuple(qw.scales.shape)}, "
                             f"got {tuple(qw.zeros.shape)}")
    return qw


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` uint8 codes in [0, 15] -> ``[N, K/2]`` bytes: element ``2j`` low nibble, ``2j+1`` high."""
    check_tensor(codes, "codes", ndim=2, dtypes=(torch.uint8,))
    if codes.shape[1] % 2:
        raise ValueError(f"codes need an even number of columns to pack in pairs, got {tuple(codes.shape)}")
    if int(codes.max()) > 15:
        raise ValueError(f"INT4 codes must lie in [0, 15], got a maximum of {int(codes.max())}")
    return reference.pack_int4(codes)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`."""
    check_tensor(packed, "packed", ndim=2, dtypes=(torch.uint8,))
    return reference.unpack_int4(packed)


def codes_of(qw: QuantizedWeight) -> torch.Tensor:
    """The unpacked ``[N, K]`` codes of ``qw``."""
    return reference.codes_of(check_quantized(qw))


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """``(u - z) * s`` as a ``[N, K]`` fp32 tensor."""
    return reference.dequantize(check_quantized(qw))


def quantize_fp8(w: torch.Tensor, fmt: str = "e4m3",
                 block: int | tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in FP8 (``"e4m3"`` or ``"e5m2"``) with an fp32 scale per tensor, per ``block x block``
    tile (an int) or per ``rows x cols`` tile (a pair)."""
    check_tensor(w, "w", ndim=2, dtypes=FLOAT_DTYPES)
    check_choice(fmt, "fmt", tuple(FP8_FORMATS))
    if block is not None:
        if isinstance(block, tuple) and len(block) == 2:
            check_positive_int(block[0], "block[0]")
            check_positive_int(block[1], "block[1]")
            rows, cols = block
        else:
            check_positive_int(block, "block")
            rows = cols = block
        if w.shape[0] % rows or w.shape[1] % cols:
            raise ValueError(f"a {rows} x {cols} tile must divide w's shape, got shape {tuple(w.shape)}")
    return reference.quantize_fp8(w, fmt, block)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8`: ``q * scale`` as fp32, per tensor or per tile."""
    check_tensor(q, "q", ndim=2, dtypes=tuple(FP8_FORMATS.values()))
    check_tensor(scale, "scale", ndim=(0, 2), dtypes=(torch.float32,), device=q.device)
    if scale.ndim == 2 and (q.shape[0] % scale.shape[0] or q.shape[1] % scale.shape[1]):
        raise ValueError(f"a 2-D scale must hold one value per tile of q (its shape dividing q's), got scale "
                         f"{tuple(scale.shape)} for q {tuple(q.shape)}")
    return reference.dequantize_fp8(q, scale)


def dequant_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``x @ dequantize(qw)^T`` in Triton, without materializing the weight.

    ``x`` is ``[M, K]`` (fp16, bf16 or fp32; fp32 accumulation); the result is ``[M, N]``
    in ``x``'s dtype. M = 1 runs the GEMV kernel, larger M the small-batch GEMM.
    """
    check_quantized(qw)
    # The kernels run where labkit's mode says: CUDA tensors on a GPU, CPU ones in the interpreter.
    check_tensor(qw.codes, "qw.codes", device=backend.device())
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, device=backend.device(), contiguous=True)
    if x.shape[1] != qw.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} inputs but the weight has {qw.shape[1]}")
    return kernels.dequant_matmul(x, qw)


# The SASS opcodes of the GEMV's loop by kind: integer and logic, and floating point (a
# Hopper SM has 64 INT32 lanes against 128 FP32 ones, per NVIDIA's Hopper whitepaper).
INTEGER_OPCODES = ("LOP3", "SHF", "PRMT", "SGXT", "IMAD", "IADD3", "LEA", "MOV", "SEL", "ISETP", "VIADD", "BFE")
FLOAT_OPCODES = ("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FSEL")


def _sass_operands(bits: int, group_size: int | None, batch: int):
    """Zeroed operands of an 8192-input, 256-row layer in ``bits``-bit codes, and a batch of bf16 inputs."""
    check_choice(bits, "bits", BITS)
    n, k = 256, 8192
    group = check_group_size(k, group_size)
    dev = backend.device()
    codes = torch.zeros(n, k * bits // 8, dtype=torch.uint8, device=dev)
    scales = torch.zeros(n, k // group, dtype=torch.bfloat16, device=dev)
    x = torch.zeros(batch, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(batch, n, dtype=torch.bfloat16, device=dev)
    return x, codes, scales, y, n, k, group


def gemv_sass(bits: int, code_words: bool, *, prefetch: bool = False, loop_stages: int = 1, block_n: int = 16,
              num_warps: int = 4, num_stages: int = 3, group_size: int | None = 128, packed: bool = False,
              tma: bool = False) -> str:
    """The machine code (SASS) of the batch-1 GEMV compiled for the H200, as ``nvdisasm`` prints it.

    The kernel (:func:`labkit.quant.kernels._gemv_kernel`) is compiled for ``sm_90`` with the
    GPU's K chunk (``kernels.GEMV_CHUNK`` inputs), bf16 activations, symmetric ``bits``-bit
    codes in groups of ``group_size`` (``None``: per channel), reading the codes as bytes or as
    int32 words (``code_words``; with ``packed``, INT4 words multiplied in bf16x2), loads kept in
    flight by a register double buffer
    (``prefetch``) or by Triton's pipelining of the K loop (``loop_stages``; with ``tma``, the
    words copied by the Tensor Memory Accelerator), ``block_n``
    rows a program; ``num_stages`` is the kernel's own launch option. Compiling needs no GPU
    (:func:`labkit.sass.compile_sm90`): the code is the same on every machine with the same Triton.
    """
    from .. import sass

    check_positive_int(block_n, "block_n")
    if packed and (bits != 4 or not code_words):
        raise ValueError(f"packed multiplies INT4 codes read as words: needs bits=4 and code_words=True, got "
                         f"bits={bits}, code_words={code_words}")
    kernels.gemv_config(block_n, code_words=code_words, prefetch=prefetch, loop_stages=loop_stages, packed=packed,
                        tma=tma)  # refuses what the kernel cannot run
    x, codes, scales, y, n, k, group = _sass_operands(bits, group_size, 1)
    sub = min(group, kernels.GEMV_CHUNK)
    desc = kernels.codes_descriptor(codes, bits, sub, kernels.GEMV_CHUNK) if tma else None
    args = (x, codes, scales, scales, y, desc, n, k, codes.stride(0), scales.stride(0), float(2 ** (bits - 1)))
    meta = dict(BITS=bits, GROUP=group, HAS_ZEROS=False, SUB=sub, CODE_WORDS=code_words,
                BLOCK_K=kernels.GEMV_CHUNK, BLOCK_N=block_n, SPLIT_K=1, PREFETCH=prefetch, LOOP_STAGES=loop_stages,
                PACKED=packed, TMA=tma, TMA_OK=tma, num_warps=num_warps, num_stages=num_stages)
    kernels.fit_codes_box({"codes_desc": desc, **meta})
    return sass.disassemble(sass.compile_sm90(kernels._gemv_kernel, args, meta))


def gemm_sass(bits: int, *, prefetch: bool = False, block_m: int = 16, block_n: int = 64, num_warps: int = 4,
              num_stages: int = 3, group_size: int | None = 128) -> str:
    """The machine code of the small-batch GEMM (:func:`labkit.quant.kernels._gemm_kernel`) for
    the H200: ``block_m`` rows of x (bf16) and ``block_n`` rows of the weight a program, the
    GPU's K chunk for ``bits`` and ``group_size``, each chunk loaded ahead by hand or not
    (``prefetch``); as :func:`gemv_sass`, without a GPU."""
    from .. import sass

    check_positive_int(block_m, "block_m")
    check_positive_int(block_n, "block_n")
    x, codes, scales, y, n, k, group = _sass_operands(bits, group_size, block_m)
    args = (x, codes, scales, scales, y, block_m, n, k, x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
            float(2 ** (bits - 1)))
    meta = dict(BITS=bits, GROUP=group, HAS_ZEROS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=min(kernels.GEMM_CHUNK[bits], group & -group), SPLIT_K=1, DOT_PRECISION="tf32",
                PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    return sass.disassemble(sass.compile_sm90(kernels._gemm_kernel, args, meta))


def gemv_instruction_mix(bits: int, code_words: bool, *, prefetch: bool = False, loop_stages: int = 1,
                         block_n: int = 16, num_warps: int = 4, num_stages: int = 3,
                         group_size: int | None = 128, packed: bool = False, tma: bool = False) -> dict[str, float]:
    """SASS instructions per weight in the main loop of the batch-1 GEMV (:func:`gemv_sass`, whose
    arguments these are).

    Its largest loop body is one chunk, ``block_n * GEMV_CHUNK`` weights over ``32 *
    num_warps`` threads; each opcode's count in it is divided by a thread's share of those
    weights. Returns ``{opcode: per weight}`` plus ``"integer"``, ``"float"`` and ``"total"``.
    """
    from .. import sass

    loop = sass.loop_opcodes(gemv_sass(bits, code_words, prefetch=prefetch, loop_stages=loop_stages, block_n=block_n,
                                       num_warps=num_warps, num_stages=num_stages, group_size=group_size,
                                       packed=packed, tma=tma))
    weights_per_thread = block_n * kernels.GEMV_CHUNK / (32 * num_warps)
    mix = {op: loop.count(op) / weights_per_thread for op in sorted(set(loop))}
    mix["integer"] = sum(loop.count(op) for op in INTEGER_OPCODES) / weights_per_thread
    mix["float"] = sum(loop.count(op) for op in FLOAT_OPCODES) / weights_per_thread
    mix["total"] = len(loop) / weights_per_thread
    return mix


def quantize_nf4(w: torch.Tensor, double_quant: bool = True, block_size: int = nf4.BLOCK_SIZE) -> NF4Weight:
    """``w`` ``[N, K]`` in QLoRA's NF4: blocks of ``block_size`` weights (64, as QLoRA), an absmax
    each, optionally double quantized (the absmaxes in int8, 256 a block); see :mod:`labkit.quant.nf4`."""
    check_tensor(w, "w", ndim=2, dtypes=FLOAT_DTYPES)
    if not isinstance(double_quant, bool):
        raise TypeError(f"double_quant must be a bool, got {type(double_quant).__name__}")
    check_positive_int(block_size, "block_size")
    if block_size % 2:
        raise ValueError(f"block_size must be even (codes are packed two a byte), got {block_size}")
    return nf4.quantize_nf4(w, double_quant, block_size)


def dequantize_nf4(qw: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight an :class:`NF4Weight` stands for, in ``dtype``."""
    if not isinstance(qw, NF4Weight):
        raise TypeError(f"qw must be an NF4Weight (from labkit.quant.quantize_nf4), got {type(qw).__name__}")
    check_choice(dtype, "dtype", FLOAT_DTYPES)
    return nf4.dequantize_nf4(qw, dtype)


def fp8_supported() -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can run here, and if not, why."""
    if not backend.on_gpu():
        return False, "no CUDA GPU: torch._scaled_mm runs on NVIDIA GPUs of compute capability 8.9+"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (needs 8.9+)"
    return True, "ok"


def _check_fp8_operand(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(t, name, ndim=2, dtypes=dtypes, device="cuda", contiguous=True)


def fp8_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T`` on FP8 tensor cores (``torch._scaled_mm``).

    Both operands already E4M3 ``[M, K]`` and ``[N, K]`` with per-tensor fp32 scales (from
    :func:`quantize_fp8`); K and N multiples of 16 (cuBLASLt's FP8 alignment). The result
    is ``[M, N]`` in ``out_dtype`` (bf16 or fp16).
    """
    ok, why = fp8_supported()
    if not ok:
        raise RuntimeError(why)
    _check_fp8_operand(x_fp8, "x_fp8", (torch.float8_e4m3fn,))
    _check_fp8_operand(w_fp8, "w_fp8", (torch.float8_e4m3fn,))
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        check_tensor(scale, name, ndim=0, dtypes=(torch.float32,), device="cuda")
    check_choice(out_dtype, "out_dtype", (torch.float16, torch.bfloat16))
    if x_fp8.shape[1] != w_fp8.shape[1] or x_fp8.shape[1] % 16 or w_fp8.shape[0] % 16:
        raise ValueError(f"x [M, K] and w [N, K] need equal K and K, N multiples of 16, got "
                         f"{tuple(x_fp8.shape)} and {tuple(w_fp8.shape)}")
    # cuBLASLt wants the second operand column-major: w_fp8.t() of a row-major [N, K] is.
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x @ (w_fp8 * w_scale)^T`` with ``x`` quantized to E4M3 per tensor, on FP8 tensor cores.

    ``w_fp8`` ``[N, K]`` E4M3 with a per-tensor fp32 ``w_scale`` (from
    :func:`quantize_fp8`); result in ``x``'s dtype (bf16 or fp16). The activation is
    quantized here, in eager torch (an absolute maximum, a division and a cast: a few
    small kernels per call), then :func:`fp8_matmul` multiplies. Serving engines fuse that
    quantization into the kernel before the matmul instead.
    """
    ok, why = fp8_supported()
    if not ok:
        raise RuntimeError(why)
    _check_fp8_operand(x, "x", (torch.float16, torch.bfloat16))
    x_fp8, x_scale = quantize_fp8(x, "e4m3")
    return fp8_matmul(x_fp8, x_scale, w_fp8, w_scale, x.dtype)


__all__ = [
    "BITS", "NF4Weight", "QuantizedWeight", "awq_scales", "check_group_size", "codes_of", "dequant_matmul",
    "dequantize", "dequantize_fp8", "dequantize_nf4", "fp8_linear", "fp8_matmul", "fp8_supported",
    "gemm_sass", "gemv_instruction_mix", "gemv_sass", "gptq_quantize", "hessian", "nf4_levels", "pack_int4",
    "quantize", "quantize_fp8", "quantize_nf4", "unpack_int4",
]
