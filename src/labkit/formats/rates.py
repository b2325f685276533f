"""Peak arithmetic rates per number format, as NVIDIA's datasheets state them (TFLOP/s).

Datasheets print tensor-core rates *with 2:4 structured sparsity* (half the weights zero,
skipped by the hardware); the dense rate, which an ordinary matmul can reach, is half of
it. Both are kept here, with the document each comes from (a ``book/references.bib`` key).
``None``: the unit has no such path (Hopper has no FP4 tensor cores).
"""

from __future__ import annotations

# (unit, format) -> sparse TFLOP/s as printed (tensor cores) or the plain rate (CUDA cores).
H200_SXM = {
    "source": "h200datasheet",   # the H100 SXM's compute figures; the H200 differs in memory only
    "tensor_sparse": {"tf32": 989, "bf16": 1979, "fp16": 1979, "fp8": 3958, "fp4": None},
    "cuda": {"fp64": 33.5, "fp32": 66.9, "fp16": 133.8, "bf16": 133.8},  # H100 SXM5
    "cuda_source": "nvidia2022hopperwhitepaper",
}
B200_HGX = {
    "source": "nvidiab200datasheet",
    "tensor_sparse": {"tf32": 2250, "bf16": 4500, "fp16": 4500, "fp8": 9000, "fp4": 18000},  # 8-GPU figures / 8
    "cuda": {"fp64": 37},
    "cuda_source": "nvidiab200datasheet",
}
DATASHEETS = {"H200 SXM (Hopper)": H200_SXM, "B200 HGX (Blackwell)": B200_HGX}


def dense_tflops(gpu: str, fmt: str) -> float | None:
    """The dense tensor-core rate of ``fmt`` on ``gpu`` (half the datasheet's sparse figure)."""
    sparse = DATASHEETS[gpu]["tensor_sparse"][fmt]
    return None if sparse is None else sparse / 2


def rate_table() -> list[dict]:
    """One row per (GPU, format): dense and sparse tensor-core TFLOP/s and the CUDA-core rate."""
    rows = []
    for gpu, sheet in DATASHEETS.items():
        for fmt in dict.fromkeys([*sheet["tensor_sparse"], *sheet["cuda"]]):
            sparse = sheet["tensor_sparse"].get(fmt)
            rows.append({"gpu": gpu, "format": fmt, "tensor dense": None if sparse is None else dense_tflops(gpu, fmt),
                         "tensor sparse": sparse, "CUDA cores": sheet["cuda"].get(fmt), "source": sheet["source"]})
    return rows
