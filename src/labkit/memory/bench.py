"""The memory chapter's benchmarks: bandwidth against size, access pattern and launch
shape, and operations placed on the roofline.

Every number is a rate over a *counted* amount of work (:mod:`labkit.memory.roofline`),
divided by a CUDA-event median, beside the ceilings measured in the same run. Sizes come
from :func:`labkit.backend.pick`: gigabytes on the GPU, a few kilobytes under the
interpreter (where the timings say nothing about a GPU, and the records say so).
"""

from __future__ import annotations

import torch

from .. import backend, ceilings, check, timing, validate
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import copy, strided_read, vector_add
from .kernels import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_WARPS, launch_copy
from .occupancy import occupancy
from .roofline import Work, attainable_tflops, copy_work, matmul_work, softmax_work, vector_add_work

CHAPTER = "memory-hierarchy"
DTYPE = torch.float32
GOAL_FRACTION_OF_COPY = 0.90
SECTOR_BYTES = 32  # the unit in which L2 and DRAM serve a miss


def _probe_size() -> int:
    # Results are checked on a probe of this many elements before anything is timed: not
    # a multiple of any block size (so the masked tail runs), yet a multiple of 16, so it
    # reuses the kernel Triton compiled for the timed sizes. Checking the gigabyte buffers
    # themselves would cost more than the benchmark (the check compares in float64).
    return backend.pick(cpu=1000, gpu=2**20 + 48)


def size_label(n_bytes: int) -> str:
    """4096 -> '4 KiB', 2**30 -> '1 GiB': sizes as the figures label them."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:g} {unit}"
    return f"{n_bytes} B"


def _random(n: int, seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return check.randn(n, dtype=dtype, device=backend.device(), seed=seed)


def _tbps(work: Work, fn, *, flush_l2: bool) -> float:
    return timing.bandwidth_tbps(work.bytes, timing.measure(fn, flush_l2=flush_l2))


def _check_copy(**launch) -> None:
    x = _random(_probe_size(), seed=11)
    out = copy(x, out=check.empty_poisoned(x.shape, DTYPE, x.device), **launch)
    check.assert_close(out, x, name=f"copy({launch})" if launch else "copy")


def _check_vector_add() -> None:
    x, y = _random(_probe_size(), seed=12), _random(_probe_size(), seed=13)
    out = vector_add(x, y, out=check.empty_poisoned(x.shape, DTYPE, x.device))
    check.assert_close(out, x.double() + y.double(), dtype=DTYPE, name="vector_add")


def _sweep_rows(op: str, size_bytes: int, copy_limit: float) -> dict:
    n = size_bytes // DTYPE.itemsize
    x = _random(n, seed=1)
    out = torch.empty_like(x)
    if op == "copy":
        work = copy_work(n, DTYPE.itemsize)
        ours, theirs = (lambda: copy(x, out=out)), (lambda: out.copy_(x))
    else:
        y = _random(n, seed=2)
        work = vector_add_work(n, DTYPE.itemsize)
        ours, theirs = (lambda: vector_add(x, y, out=out)), (lambda: torch.add(x, y, out=out))
    # No L2 flush: the same buffers are copied again and again, so whatever fits in L2
    # stays there. That is the point of this sweep: the knee where it stops fitting.
    ours_tbps = _tbps(work, ours, flush_l2=False)
    torch_tbps = _tbps(work, theirs, flush_l2=False)
    return {
        "op": op, "buffer_bytes": size_bytes, "footprint_bytes": int(work.bytes), "elements": n,
        "ours_tbps": ours_tbps, "torch_tbps": torch_tbps,
        "ours/torch": ours_tbps / torch_tbps, "ours/limit": ours_tbps / copy_limit,
    }


@benchmark("memory.size_sweep", chapter=CHAPTER,
           title="Copy and vector add bandwidth from kilobytes to gigabytes, L2 left warm")
def size_sweep() -> Measurement:
    sizes = backend.pick(cpu=[2**12, 2**14, 2**16], gpu=[2**k for k in range(12, 33)])  # 4 KiB .. 4 GiB
    far_beyond_l2 = backend.pick(cpu=sizes[-1], gpu=2**30)
    limits = ceilings.limits()
    _check_copy()
    _check_vector_add()
    rows = [_sweep_rows(op, s, limits["copy_tbps"]) for op in ("copy", "vector add") for s in sizes]
    goals = [
        Goal(f"{op} at >= {size_label(far_beyond_l2)}: ours / copy limit",
             min(r["ours/limit"] for r in rows if r["op"] == op and r["buffer_bytes"] >= far_beyond_l2),
             ">=", GOAL_FRACTION_OF_COPY)
        for op in ("copy", "vector add")
    ]
    return Measurement(
        rows=rows, metric="TB/s (bytes read + bytes written, per second)", limits=limits, goals=goals,
        config={"dtype": "float32", "block_size": DEFAULT_BLOCK_SIZE, "num_warps": DEFAULT_NUM_WARPS,
                "flush_l2": False, "references": {"copy": "torch.Tensor.copy_", "vector add": "torch.add(out=)"}},
    )


def strided_traffic_model(n_out: int, stride: int, itemsize: int) -> float:
    """Bytes a strided read moves if memory is served in whole 32-byte sectors.

    Writes are contiguous: ``n_out * itemsize``. Reads span ``stride * itemsize`` bytes per
    element until that reaches a sector; beyond it every element costs a sector of its own.
    """
    return n_out * itemsize + n_out * min(stride * itemsize, SECTOR_BYTES)


@benchmark("memory.access_patterns", chapter=CHAPTER,
           title="Strided reads: useful bandwidth as the stride between neighbouring reads grows")
def access_patterns() -> Measurement:
    n_out = backend.pick(cpu=1000, gpu=2**24)  # 64 MiB written on the GPU: beyond L2
    strides = backend.pick(cpu=[1, 2, 8, 33], gpu=[1, 2, 4, 8, 16, 32, 64])
    limits = ceilings.limits()
    itemsize = DTYPE.itemsize
    rows = []
    for stride in strides:
        src = _random(n_out * stride, seed=stride)
        out = torch.empty(n_out, dtype=DTYPE, device=src.device)
        check.assert_close(strided_read(src, stride, out=check.empty_poisoned((n_out,), DTYPE, src.device)),
                           src[::stride], name=f"strided_read(stride={stride})")
        t = timing.measure(lambda: strided_read(src, stride, out=out))
        useful = 2 * n_out * itemsize
        modelled = strided_traffic_model(n_out, stride, itemsize)
        useful_tbps = timing.bandwidth_tbps(useful, t)
        rows.append({
            "stride": stride, "stride_bytes": stride * itemsize, "elements": n_out,
            "useful_tbps": useful_tbps, "sector_model_tbps": timing.bandwidth_tbps(modelled, t),
            "useful_fraction_model": useful / modelled, "ours/limit": useful_tbps / limits["copy_tbps"],
        })
    base = rows[0]["useful_tbps"]
    for r in rows:
        r["vs_stride_1"] = r["useful_tbps"] / base
    return Measurement(
        rows=rows, metric="useful TB/s (elements wanted, read + written, per second)", limits=limits,
        config={"dtype": "float32", "block_size": DEFAULT_BLOCK_SIZE, "num_warps": DEFAULT_NUM_WARPS,
                "sector_bytes": SECTOR_BYTES, "flush_l2": True},
    )


@benchmark("memory.block_size", chapter=CHAPTER,
           title="Copy bandwidth by BLOCK_SIZE and num_warps, with the occupancy each allows")
def block_size() -> Measurement:
    n = backend.pick(cpu=2**14, gpu=2**26)  # 256 MiB of fp32 on the GPU: ten times the L2
    block_sizes = backend.pick(cpu=[256, 1024, 4096], gpu=[2**k for k in range(8, 15)])
    warps = backend.pick(cpu=[1, 4], gpu=[1, 2, 4, 8, 16])
    limits = ceilings.limits()
    x = _random(n, seed=3)
    out = torch.empty_like(x)
    work = copy_work(n, DTYPE.itemsize)
    torch_tbps = _tbps(work, lambda: out.copy_(x), flush_l2=True)
    rows = []
    for bs in block_sizes:
        for nw in warps:
            _check_copy(block_size=bs, num_warps=nw)
            compiled = launch_copy(x, out, bs, nw)
            tbps = _tbps(work, lambda bs=bs, nw=nw: copy(x, out=out, block_size=bs, num_warps=nw), flush_l2=True)
            row = {
                "block_size": bs, "num_warps": nw, "elements_per_thread": bs / (32 * nw),
                "programs": -(-n // bs), "ours_tbps": tbps,
                "ours/torch": tbps / torch_tbps, "ours/limit": tbps / limits["copy_tbps"],
            }
            # Register counts exist only for compiled kernels, not under the interpreter.
            n_regs = getattr(compiled, "n_regs", None)
            if n_regs:
                occ = occupancy(n_regs, nw)
                row.update(registers_per_thread=n_regs, spilled_registers=getattr(compiled, "n_spills", 0),
                           resident_warps_per_sm=occ.warps_per_sm, occupancy_limited_by=occ.limited_by)
            rows.append(row)
    return Measurement(
        rows=rows, metric="TB/s (bytes read + bytes written, per second)", limits=limits,
        config={"dtype": "float32", "elements": n, "torch_copy_tbps": torch_tbps, "flush_l2": True},
    )


def _roofline_row(op: str, shape: str, dtype: torch.dtype, work: Work, fn, limits: dict, **extra) -> dict:
    t = timing.measure(fn)
    achieved = timing.tflops(work.flops, t)
    roof = attainable_tflops(work.intensity, peak_tflops=limits["matmul_bf16_tflops"], peak_tbps=limits["copy_tbps"])
    return {
        "op": op, "shape": shape, "dtype": validate.dtype_name(dtype), "flops": work.flops,
        "bytes": work.bytes, "intensity": work.intensity, "ms": t.median_ms, "tflops": achieved,
        "tbps": timing.bandwidth_tbps(work.bytes, t), "roof_tflops": roof, "achieved/roof": achieved / roof,
        **extra,
    }


@benchmark("memory.roofline", chapter=CHAPTER,
           title="Vector add, softmax, GEMV, GEMM and a linear layer by batch size, on the measured roofline")
def roofline_points() -> Measurement:
    limits = ceilings.limits()
    bf16 = torch.bfloat16
    rows = []

    n = backend.pick(cpu=2**14, gpu=2**28)
    x, y = _random(n, seed=4), _random(n, seed=5)
    out = torch.empty_like(x)
    _check_vector_add()
    add = vector_add_work(n, DTYPE.itemsize)
    rows.append(_roofline_row("vector add (ours, Triton)", f"{n}", DTYPE, add, lambda: vector_add(x, y, out=out), limits))
    rows.append(_roofline_row("vector add (torch)", f"{n}", DTYPE, add, lambda: torch.add(x, y, out=out), limits))
    del x, y, out

    m, k = backend.pick(cpu=(64, 1000), gpu=(16384, 8192))
    s = _random(m * k, seed=6).view(m, k)
    rows.append(_roofline_row("softmax (torch)", f"{m}x{k}", DTYPE, softmax_work(m, k, DTYPE.itemsize),
                              lambda: torch.softmax(s, dim=-1), limits))
    del s

    d = backend.pick(cpu=256, gpu=8192)  # the hidden size of a mid-sized LLM's linear layer
    w = _random(d * d, seed=7, dtype=bf16).view(d, d)
    # A linear layer y = x @ W.T on a batch of B tokens: B = 1 is a GEMV (decoding one
    # token), large B is a GEMM (prefill, training). Same weights; the intensity grows ~B.
    for batch in backend.pick(cpu=[1, 8, 64, 256], gpu=[2**k for k in range(0, 14)]):
        a = _random(batch * d, seed=8, dtype=bf16).view(batch, d)
        op = "GEMV (torch)" if batch == 1 else "GEMM (torch)" if batch == d else "linear layer (torch)"
        rows.append(_roofline_row(op, f"{batch}x{d} @ {d}x{d}", bf16, matmul_work(batch, d, d, bf16.itemsize),
                                  lambda a=a: a @ w.T, limits, batch=batch))
    return Measurement(
        rows=rows, metric="TFLOP/s over counted FLOPs; intensity over compulsory bytes", limits=limits,
        config={"roof": "min(matmul_bf16_tflops, intensity * copy_tbps)", "hidden": d,
                "flop_counting": "labkit.memory.roofline"},
    )
