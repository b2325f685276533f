"""Matmul on tensor cores: chapter "Matmul and tensor cores".

>>> c = matmul(a, b)                          # a [M, K] @ b [K, N]; the kernel picked by shape
>>> c = matmul(a, b, kernel="tiled")          # or name one: naive, tiled, split_k, persistent
>>> a8, sa = quantize_rowwise(a); w8, sw = quantize_rowwise(w)
>>> c = fp8_matmul(a8, sa, w8, sw)            # E4M3 [M, K] x [N, K]^T, one scale per row

The kernels live in :mod:`labkit.matmul.kernels`, the plain-torch versions and the
arithmetic of tiles in :mod:`labkit.matmul.reference`, CuTe's layout algebra in
:mod:`labkit.matmul.cute_layout`, the measurements in :mod:`labkit.matmul.bench`.
"""

from __future__ import annotations

import torch
import triton

from .. import backend, sass
from ..validate import check_choice, check_same_device, check_tensor, dtype_name
from . import kernels
from .kernels import config, config_name, num_sms, tile_order
from .reference import (fp8_matmul_reference, matmul_reference, minimum_traffic_bytes, quantize_rowwise,
                        tile_intensity, tiled_matmul, tiled_traffic_bytes)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16)
KERNELS = ("naive", "tiled", "split_k", "persistent", "persistent_ws")

__all__ = [
    "DTYPES", "KERNELS", "PTX_INSTRUCTIONS", "SASS_INSTRUCTIONS", "choose_kernel", "compile_sm90", "instruction_counts", "config", "config_name", "fp8_matmul",
    "fp8_matmul_reference", "matmul", "matmul_reference", "minimum_traffic_bytes", "quantize_rowwise",
    "tile_intensity", "tile_order", "tiled_matmul", "tiled_traffic_bytes",
]


def _tma_ready(t: torch.Tensor) -> bool:
    """A row-major matrix TMA can copy from: contiguous, base and row pitch 16-byte aligned."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[1] * t.element_size()) % 16 == 0


def _device_has_tma(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


# Up to this many rows of A a matmul reads its B (the weights) about once and is bound by
# memory (an H200's bf16 ridge is near 200 FLOP a byte, and M rows give M FLOP a byte of B).
SKINNY_M = 256


def choose_kernel(a: torch.Tensor, b: torch.Tensor) -> str:
    """The kernel ``matmul(a, b)`` runs: for skinny ``M`` (at most :data:`SKINNY_M` rows) the
    split-K kernel, whose autotuner picks how many ways to split K so that the few output
    tiles still give every SM work; else the persistent TMA kernel where TMA can read the
    operands (Hopper, aligned rows); else the tiled kernel."""
    (M, K), N = a.shape, b.shape[1]
    if M <= SKINNY_M and K >= 1024:
        return "split_k"
    if _device_has_tma(a.device) and _tma_ready(a) and _tma_ready(b):
        return "persistent"
    return "tiled"


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    check_tensor(a, "a", ndim=2, dtypes=DTYPES)
    check_tensor(b, "b", ndim=2, dtypes=DTYPES)
    check_same_device(a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got {dtype_name(a.dtype)} and {dtype_name(b.dtype)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] and b [K, N] must agree on K, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    check_tensor(a, "a", device=backend.device())


def matmul(a: torch.Tensor, b: torch.Tensor, *, kernel: str = "auto", cfg: triton.Config | None = None
           ) -> torch.Tensor:
    """``a @ b`` for ``a`` ``[M, K]`` and ``b`` ``[K, N]`` of one dtype (fp32, fp16, bf16), on
    :func:`labkit.device`; fp32 accumulation, the result in the inputs' dtype. fp32 inputs get
    exact fp32 products (not TF32).

    ``kernel``: ``"auto"`` (:func:`choose_kernel`) or one of :data:`KERNELS`; ``"persistent"``
    needs contiguous operands whose rows are multiples of 16 bytes, as does
    ``"persistent_ws"``, the same kernel with Triton's automatic warp specialization. ``cfg`` (from
    :func:`config`) runs that tile instead of the autotuner's choice (not for ``"naive"``).
    """
    _check_operands(a, b)
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a string, got {type(kernel).__name__}")
    check_choice(kernel, "kernel", ("auto", *KERNELS))
    if cfg is not None and not isinstance(cfg, triton.Config):
        raise TypeError(f"cfg must be a triton.Config (from labkit.matmul.config), got {type(cfg).__name__}")
    if kernel == "auto":
        kernel = choose_kernel(a, b)
    if kernel.startswith("persistent") and not (_tma_ready(a) and _tma_ready(b)):
        raise ValueError(
            f"kernel {kernel!r} reads through TMA, which needs contiguous operands with rows of a multiple "
            f"of 16 bytes; got a {tuple(a.shape)} strides {a.stride()}, b {tuple(b.shape)} strides {b.stride()} "
            f"in {dtype_name(a.dtype)}: use kernel 'tiled'")
    if cfg is not None and kernel == "naive":
        raise ValueError("cfg applies to the tiled, split_k and persistent kernels, not to 'naive'")
    M, N = a.shape[0], b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if kernel == "split_k":
        return kernels.split_k_launch(a, b, c, cfg=cfg)
    if kernel == "naive":
        return kernels.naive_launch(a, b, c)
    if kernel == "tiled":
        return kernels.tiled_launch(a, b, c, cfg=cfg)
    return kernels.persistent_launch(a, b, c, cfg=cfg, warp_specialize=kernel == "persistent_ws")


def fp8_matmul(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, *, cfg: triton.Config | None = None) -> torch.Tensor:
    """``(a_fp8 * a_scale[:, None]) @ (w_fp8 * w_scale[:, None])^T`` on FP8 tensor cores.

    ``a_fp8`` ``[M, K]`` and ``w_fp8`` ``[N, K]``: contiguous E4M3 (a linear layer's weight
    layout; Hopper's FP8 wgmma reads both operands K-major); ``K`` and ``N`` multiples of 16
    (TMA's 16-byte rows). ``a_scale`` ``[M]`` and ``w_scale`` ``[N]``: fp32 (from
    :func:`quantize_rowwise`). The result is ``[M, N]`` in ``out_dtype`` (bf16 or fp16).
    """
    for name, t in (("a_fp8", a_fp8), ("w_fp8", w_fp8)):
        check_tensor(t, name, ndim=2, dtypes=(torch.float8_e4m3fn,), contiguous=True)
    check_tensor(a_scale, "a_scale", ndim=1, dtypes=(torch.float32,), contiguous=True)
    check_tensor(w_scale, "w_scale", ndim=1, dtypes=(torch.float32,), contiguous=True)
    check_same_device(a_fp8=a_fp8, w_fp8=w_fp8, a_scale=a_scale, w_scale=w_scale)
    check_tensor(a_fp8, "a_fp8", device=backend.device())
    check_choice(out_dtype, "out_dtype", OUT_DTYPES)
    (M, K), N = a_fp8.shape, w_fp8.shape[0]
    if w_fp8.shape[1] != K or K % 16 or N % 16:
        raise ValueError(f"a_fp8 [M, K] and w_fp8 [N, K] need equal K, and K and N multiples of 16; got "
                         f"{tuple(a_fp8.shape)} and {tuple(w_fp8.shape)}")
    if a_scale.shape[0] != M or w_scale.shape[0] != N:
        raise ValueError(f"a_scale must have M = {M} entries and w_scale N = {N}, got {a_scale.shape[0]} "
                         f"and {w_scale.shape[0]}")
    c = torch.empty(M, N, dtype=out_dtype, device=a_fp8.device)
    return kernels.fp8_launch(a_fp8, w_fp8, a_scale, w_scale, c, cfg=cfg)


# What to look for in compiled code: Ampere's warp-level MMA and async copies, Hopper's
# warpgroup MMA and TMA, in the PTX (virtual ISA) and in the SASS (the machine code).
PTX_INSTRUCTIONS = {"wgmma.mma_async": "Hopper warpgroup MMA", "mma.sync": "warp MMA (Ampere and later)",
                    "cp.async.bulk.tensor": "TMA copy", "cp.async.cg": "Ampere async copy (16 B a thread)"}
SASS_INSTRUCTIONS = {"HGMMA": "warpgroup MMA", "HMMA": "warp MMA", "UTMALDG": "TMA load", "UTMASTG": "TMA store",
                     "LDGSTS": "async global-to-shared copy"}


def instruction_counts(compiled) -> dict[str, int]:
    """How often each instruction of :data:`PTX_INSTRUCTIONS` appears in a compiled kernel's
    PTX and each of :data:`SASS_INSTRUCTIONS` in its SASS (disassembled with the
    ``nvdisasm`` that ships with Triton: :mod:`labkit.sass`)."""
    ptx = compiled.asm["ptx"]
    counts = {f"ptx {op}": ptx.count(op) for op in PTX_INSTRUCTIONS}
    opcodes = sass.opcodes(sass.disassemble(compiled))
    counts.update({f"sass {op}": opcodes.count(op) for op in SASS_INSTRUCTIONS})
    return counts


def compile_sm90(kernel: str, cfg: triton.Config, dtype: torch.dtype = torch.bfloat16, shape=(512, 512, 512)):
    """Triton's compiled kernel for one launch of ``kernel`` (``tiled``, ``persistent`` or
    ``fp8``) at ``cfg`` for the H200 (``sm_90``), without running it: its ``asm`` holds the
    Triton IRs, the PTX and the cubin. On a CPU this goes through labkit's compile-only path
    (:mod:`labkit.compile_check`); on a GPU through Triton's own ``warmup``."""
    check_choice(kernel, "kernel", ("tiled", "persistent", "fp8"))
    M, N, K = shape
    dev = backend.device()
    meta = {**cfg.all_kwargs()}
    if kernel == "fp8":
        a = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
        w = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=dev)
        scale_m, scale_n = torch.empty(M, device=dev), torch.empty(N, device=dev)
        fn = kernels.fp8_matmul_kernel
        args = (a, w, scale_m, scale_n, torch.empty(M, N, dtype=torch.bfloat16, device=dev), M, N, K)
        meta["NUM_PROGRAMS"] = num_sms(dev)
    else:
        a = torch.empty(M, K, dtype=dtype, device=dev)
        b = torch.empty(K, N, dtype=dtype, device=dev)
        c = torch.empty(M, N, dtype=dtype, device=dev)
        meta["EXACT_FP32"] = dtype == torch.float32
        if kernel == "tiled":
            meta.setdefault("SPLIT_K", 1)
            partials = torch.empty(meta["SPLIT_K"], M, N, device=dev)
            tickets = torch.empty(triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), dtype=torch.int32,
                                  device=dev)
            fn = kernels.tiled_matmul_kernel
            args = (a, b, c, partials, tickets, M, N, K, *a.stride(), *b.stride(), *c.stride())
        else:
            fn, args = kernels.persistent_matmul_kernel, (a, b, c, M, N, K)
            meta.update(NUM_PROGRAMS=num_sms(dev), WARP_SPECIALIZE=False, FLATTEN=True)
    return sass.compile_sm90(fn, args, meta)
