"""The cuda-streams chapter's benchmarks: host-device copies, overlap, a timeline, the allocator.

Sizes come from :func:`labkit.backend.pick`: gigabytes and a 4096-wide model on the GPU, a
few kilobytes under the interpreter (where the numbers say nothing about a GPU, and the
records say so). Timings are CUDA-event medians (:func:`labkit.timing.measure`).
"""

from __future__ import annotations

import torch

from .. import backend, ceilings, check, streams, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import pipeline, runtime

CHAPTER = "cuda-streams"
OVERLAP_GOAL = 1.10  # the overlapped pipeline takes at most this times max(copy, compute)
# PCIe Gen5 x16: 32 GT/s per lane, 16 lanes, 128b/130b encoding: about 63 GB/s each way.
PCIE_GEN5_X16_GBPS = 32e9 * 16 * 128 / 130 / 8 / 1e9

COPY_SIZES_GPU = [2**k for k in range(12, 29, 2)]  # 4 KiB .. 256 MiB (the rate is flat from a few MiB)
COPY_SIZES_CPU = [2**12, 2**16, 2**20]


@benchmark("streams.copy_bandwidth", chapter=CHAPTER,
           title="Host-device copies over sizes: pinned against pageable, each direction and both at once")
def copy_bandwidth() -> Measurement:
    rows = []
    for direction in streams.DIRECTIONS:
        for n_bytes in backend.pick(cpu=COPY_SIZES_CPU, gpu=COPY_SIZES_GPU):
            row = {"direction": direction, "bytes": n_bytes}
            for kind, pinned in (("pinned", True), ("pageable", False)):
                t, moved = streams.transfer_timing(n_bytes, direction, pinned=pinned)
                row[f"{kind}_us"] = t.median_ms * 1e3
                row[f"{kind}_gbps"] = moved / t.seconds / 1e9
            row["pinned/pageable"] = row["pinned_gbps"] / row["pageable_gbps"]
            rows.append(row)
    best = {d: max(r["pinned_gbps"] for r in rows if r["direction"] == d) for d in streams.DIRECTIONS}
    for r in rows:
        r["pinned/best"] = r["pinned_gbps"] / best[r["direction"]]
    largest = max(r["bytes"] for r in rows)
    at_largest = {r["direction"]: r for r in rows if r["bytes"] == largest}
    goals = [Goal(f"{d} at the largest size: pinned / pageable", at_largest[d]["pinned/pageable"], ">=", 1.0)
             for d in ("h2d", "d2h")]
    return Measurement(
        rows=rows, metric="GB/s (bytes copied per second, 1e9; 'both' counts both directions)",
        limits={f"{d}_pinned_best_gbps": v for d, v in best.items()}, goals=goals,
        config={"pcie_gen5_x16_gbps_per_direction": PCIE_GEN5_X16_GBPS,
                "timing": "CUDA events around one copy on the current stream, after a spin-wait; "
                          "host buffers written once before timing (pages mapped)",
                "both": "one H2D and one D2H copy of the size each, on two side streams at once",
                # Records without this key come from a version whose 'both' ran the two copies
                # one after the other (see labkit.streams.bandwidth).
                "both_copies_independent": True})


def _model(d: int, n_layers: int, dtype: torch.dtype, *, pinned: bool):
    # Weights of norm ~1 per column (std 1/sqrt(d)), so a chain of matmuls neither blows up
    # nor vanishes, and its result can be compared at the end.
    weights = [check.randn(d, d, dtype=torch.float32, seed=100 + i).div_(d ** 0.5).to(dtype) for i in range(n_layers)]
    if pinned and backend.on_gpu():
        weights = [w.pin_memory() for w in weights]
    return weights


def _check_pipeline(x: torch.Tensor, host_weights, device_weights) -> None:
    """Overlapped and serial pipelines give what the plain chain of matmuls gives."""
    expected = pipeline.compute_layers(x, device_weights)
    for overlap in (True, False):
        out = streams.stream_layers(x, host_weights, overlap=overlap)
        runtime.synchronize()
        check.assert_close(out, expected, dtype=x.dtype, name=f"stream_layers(overlap={overlap})")


OVERLAP_D = {"cpu": 64, "gpu": 4096}
OVERLAP_LAYERS = {"cpu": 4, "gpu": 24}
OVERLAP_TOKENS = {"cpu": [8, 40], "gpu": [1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768]}


def _pipeline_setup(layers_by_mode: dict[str, int]):
    """``(mode, d, dtype, host_weights, device_weights)``: the pipeline's layers, pinned on the
    host and copied to the device, at this machine's size."""
    mode = "gpu" if backend.on_gpu() else "cpu"
    d = OVERLAP_D[mode]
    dtype = torch.bfloat16 if backend.on_gpu() else torch.float32
    host_weights = _model(d, layers_by_mode[mode], dtype, pinned=True)
    return mode, d, dtype, host_weights, [w.to(backend.device()) for w in host_weights]


@benchmark("streams.overlap", chapter=CHAPTER,
           title="Weights streamed from host memory layer by layer: copies overlapped with matmuls")
def overlap() -> Measurement:
    mode, d, dtype, host_weights, device_weights = _pipeline_setup(OVERLAP_LAYERS)
    n_layers = len(host_weights)
    landing = torch.empty_like(device_weights[0])
    _check_pipeline(check.randn(OVERLAP_TOKENS[mode][0] + 3, d, dtype=dtype, device=backend.device(), seed=7),
                    host_weights, device_weights)
    rows = []
    for tokens in OVERLAP_TOKENS[mode]:
        x = check.randn(tokens, d, dtype=dtype, device=backend.device(), seed=tokens)
        copy_t = timing.measure(lambda: pipeline.copy_layers(landing, host_weights), flush_l2=False)
        compute_t = timing.measure(lambda: pipeline.compute_layers(x, device_weights), flush_l2=False)
        serial_t = timing.measure(lambda: streams.stream_layers(x, host_weights, overlap=False), flush_l2=False)
        overlap_t = timing.measure(lambda: streams.stream_layers(x, host_weights, overlap=True), flush_l2=False)
        c, k = copy_t.median_ms, compute_t.median_ms
        rows.append({
            "tokens": tokens, "copy_ms": c, "compute_ms": k, "serial_ms": serial_t.median_ms,
            "overlapped_ms": overlap_t.median_ms, "compute/copy": k / c,
            "model_overlapped_ms": streams.pipelined_time_model(c / n_layers, k / n_layers, n_layers, overlap=True),
            "overlapped/max": overlap_t.median_ms / max(c, k), "serial/sum": serial_t.median_ms / (c + k),
            "serial/overlapped": serial_t.median_ms / overlap_t.median_ms,
            "copy_gbps": n_layers * d * d * dtype.itemsize / copy_t.seconds / 1e9,
            "compute_tflops": timing.tflops(2 * tokens * d * d * n_layers, compute_t),
        })
    goals = [Goal("overlapped pipeline / max(copy, compute), worst over sizes",
                  max(r["overlapped/max"] for r in rows), "<=", OVERLAP_GOAL)]
    return Measurement(
        rows=rows, metric="ms per pass over all layers (CUDA-event median)",
        limits={"matmul_bf16_tflops": ceilings.matmul_tflops()} if backend.on_gpu() else {},
        goals=goals,
        config={"d": d, "layers": n_layers, "dtype": str(dtype).replace("torch.", ""), "buffers": 2,
                "layer_bytes": d * d * dtype.itemsize,
                "host_memory": "pinned" if backend.on_gpu() else "pageable (no CUDA driver to pin)",
                "copy": "all layers' H2D copies back to back on one stream",
                "compute": "all layers' matmuls with the weights already on the device",
                "serial": "stream_layers(overlap=False): copy and matmul alternate on one stream",
                "overlapped": "stream_layers(overlap=True): copies on a side stream, two buffers, two events each"})


def _balanced_tokens(d: int, dtype: torch.dtype, host_weight: torch.Tensor, device_weight: torch.Tensor) -> int:
    """Tokens at which one layer's matmul takes about as long as its weights' copy."""
    probe = 1024 if backend.on_gpu() else 16
    landing = torch.empty_like(device_weight)
    copy_ms = timing.measure(lambda: landing.copy_(host_weight, non_blocking=True), flush_l2=False).median_ms
    x = check.randn(probe, d, dtype=dtype, device=backend.device(), seed=5)
    compute_ms = timing.measure(lambda: x @ device_weight, flush_l2=False).median_ms
    step = 256 if backend.on_gpu() else 8
    return int(min(65536, max(step, round(probe * copy_ms / compute_ms / step) * step)))


TIMELINE_LAYERS = {"cpu": 3, "gpu": 8}


@benchmark("streams.timeline", chapter=CHAPTER,
           title="Profiler timelines of the weight-streaming pipeline, serial and overlapped")
def timeline() -> Measurement:
    mode, d, dtype, host_weights, device_weights = _pipeline_setup(TIMELINE_LAYERS)
    n_layers = len(host_weights)
    tokens = _balanced_tokens(d, dtype, host_weights[0], device_weights[0])
    x = check.randn(tokens, d, dtype=dtype, device=backend.device(), seed=9)
    rows, summary = [], {}
    for run, overlap_copies in (("serial", False), ("overlapped", True)):
        def step():
            return streams.stream_layers(x, host_weights, overlap=overlap_copies)
        for _ in range(3):  # warm-up: cuBLAS handles, allocator blocks, events
            step()
        runtime.synchronize()
        spans = streams.profile_spans(step)
        # The device's spans; a CPU profile has only the host's, which then stand in.
        device = [s for s in spans if s["track"] != "host"] or spans
        end = max(s["start_us"] + s["dur_us"] for s in device)
        start = min(s["start_us"] for s in device)
        summary[run] = {"span_us": end - start, "busy_us": streams.busy_us(device),
                        "host_issued_by_us": streams.trace.issue_end_us(spans)}
        rows.extend({"run": run, **s} for s in spans)
    return Measurement(
        rows=rows, metric="microseconds from the first recorded event",
        config={"d": d, "layers": n_layers, "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
                "summary": summary,
                "profiler": "torch.profiler, CPU and CUDA activities, one call after three warm-ups; "
                            "device spans per stream, the host's CUDA runtime calls on 'host'"})


RACE_ELEMENTS = {"cpu": 1000, "gpu": 2**24}


@benchmark("streams.record_stream", chapter=CHAPTER,
           title="A tensor freed while another stream still reads it: the caching allocator's reuse")
def record_stream() -> Measurement:
    n = RACE_ELEMENTS["gpu" if backend.on_gpu() else "cpu"]
    rows = [streams.reuse_race(p, n) for p in streams.PROTECTIONS]
    goals = [Goal(f"elements read wrong with protection '{r['protection']}'", float(r["wrong_elements"]), "<=", 0.0)
             for r in rows if r["protection"] != "nothing"]
    return Measurement(
        rows=rows, metric="elements", goals=goals,
        config={"reader_delay_cycles": streams.allocator.READER_DELAY_CYCLES, "poison": streams.allocator.POISON,
                "scenario": "x = ones on the main stream; a side stream sleeps, then reads 2*x; the host frees x, "
                            "allocates a tensor of the same size on main and fills it with the poison"})
