"""The memory chapter's benchmarks: bandwidth against size, access pattern and launch
shape, and operations placed on the roofline.

Every number is a rate over a *counted* amount of work (:mod:`labkit.memory.roofline`),
divided by a CUDA-event median, beside the ceilings measured in the same run. Sizes come
from :func:`labkit.backend.pick`: gigabytes on the GPU, a few kilobytes under the
interpreter (where the timings say nothing about a GPU, and the records say so).
"""

from __future__ import annotations

import torch

from .. import backend, ceilings, check, memory, timing, validate
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import copy, reference, strided_read, vector_add
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


# The size sweep reads each buffer this many bytes' worth per timed call (at most
# MAX_READ_PASSES passes), so even a buffer of a few KiB is timed over a kernel long
# enough that its fixed cost (launch on the GPU, ramp-up, the last wave) fades.
READ_TARGET_BYTES = 2**30
MAX_READ_PASSES = 1024
SWEEP_SIZES_GPU = sorted({2**k for k in range(14, 33)} | {3 * 2**k for k in range(22, 27)})  # 16 KiB .. 4 GiB,
# with points at 12, 24, 48, 96 and 192 MiB between the powers of two around the L2's size


def read_passes(size_bytes: int) -> int:
    """How many passes the size sweep's read makes over a buffer of ``size_bytes``."""
    target = backend.pick(cpu=2**16, gpu=READ_TARGET_BYTES)
    return max(1, min(MAX_READ_PASSES, target // size_bytes))


def _check_read_sum() -> None:
    x = _random(_probe_size(), seed=14)
    out = memory.read_sum(x, passes=2, out=check.empty_poisoned((3,), torch.float32, x.device))
    check.assert_close(out, reference.read_sum(x, 2, 3, DEFAULT_BLOCK_SIZE), dtype=DTYPE, name="read_sum")


def _sweep_row(op: str, size_bytes: int, limits: dict) -> dict:
    n = size_bytes // DTYPE.itemsize
    x = _random(n, seed=1)
    passes = 1
    if op == "read":
        passes = read_passes(size_bytes)
        partials = memory.read_sum(x)
        limit = limits["read_tbps"]
        working_set, ours_bytes, torch_bytes = size_bytes, passes * size_bytes, size_bytes
        ours, theirs = (lambda: memory.read_sum(x, passes=passes, out=partials)), (lambda: x.sum())
    elif op == "copy":
        out = torch.empty_like(x)
        limit = limits["copy_tbps"]
        working_set = ours_bytes = torch_bytes = copy_work(n, DTYPE.itemsize).bytes
        ours, theirs = (lambda: copy(x, out=out)), (lambda: out.copy_(x))
    else:
        y, out = _random(n, seed=2), torch.empty_like(x)
        limit = limits["copy_tbps"]
        working_set = ours_bytes = torch_bytes = vector_add_work(n, DTYPE.itemsize).bytes
        ours, theirs = (lambda: vector_add(x, y, out=out)), (lambda: torch.add(x, y, out=out))
    # No L2 flush: the same buffers are used call after call, so whatever fits in L2 stays
    # there. That is the point of this sweep: the knee where it stops fitting.
    ours_time = timing.measure(ours, flush_l2=False)
    torch_time = timing.measure(theirs, flush_l2=False)
    ours_tbps = timing.bandwidth_tbps(ours_bytes, ours_time)
    torch_tbps = timing.bandwidth_tbps(torch_bytes, torch_time)
    return {
        "op": op, "buffer_bytes": size_bytes, "footprint_bytes": int(working_set), "elements": n, "passes": passes,
        "ours_us_per_call": ours_time.median_ms * 1e3, "ours_tbps": ours_tbps, "torch_tbps": torch_tbps,
        "ours/torch": ours_tbps / torch_tbps, "ours/limit": ours_tbps / limit,
    }


SWEEP_OPS = ("read", "copy", "vector add")


@benchmark("memory.size_sweep", chapter=CHAPTER,
           title="Read, copy and vector add bandwidth from kilobytes to gigabytes, L2 left warm")
def size_sweep() -> Measurement:
    sizes = backend.pick(cpu=[2**12, 2**14, 2**16], gpu=SWEEP_SIZES_GPU)
    far_beyond_l2 = backend.pick(cpu=sizes[-1], gpu=2**30)
    limits = ceilings.limits()
    _check_read_sum()
    _check_copy()
    _check_vector_add()
    rows = [_sweep_row(op, s, limits) for op in SWEEP_OPS for s in sizes]
    goals = [
        Goal(f"{op} at >= {size_label(far_beyond_l2)}: ours / {'read' if op == 'read' else 'copy'} limit",
             min(r["ours/limit"] for r in rows if r["op"] == op and r["buffer_bytes"] >= far_beyond_l2),
             ">=", GOAL_FRACTION_OF_COPY)
        for op in SWEEP_OPS
    ]
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if backend.on_gpu() else None
    if l2_bytes:  # the L2 regime is a claim about a GPU; the interpreter has no L2 to show
        goals.append(Goal("read below the L2 size: best / read limit (above the HBM line)",
                          max(r["ours/limit"] for r in rows if r["op"] == "read" and r["buffer_bytes"] < l2_bytes),
                          ">=", 1.0))
    return Measurement(
        rows=rows, metric="TB/s (bytes read + bytes written, per second)", limits=limits, goals=goals,
        config={"dtype": "float32", "block_size": DEFAULT_BLOCK_SIZE, "num_warps": DEFAULT_NUM_WARPS,
                "flush_l2": False, "l2_bytes": l2_bytes,
                "timing": "CUDA events around one call, after a spin-wait that gives the host a head start; "
                          "nothing is flushed, so buffers that fit stay in L2 from call to call",
                "read": f"memory.read_sum over {READ_TARGET_BYTES} bytes per call ({MAX_READ_PASSES} passes at most), "
                        "loads bypassing L1; torch: x.sum(), one pass",
                "references": {"read": "torch.Tensor.sum", "copy": "torch.Tensor.copy_",
                               "vector add": "torch.add(out=)"}},
    )


LATENCY_NODE_BYTES = 128  # one node per 128-byte cache line


@benchmark("memory.latency", chapter=CHAPTER,
           title="Load latency by working set: a pointer chase from L1 through L2 to HBM")
def latency() -> Measurement:
    sizes = backend.pick(cpu=[2**12, 2**14], gpu=[2**k for k in range(12, 32)])  # 4 KiB .. 2 GiB
    hops = backend.pick(cpu=64, gpu=2**14)
    rows = []
    for size in sizes:
        table = memory.random_cycle(size, node_bytes=LATENCY_NODE_BYTES, seed=size)
        state = torch.zeros(1, dtype=torch.int64, device=table.device)
        if size == sizes[0]:  # the kernel against its reference, once: the rest is timing
            memory.pointer_chase(table, state, 37)
            if int(state.item()) != reference.pointer_chase(table.cpu(), 0, 37):
                raise check.CheckFailed("pointer_chase ended at the wrong node")
        table.sum()  # one read of the whole table: whatever fits in L2 starts there
        t = timing.measure(lambda: memory.pointer_chase(table, state, hops), flush_l2=False)
        rows.append({"working_set_bytes": size, "nodes": size // LATENCY_NODE_BYTES, "hops": hops,
                     "ns_per_hop": t.median_ms * 1e6 / hops})
        del table
    return Measurement(
        rows=rows, metric="ns per dependent load (median call time / hops)", limits={},
        config={"node_bytes": LATENCY_NODE_BYTES, "hops_per_call": hops, "flush_l2": False,
                "program": "one program of one warp; each load's address is the previous load's value",
                "warm_up": "the table is read once before timing; each call continues where the last ended"},
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
    n = backend.pick(cpu=2**14, gpu=2**26)  # 256 MiB of fp32 on the GPU: over four times the L2
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


def _roofline_row(op: str, shape: str, dtype: torch.dtype, work: Work, fn, **extra) -> dict:
    t = timing.measure(fn)
    return {
        "op": op, "shape": shape, "dtype": validate.dtype_name(dtype), "flops": work.flops,
        "bytes": work.bytes, "intensity": work.intensity, "ms": t.median_ms, "tflops": timing.tflops(work.flops, t),
        "tbps": timing.bandwidth_tbps(work.bytes, t), **extra,
    }


def roof_peaks(rows: list[dict], limits: dict) -> tuple[float, float]:
    """The roof's two ceilings: each the larger of the measured limit and the best row.

    A ceiling is the best rate measured; when a point of the same run beats the separate
    ceiling measurement (a linear layer's shape that cuBLAS runs faster than the
    ceiling's, vector add's two reads per write against the copy's one), that point is
    the best measured, and the roof must hold it too.
    """
    return (max(limits["matmul_bf16_tflops"], *(r["tflops"] for r in rows)),
            max(limits["copy_tbps"], *(r["tbps"] for r in rows)))


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
    rows.append(_roofline_row("vector add (ours, Triton)", f"{n}", DTYPE, add, lambda: vector_add(x, y, out=out)))
    rows.append(_roofline_row("vector add (torch)", f"{n}", DTYPE, add, lambda: torch.add(x, y, out=out)))
    del x, y, out

    m, k = backend.pick(cpu=(64, 1000), gpu=(16384, 8192))
    s = _random(m * k, seed=6).view(m, k)
    rows.append(_roofline_row("softmax (torch)", f"{m}x{k}", DTYPE, softmax_work(m, k, DTYPE.itemsize),
                              lambda: torch.softmax(s, dim=-1)))
    del s

    d = backend.pick(cpu=256, gpu=8192)  # the hidden size of a mid-sized LLM's linear layer
    w = _random(d * d, seed=7, dtype=bf16).view(d, d)
    # A linear layer y = x @ W.T on a batch of B tokens: B = 1 is a GEMV (decoding one
    # token), large B is a GEMM (prefill, training). Same weights; the intensity grows ~B.
    for batch in backend.pick(cpu=[1, 8, 64, 256], gpu=[2**k for k in range(0, 14)]):
        a = _random(batch * d, seed=8, dtype=bf16).view(batch, d)
        op = "GEMV (torch)" if batch == 1 else "GEMM (torch)" if batch == d else "linear layer (torch)"
        rows.append(_roofline_row(op, f"{batch}x{d} @ {d}x{d}", bf16, matmul_work(batch, d, d, bf16.itemsize),
                                  lambda a=a: a @ w.T, batch=batch))
    peak_tflops, peak_tbps = roof_peaks(rows, limits)
    for r in rows:
        r["roof_tflops"] = attainable_tflops(r["intensity"], peak_tflops=peak_tflops, peak_tbps=peak_tbps)
        r["achieved/roof"] = r["tflops"] / r["roof_tflops"]
    return Measurement(
        rows=rows, metric="TFLOP/s over counted FLOPs; intensity over compulsory bytes", limits=limits,
        config={"roof": "min(roof_tflops, intensity * roof_tbps), each the larger of the measured ceiling "
                        "(matmul_bf16_tflops, copy_tbps) and the best row of this run",
                "roof_tflops": peak_tflops, "roof_tbps": peak_tbps, "hidden": d,
                "flop_counting": "labkit.memory.roofline"},
    )
