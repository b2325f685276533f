"""Benchmarks of chapter ``quantization``: weight-only INT4/INT8 matmuls against bf16 cuBLAS.

At small batch a linear layer is a read of its weight, so the measure is weight bytes
(codes + scales) over the median time, against the copy bandwidth measured in the same
run, and the speedup over ``torch.nn.functional.linear`` on the bf16 weight of the same
shape. Every output is checked, before timing, against the float64 product with the same
dequantized weight (after one untimed call, so autotuning has picked its config).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import dequant_matmul, dequantize_fp8, fp8_linear, fp8_matmul, fp8_supported, kernels, quantize, quantize_fp8
from .reference import dequant_matmul as reference_matmul

CHAPTER = "quantization"
# Llama-3-70B's square attention projection and its MLP up/gate projection (N x K).
SHAPES = backend.pick(cpu=[(96, 64), (160, 128)], gpu=[(8192, 8192), (28672, 8192)])
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
# INT4 with 128-input groups (GPTQ/AWQ's usual), INT8 per output channel.
FORMATS = {"int4-g128": (4, backend.pick(cpu=32, gpu=128)), "int8-channel": (8, None)}
# How the GEMM reads x. Records from before this key read INT4's even and odd inputs apart, as
# 2-byte loads that the pipeliner left plain; the chapter tells the two apart by it.
GEMM_INPUTS = ("a [BLOCK_M, BLOCK_K] tile of contiguous rows a chunk; INT4 splits it into even and odd inputs "
               "in registers")


def _rows_for(n: int, k: int, batch: int, limits: dict[str, float]) -> list[dict]:
    dev = backend.device()
    w = check.randn(n, k, dtype=DTYPE, device=dev, seed=1, scale=0.02)
    x = check.randn(batch, k, dtype=DTYPE, device=dev, seed=2)
    t_ref = timing.measure(lambda: F.linear(x, w))
    dense_bytes = w.numel() * w.element_size()
    rows = [{"N": n, "K": k, "batch": batch, "format": "bf16-cublas", "ms": t_ref.median_ms,
             "weight_bytes": dense_bytes, "weight_tbps": timing.bandwidth_tbps(dense_bytes, t_ref),
             "ours/cublas": 1.0, "ours/limit": timing.bandwidth_tbps(dense_bytes, t_ref) / limits["copy_tbps"]}]
    for fmt, (bits, group) in FORMATS.items():
        qw = quantize(w, bits, group)
        dequant_matmul(x, qw)  # untimed: autotuning runs here
        check.assert_close(dequant_matmul(x, qw), reference_matmul(x, qw).float(), dtype=DTYPE,
                           name=f"{fmt} {n}x{k} batch {batch}")
        # Timed through the launcher: the boundary checks run once per call in Python, and a
        # server validates a layer's weights once, not every token.
        t = timing.measure(lambda qw=qw: kernels.dequant_matmul(x, qw))
        tbps = timing.bandwidth_tbps(qw.nbytes, t)
        # A bare read of the weight's bytes, timed alike: the fastest a call of this size can be
        # when it does nothing but read them (the 2 GiB streams of the ceilings hide a launch's
        # start and its last wave; a read of tens of MB does not). Its speedup over cuBLAS is what
        # a GEMV would have if reading its weight, as fast as this read, were all it did.
        same_size_read = ceilings.read_bandwidth_at_tbps(qw.nbytes)
        read_ms = qw.nbytes / (same_size_read * 1e9)
        rows.append({"N": n, "K": k, "batch": batch, "format": fmt, "ms": t.median_ms,
                     "weight_bytes": qw.nbytes, "weight_tbps": tbps,
                     "ours/cublas": t_ref.median_ms / t.median_ms, "ours/limit": tbps / limits["copy_tbps"],
                     "same_size_read_tbps": same_size_read, "ours/same-size read": tbps / same_size_read,
                     "same-size read/cublas": t_ref.median_ms / read_ms})
    if fp8_supported()[0] and batch % 16 == 0:
        w8, s8 = quantize_fp8(w, "e4m3")
        x8, sx = quantize_fp8(x, "e4m3")  # what fp8_linear does to x inside
        check.assert_close(fp8_linear(x, w8, s8),
                           (dequantize_fp8(x8, sx).double() @ dequantize_fp8(w8, s8).double().T).float(),
                           dtype=DTYPE, name=f"fp8 {n}x{k} batch {batch}")
        fp8_bytes = w8.numel() + 4
        # Timed twice: with the activation's eager quantization (fp8_linear, what a caller
        # holding bf16 activations runs) and without it (the matmul alone, as when the
        # previous kernel already wrote FP8).
        for fmt, call in (("fp8-e4m3-scaled_mm", lambda: fp8_linear(x, w8, s8)),
                          ("fp8-e4m3-scaled_mm-x-prequantized", lambda: fp8_matmul(x8, sx, w8, s8, DTYPE))):
            t = timing.measure(call)
            rows.append({"N": n, "K": k, "batch": batch, "format": fmt, "ms": t.median_ms,
                         "weight_bytes": fp8_bytes, "weight_tbps": timing.bandwidth_tbps(fp8_bytes, t),
                         "ours/cublas": t_ref.median_ms / t.median_ms,
                         "ours/limit": timing.bandwidth_tbps(fp8_bytes, t) / limits["copy_tbps"]})
    return rows


def _min_ratio(rows: list[dict], fmt: str, max_batch: int) -> float:
    return min(r["ours/cublas"] for r in rows if r["format"] == fmt and r["batch"] <= max_batch)


def _config() -> dict:
    return {"dtype": str(DTYPE).replace("torch.", ""), "shapes": "N x K (Llama-3-70B q/o and MLP up)",
            "formats": {f: {"bits": b, "group_size": g or "K (per channel)"} for f, (b, g) in FORMATS.items()},
            "weight_bytes": "codes + scales (+ zero points); limit is the copy bandwidth (read + write)",
            "same_size_read": "INT4/INT8 rows: labkit.ceilings.read_bandwidth_at_tbps(weight bytes), one read_sum "
                              "pass over as many bytes; same-size read/cublas is cuBLAS's time over that read's",
            "timed": "labkit.quant.kernels.dequant_matmul (the launcher; inputs validated once, outside the timing); "
                     "fp8-e4m3-scaled_mm: labkit.quant.fp8_linear, whose eager per-tensor quantization of x is timed "
                     "with the matmul; fp8-e4m3-scaled_mm-x-prequantized: labkit.quant.fp8_matmul on x already in FP8",
            "reference": f"torch.nn.functional.linear on the bf16 weight (cuBLAS), torch {torch.__version__}",
            "autotuned": kernels.autotuned_choices()}


@benchmark("quant.gemv", chapter=CHAPTER,
           title="Weight-only INT4/INT8 GEMV at batch 1 against bf16 cuBLAS: weight bandwidth and speedup")
def bench_gemv() -> Measurement:
    limits = ceilings.limits()
    rows = [r for n, k in SHAPES for r in _rows_for(n, k, 1, limits)]
    goals = [Goal("int4-g128 ours/cublas at batch 1 (min over shapes)", _min_ratio(rows, "int4-g128", 1), ">=", 3.0),
             Goal("int8-channel ours/cublas at batch 1 (min over shapes)", _min_ratio(rows, "int8-channel", 1),
                  ">=", 1.7)]
    return Measurement(rows=rows, metric="TB/s of weight bytes read; speedup over bf16 cuBLAS", limits=limits,
                       goals=goals, config=_config())


@benchmark("quant.gemv_launches", chapter=CHAPTER,
           title="Every launch the batch-1 GEMV's autotuner chooses among (strip, code read, loads ahead), INT4 and "
                 "INT8, timed against bf16 cuBLAS")
def bench_gemv_launches() -> Measurement:
    """What the autotuner's choice won by: each candidate of ``kernels.gemv_launches`` at each shape and
    format, checked against the float64 product and timed through the launcher as ``quant.gemv`` times
    the autotuner's choice (marked ``chosen``). On a CPU the interpreter's one launch stands in, at
    one shape."""
    limits = ceilings.limits()
    dev = backend.device()
    rows = []
    for n, k in backend.pick(cpu=SHAPES[:1], gpu=SHAPES):
        w = check.randn(n, k, dtype=DTYPE, device=dev, seed=1, scale=0.02)
        x = check.randn(1, k, dtype=DTYPE, device=dev, seed=2)
        t_ref = timing.measure(lambda: F.linear(x, w))
        for fmt, (bits, group) in FORMATS.items():
            qw = quantize(w, bits, group)
            want = reference_matmul(x, qw).float()
            dequant_matmul(x, qw)  # untimed: autotuning runs here
            chosen = kernels.gemv_autotuned(qw)
            for config in kernels.gemv_launches(qw, x.dtype):
                meta = config.kwargs
                codes, ahead = kernels.gemv_code_read(meta), kernels.gemv_loads_ahead(meta)
                check.assert_close(kernels.dequant_matmul(x, qw, gemv_config=config), want, dtype=DTYPE,
                                   name=f"{fmt} {n}x{k}, {meta['BLOCK_N']} rows, {config.num_warps} warps, "
                                        f"{codes}, loads ahead: {ahead}")
                t = timing.measure(lambda config=config: kernels.dequant_matmul(x, qw, gemv_config=config))
                tbps = timing.bandwidth_tbps(qw.nbytes, t)
                rows.append({"N": n, "K": k, "format": fmt, "block_n": meta["BLOCK_N"],
                             "num_warps": config.num_warps, "codes": codes, "loads_ahead": ahead,
                             "chosen": chosen == config,
                             "ms": t.median_ms, "cublas_ms": t_ref.median_ms, "weight_tbps": tbps,
                             "ours/cublas": t_ref.median_ms / t.median_ms, "ours/limit": tbps / limits["copy_tbps"]})
    return Measurement(rows=rows, metric="TB/s of weight bytes read; speedup over bf16 cuBLAS", limits=limits,
                       config={**_config(), "codes": "kernels.gemv_code_read",
                               "loads_ahead": "kernels.gemv_loads_ahead"})


@benchmark("quant.small_batch", chapter=CHAPTER,
           title="Weight-only INT4/INT8 GEMM at batch 2-64 against bf16 cuBLAS (and FP8 scaled_mm where supported)")
def bench_small_batch() -> Measurement:
    limits = ceilings.limits()
    batches = backend.pick(cpu=[2, 5], gpu=[2, 4, 8, 16, 32, 64])
    rows = [r for n, k in SHAPES for b in batches for r in _rows_for(n, k, b, limits)]
    goals = [Goal("int4-g128 ours/cublas up to batch 16 (min over shapes)",
                  _min_ratio(rows, "int4-g128", 16), ">=", 2.0)]
    return Measurement(rows=rows, metric="TB/s of weight bytes read; speedup over bf16 cuBLAS", limits=limits,
                       goals=goals, config={**_config(), "batches": batches, "gemm_inputs": GEMM_INPUTS})
