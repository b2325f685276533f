"""Benchmarks of chapter ``number-formats``: the matmul rate of each format on tensor cores.

One square matmul per format at 8192^3 on the GPU: TF32 (fp32 inputs with
``torch.backends.cuda.matmul.allow_tf32``), BF16 and FP16 through ``torch.matmul``
(cuBLAS), FP8 E4M3 through ``torch._scaled_mm`` with per-tensor scales
(:func:`labkit.quant.fp8_matmul`). Each product is checked against float64 on the same
(rounded) inputs before it is timed. Ratios are against the dense datasheet rate.
"""

from __future__ import annotations

import torch

from .. import backend, check, timing
from ..benchmarks import Measurement, benchmark
from ..quant import dequantize_fp8, fp8_matmul, fp8_supported, quantize_fp8
from .rates import dense_tflops

CHAPTER = "number-formats"
SIZE = backend.pick(cpu=256, gpu=8192)
GPU = "H200 SXM (Hopper)"


def _torch_matmul(dtype: torch.dtype):
    dev = backend.device()
    a = check.randn(SIZE, SIZE, dtype=dtype, device=dev, seed=1)
    b = check.randn(SIZE, SIZE, dtype=dtype, device=dev, seed=2)
    return (lambda: torch.matmul(a, b)), a.double() @ b.double()


def _fp8_matmul():
    dev = backend.device()
    x8, sx = quantize_fp8(check.randn(SIZE, SIZE, dtype=torch.bfloat16, device=dev, seed=1), "e4m3")
    w8, sw = quantize_fp8(check.randn(SIZE, SIZE, dtype=torch.bfloat16, device=dev, seed=2), "e4m3")
    expected = dequantize_fp8(x8, sx).double() @ dequantize_fp8(w8, sw).double().T
    return (lambda: fp8_matmul(x8, sx, w8, sw, torch.bfloat16)), expected


@benchmark("formats.matmul_rates", chapter=CHAPTER, title="Matmul rate per format (TF32, BF16, FP16, FP8)")
def matmul_rates() -> Measurement:
    cases = {"tf32": (torch.float32, True), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, False)}
    rows = []
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for fmt, (dtype, tf32) in cases.items():
            torch.backends.cuda.matmul.allow_tf32 = tf32
            call, expected = _torch_matmul(dtype)
            rows.append(_row(fmt, call, expected, "torch.matmul (cuBLAS on a GPU)"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    if fp8_supported()[0]:
        call, expected = _fp8_matmul()
        rows.append(_row("fp8", call, expected, "torch._scaled_mm, per-tensor scales"))
    bf16_rate = next(r["tflops"] for r in rows if r["format"] == "bf16")
    for r in rows:
        r["vs bf16"] = r["tflops"] / bf16_rate
    return Measurement(
        rows=rows, metric="TFLOP/s",
        config={"shape": f"{SIZE}^3", "datasheet": GPU + " dense tensor-core rates (half the sparse figures)",
                "fp8": "E4M3 x E4M3 -> bf16 via labkit.quant.fp8_matmul; skipped without FP8 tensor cores"},
    )


def _row(fmt: str, call, expected: torch.Tensor, how: str) -> dict:
    out = call()
    # TF32 keeps 10 mantissa bits: check at fp16's tolerance; the others at their own dtype's.
    dtype = {"tf32": torch.float16, "fp8": torch.bfloat16}.get(fmt, out.dtype)
    check.assert_close(out.float(), expected.float(), dtype=dtype, name=f"{fmt} matmul {SIZE}^3")
    t = timing.measure(call)
    rate = timing.tflops(2 * SIZE**3, t)
    peak = dense_tflops(GPU, fmt)
    return {"format": fmt, "how": how, "M=N=K": SIZE, "ms": t.median_ms, "tflops": rate,
            "datasheet_dense_tflops": peak, "ours/datasheet": rate / peak}
