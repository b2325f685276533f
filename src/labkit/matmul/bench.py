"""Benchmarks of chapter ``matmul-tensor-cores``: our kernels against cuBLAS and the matmul ceiling.

Rates count ``2 M N K`` FLOPs. Every implementation's output is checked against float64
(on a band of rows at each end, the rest being the same program code) before it is timed,
with the L2 flushed between calls as every benchmark in the book is timed. cuBLAS
(``torch.mm``, ``torch._scaled_mm``) and ours are timed in alternation, ``ROUNDS`` times
each, and each keeps its best: a GPU at full tensor-core load runs at its power limit and
its clock drifts between calls, so one timing each would compare two clocks, not two
kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from ..validate import dtype_name
from . import SKINNY_M, choose_kernel, fp8_matmul, fp8_matmul_reference, kernels, matmul, matmul_reference, quantize_rowwise
from .kernels import config, config_name
from .reference import tile_intensity

CHAPTER = "matmul-tensor-cores"
CHECK_ROWS = 64  # rows checked at each end of the output
ROUNDS = backend.pick(cpu=1, gpu=3)
TARGET_MS = backend.pick(cpu=200.0, gpu=60.0)
GOAL_VS_CUBLAS = 0.9

# (M, N, K): the cubes, then an MLP up-projection of an 8B-class model at 8192 tokens, the
# same at 128 tokens (skinny M: few output tiles), and its down-projection at 128 tokens.
BF16_SHAPES = backend.pick(
    cpu=[(40, 48, 64), (16, 64, 1040)],
    gpu=[(4096, 4096, 4096), (6144, 6144, 6144), (8192, 8192, 8192),
         (8192, 28672, 8192), (128, 28672, 8192), (128, 8192, 28672)])
# Warp specialization pays where tiles are many and K loops long: the non-skinny shapes.
WS_SHAPES = backend.pick(cpu=BF16_SHAPES[:1], gpu=[s for s in BF16_SHAPES if s[0] > 256])
FP8_SHAPES = backend.pick(
    cpu=[(40, 48, 64)],
    gpu=[(4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (128, 28672, 8192)])


def _check_rows(m: int, device) -> torch.Tensor:
    if m <= 2 * CHECK_ROWS:
        return torch.arange(m, device=device)
    return torch.cat([torch.arange(CHECK_ROWS, device=device), torch.arange(m - CHECK_ROWS, m, device=device)])


def _checked(name: str, out: torch.Tensor, expected_rows: Callable[[torch.Tensor], torch.Tensor], dtype) -> None:
    rows = _check_rows(out.shape[0], out.device)
    check.assert_close(out[rows], expected_rows(rows), dtype=dtype, name=f"{name} {tuple(out.shape)}")


def _working(calls: dict[str, Callable[[], torch.Tensor]], expected_rows, dtype, shape, failures: list[str]
             ) -> dict[str, Callable[[], torch.Tensor]]:
    """The calls whose output matches float64; the others are noted in ``failures`` and left out
    (a kernel that fails at one shape is recorded as such, and the rest is still measured)."""
    kept = {}
    for name, fn in calls.items():
        try:
            _checked(name, fn(), expected_rows, dtype)
        except Exception as e:
            failures.append(f"{name} at {shape}: {type(e).__name__}: {e}"[:400])
            continue
        kept[name] = fn
    return kept


def _best_rates(calls: dict[str, Callable[[], object]], flops: float, rounds: int = ROUNDS) -> dict[str, float]:
    """TFLOP/s of each call, the best of ``rounds`` timings taken in alternation."""
    best = dict.fromkeys(calls, 0.0)
    for _ in range(rounds):
        for name, fn in calls.items():
            t = timing.measure(fn, target_ms=TARGET_MS, reps=backend.pick(cpu=1, gpu=None))
            best[name] = max(best[name], timing.tflops(flops, t))
    return best


def _bf16_kernels(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Ours (the kernel :func:`choose_kernel` picks) and the alternatives at this shape: the
    persistent TMA kernel, and split-K where M is skinny. (The tiled pointer kernel is
    measured in ``matmul.ladder``, warp specialization in ``matmul.warp_specialized``; each
    autotuned kernel costs compiles and tuning here.)"""
    chosen = {"ours": lambda: matmul(a, b), "persistent": lambda: matmul(a, b, kernel="persistent")}
    if a.shape[0] <= SKINNY_M:
        chosen["split_k"] = lambda: matmul(a, b, kernel="split_k")
    return chosen


@benchmark("matmul.bf16", chapter=CHAPTER,
           title="bf16 matmul: our Triton kernels against cuBLAS, cubes 4096-8192 and LLM shapes")
def bf16() -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    ceiling = ceilings.matmul_tflops()
    rows, goals, failures = [], [], []
    for m, n, k in BF16_SHAPES:
        a = check.randn(m, k, dtype=dtype, device=backend.device(), seed=1)
        b = check.randn(k, n, dtype=dtype, device=backend.device(), seed=2)
        calls = _working({"cublas": lambda: torch.mm(a, b), **_bf16_kernels(a, b)},
                         lambda r: matmul_reference(a[r], b), dtype, (m, n, k), failures)
        rates = _best_rates(calls, 2 * m * n * k)
        ours, cublas = rates.get("ours"), rates["cublas"]
        row = {"M": m, "N": n, "K": k, "dtype": dtype_name(dtype), "auto": choose_kernel(a, b),
               "ours": ours, "cublas": cublas, **rates,
               "ours/cublas": ours / cublas if ours else None, "ours/limit": ours / ceiling if ours else None}
        for name in ("persistent", "split_k"):
            if name in rates:
                row[f"{name}/cublas"] = rates[name] / cublas
        rows.append(row)
        if backend.on_gpu():
            goals.append(Goal(f"ours/cublas {m}x{n}x{k}", row["ours/cublas"] or 0.0, ">=", GOAL_VS_CUBLAS))
    best_cublas = max(r["cublas"] for r in rows)
    best_ours = max(r["ours"] or 0.0 for r in rows)
    # The ceiling as labkit.ceilings measures it, once more now that the GPU has run for a
    # while: whether the first reading (at the start of a process) is the low one.
    ceiling_again = ceilings.matmul_tflops.__wrapped__()
    return Measurement(
        rows=rows, metric="TFLOP/s (2MNK / time)", limits={"matmul_bf16_tflops": ceiling}, goals=goals,
        config={"rounds": ROUNDS, "cublas": f"torch.mm, torch {torch.__version__}",
                "ours": "labkit.matmul.matmul, kernel chosen by choose_kernel, autotuned",
                "autotuned": {name: {str(key): label for key, label in kernels.best_config(name).items()}
                              for name in ("persistent", "split_k")} if backend.on_gpu() else {},
                "autotune_ms": {name: {str(key): timings for key, timings in kernels.tuning_timings(name).items()}
                                for name in ("persistent", "split_k")} if backend.on_gpu() else {},
                "best_cublas_tflops": best_cublas, "best_ours_tflops": best_ours,
                "ceiling_vs_best_measured": ceiling / max(best_cublas, best_ours),
                "ceiling_measured_again_at_the_end": ceiling_again,
                "checked": f"first and last {CHECK_ROWS} rows against float64", "failures": failures},
    )


@benchmark("matmul.warp_specialized", chapter=CHAPTER,
           title="The persistent TMA kernel with Triton's automatic warp specialization, against cuBLAS, bf16")
def warp_specialized() -> Measurement:
    # Its own benchmark (and process, in a GPU request): a compiler feature new on Hopper in
    # Triton 3.5 should not be able to take matmul.bf16's records down with it.
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    rows, failures = [], []
    for m, n, k in WS_SHAPES:
        a = check.randn(m, k, dtype=dtype, device=backend.device(), seed=1)
        b = check.randn(k, n, dtype=dtype, device=backend.device(), seed=2)
        calls = _working({"cublas": lambda: torch.mm(a, b), "persistent_ws": lambda: matmul(a, b, kernel="persistent_ws")},
                         lambda r: matmul_reference(a[r], b), dtype, (m, n, k), failures)
        rates = _best_rates(calls, 2 * m * n * k)
        ws = rates.get("persistent_ws")
        rows.append({"M": m, "N": n, "K": k, "persistent_ws": ws, "cublas": rates["cublas"],
                     "persistent_ws/cublas": ws / rates["cublas"] if ws else None})
    return Measurement(
        rows=rows, metric="TFLOP/s (2MNK / time)",
        config={"rounds": ROUNDS, "failures": failures,
                "autotuned": {str(key): label for key, label in kernels.best_config("persistent").items()}
                if backend.on_gpu() else {},
                "kernel": "persistent_matmul_kernel with WARP_SPECIALIZE=True, FLATTEN=False"},
    )


def _scaled_mm_rowwise(a8, sa, w8, sw):
    # cuBLASLt's row-wise FP8 GEMM: scale_a [M, 1], scale_b [1, N], W column-major (w8.t()).
    return torch._scaled_mm(a8, w8.t(), scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16)


@benchmark("matmul.fp8", chapter=CHAPTER,
           title="FP8 E4M3 matmul with per-row scales: ours against torch._scaled_mm (cuBLASLt)")
def fp8() -> Measurement:
    from ..quant import fp8_supported

    on_fp8_gpu, why = fp8_supported()
    rows, goals, failures = [], [], []
    for m, n, k in FP8_SHAPES:
        a8, sa = quantize_rowwise(check.randn(m, k, dtype=torch.bfloat16, device=backend.device(), seed=1))
        w8, sw = quantize_rowwise(check.randn(n, k, dtype=torch.bfloat16, device=backend.device(), seed=2))
        calls = {"ours": lambda: fp8_matmul(a8, sa, w8, sw)}
        if on_fp8_gpu:
            calls["scaled_mm"] = lambda: _scaled_mm_rowwise(a8, sa, w8, sw)
        calls = _working(calls, lambda r: fp8_matmul_reference(a8[r], sa[r], w8, sw), torch.bfloat16, (m, n, k),
                         failures)
        rates = _best_rates(calls, 2 * m * n * k)
        ours, peer = rates.get("ours"), rates.get("scaled_mm")
        rows.append({"M": m, "N": n, "K": k, "ours": ours, "scaled_mm": peer,
                     "ours/scaled_mm": ours / peer if ours and peer else None})
        if on_fp8_gpu:
            goals.append(Goal(f"ours/scaled_mm {m}x{n}x{k}", rows[-1]["ours/scaled_mm"] or 0.0, ">=", GOAL_VS_CUBLAS))
    return Measurement(
        rows=rows, metric="TFLOP/s (2MNK / time)", goals=goals,
        config={"rounds": ROUNDS, "scales": "fp32, one per row of A and one per row of W (labkit.matmul.quantize_rowwise)",
                "scaled_mm": ("torch._scaled_mm(a, w.t(), scale_a=[M,1], scale_b=[1,N], out_dtype=bf16)" if on_fp8_gpu
                              else f"not run: {why}"),
                "autotuned": {str(key): label for key, label in kernels.best_config("fp8").items()}
                if backend.on_gpu() else {},
                "checked": f"first and last {CHECK_ROWS} rows against float64 of the dequantized operands",
                "failures": failures},
    )


# The build's ladder at one shape: each rung adds one idea to the last.
LADDER = backend.pick(
    cpu=[("naive", "naive", None), ("tiled, row-major order", "tiled", config(16, 32, 32, 4, 1, group_m=1)),
         ("tiled, grouped order", "tiled", config(16, 32, 32, 4, 1, group_m=4)),
         ("persistent TMA", "persistent", config(16, 32, 32, 4, 1, group_m=4))],
    gpu=[("naive", "naive", None),
         ("tiled 64x64, 1 stage, row-major order", "tiled", config(64, 64, 32, 4, 1, group_m=1)),
         ("tiled 128x128, 1 stage, row-major order", "tiled", config(128, 128, 64, 8, 1, group_m=1)),
         ("tiled 128x128, 1 stage, grouped order", "tiled", config(128, 128, 64, 8, 1, group_m=8)),
         ("tiled 128x128, 4 stages, grouped order", "tiled", config(128, 128, 64, 8, 4, group_m=8)),
         ("tiled 128x256, 3 stages, grouped order", "tiled", config(128, 256, 64, 8, 3, group_m=8)),
         ("persistent TMA 128x256, 3 stages", "persistent", config(128, 256, 64, 8, 3, group_m=8)),
         ("persistent TMA, autotuned", "persistent", None)])
LADDER_ROUNDS = backend.pick(cpu=1, gpu=2)
# 4096^3: the naive kernel reads B once per row of A, 137 GB, and must finish in seconds.
LADDER_SHAPE = backend.pick(cpu=(40, 48, 64), gpu=(4096, 4096, 4096))


@benchmark("matmul.ladder", chapter=CHAPTER,
           title="From naive to cuBLAS class at one shape: each step of the build, against cuBLAS")
def ladder() -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    m, n, k = LADDER_SHAPE
    a = check.randn(m, k, dtype=dtype, device=backend.device(), seed=1)
    b = check.randn(k, n, dtype=dtype, device=backend.device(), seed=2)
    calls = {"cublas": lambda: torch.mm(a, b)}
    for label, kernel, cfg in LADDER:
        calls[label] = lambda kernel=kernel, cfg=cfg: matmul(a, b, kernel=kernel, cfg=cfg)
    failures: list[str] = []
    calls = _working(calls, lambda r: matmul_reference(a[r], b), dtype, LADDER_SHAPE, failures)
    rates = _best_rates(calls, 2 * m * n * k, rounds=LADDER_ROUNDS)
    rows = []
    for label, kernel, cfg in LADDER:
        rows.append({"step": label, "kernel": kernel, "config": config_name(cfg) if cfg else
                     ("autotuned" if kernel != "naive" else "1 row x 64 columns a program"),
                     "intensity_flop_per_byte": (tile_intensity(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"],
                                                                a.element_size()) if cfg else None),
                     "tflops": rates.get(label), "cublas": rates["cublas"],
                     "ours/cublas": rates[label] / rates["cublas"] if label in rates else None})
    return Measurement(rows=rows, metric="TFLOP/s (2MNK / time)",
                       config={"shape": LADDER_SHAPE, "dtype": dtype_name(dtype), "rounds": LADDER_ROUNDS,
                               "failures": failures})


TILE_SWEEP = backend.pick(
    cpu=[config(16, 32, 32, 4, s) for s in (1, 2)],
    gpu=[config(bm, bn, bk, w, s) for bm, bn, bk, w in ((64, 64, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8))
         for s in (1, 2, 3, 4)])
TILES_SHAPE = backend.pick(cpu=(40, 48, 64), gpu=(8192, 8192, 8192))


@benchmark("matmul.tiles", chapter=CHAPTER,
           title="The persistent TMA kernel by tile shape and pipeline depth (num_stages), bf16")
def tiles() -> Measurement:
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    m, n, k = TILES_SHAPE
    a = check.randn(m, k, dtype=dtype, device=backend.device(), seed=1)
    b = check.randn(k, n, dtype=dtype, device=backend.device(), seed=2)
    rows = []
    for cfg in TILE_SWEEP:
        need = kernels.shared_memory_bytes(cfg, a.element_size(), a.element_size())
        row = {"config": config_name(cfg), "BLOCK_M": cfg.kwargs["BLOCK_M"], "BLOCK_N": cfg.kwargs["BLOCK_N"],
               "BLOCK_K": cfg.kwargs["BLOCK_K"], "num_stages": cfg.num_stages, "num_warps": cfg.num_warps,
               "shared_bytes": need, "intensity_flop_per_byte": tile_intensity(cfg.kwargs["BLOCK_M"],
                                                                                cfg.kwargs["BLOCK_N"], a.element_size())}
        if need > kernels.HOPPER_SHARED_MEMORY:
            rows.append({**row, "tflops": None, "note": "does not fit in 227 KB of shared memory"})
            continue
        failures: list[str] = []
        calls = _working({"t": lambda cfg=cfg: matmul(a, b, kernel="persistent", cfg=cfg)},
                         lambda r: matmul_reference(a[r], b), dtype, TILES_SHAPE, failures)
        if failures:
            rows.append({**row, "tflops": None, "note": failures[0]})
            continue
        rows.append({**row, "tflops": _best_rates(calls, 2 * m * n * k, rounds=1)["t"], "note": ""})
    return Measurement(rows=rows, metric="TFLOP/s (2MNK / time)",
                       config={"shape": TILES_SHAPE, "dtype": dtype_name(dtype), "kernel": "persistent_matmul_kernel",
                               "rounds": 1})
