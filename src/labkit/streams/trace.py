"""A ``torch.profiler`` trace as rows of spans: what ran where, from when, for how long.

The profiler (Kineto, over CUPTI on a GPU) records every kernel and copy with the stream
it ran on and its start and duration on the GPU's clock, and every CUDA runtime call the
host made (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cudaStreamWaitEvent``) on the
host's clock, which Kineto aligns with the GPU's. Its Chrome-trace export holds them all;
:func:`spans_from_chrome_trace` keeps those a timeline needs, one flat dict each, which
is what a benchmark records and what :func:`labkit.plots.gantt` draws.

On the CPU there is no device activity; the host's top-level ATen operators stand in, so
the same code draws a (host-only) timeline.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from .. import backend

# Chrome-trace categories of device work, and the label each gets on the timeline.
DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "memset"}
HOST_API = "cuda_runtime"


def _top_level(events: list[dict]) -> list[dict]:
    """Events not nested inside another on the same thread (a profile nests ATen ops)."""
    kept: list[dict] = []
    ends: dict[object, float] = {}
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= ends.get(e["tid"], float("-inf")):
            kept.append(e)
            ends[e["tid"]] = e["ts"] + e.get("dur", 0)
    return kept


def spans_from_chrome_trace(trace: dict) -> list[dict]:
    """Rows ``{track, kind, name, start_us, dur_us}`` from a Chrome trace, start at 0.

    Device work goes on a track per stream (``stream 7``); the host's CUDA runtime calls
    on ``host``. Without device work (a CPU profile), the top-level ``aten::`` operators
    go on ``host``. Rows are sorted by start time.
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("trace must be a Chrome trace: a dict with a 'traceEvents' list")
    complete = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    rows = []
    device = [e for e in complete if e.get("cat") in DEVICE_KINDS]
    if device:
        for e in device:
            rows.append({"track": f"stream {e.get('args', {}).get('stream', '?')}", "kind": DEVICE_KINDS[e["cat"]],
                         "name": e["name"], "start_us": float(e["ts"]), "dur_us": float(e.get("dur", 0))})
        host = [e for e in complete if e.get("cat") == HOST_API]
    else:
        host = _top_level([e for e in complete if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")])
    for e in host:
        rows.append({"track": "host", "kind": "host call", "name": e["name"],
                     "start_us": float(e["ts"]), "dur_us": float(e.get("dur", 0))})
    if not rows:
        return []
    t0 = min(r["start_us"] for r in rows)
    for r in rows:
        r["start_us"] -= t0
    return sorted(rows, key=lambda r: (r["start_us"], r["track"]))


def profile_spans(fn: Callable[[], object]) -> list[dict]:
    """Run ``fn`` once under the profiler and return its timeline (see the module's doc).

    Warm ``fn`` up first: the first call of anything pays for allocation, cuBLAS handles and
    compilation, and the profile would show that instead.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.on_gpu() else [])
    with profile(activities=activities) as prof:
        fn()
        if backend.on_gpu():
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    return spans_from_chrome_trace(trace)


def busy_us(spans: list[dict]) -> float:
    """How long at least one of ``spans`` was running: the length of their union, in us."""
    intervals = sorted((r["start_us"], r["start_us"] + r["dur_us"]) for r in spans)
    total, end = 0.0, float("-inf")
    for s, e in intervals:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def issue_end_us(spans: list[dict]) -> float:
    """When the host had issued all its work: the end of its last call that is not a wait.

    A profile ends with a synchronization (``cudaDeviceSynchronize``) that lasts until the
    device is done; it is the host waiting, not issuing, and is left out. Under the
    interpreter the host's operators are the work itself, and all of them count.
    """
    calls = [s for s in spans if s["track"] == "host" and "Synchronize" not in s["name"]]
    return max((s["start_us"] + s["dur_us"] for s in calls), default=0.0)
