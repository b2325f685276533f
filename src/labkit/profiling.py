"""Which kernels a piece of work launches, and their GPU time, from ``torch.profiler``.

One helper for every chapter that asks where time goes (the softmax chapter's view of
torch's kernels, the KV-cache decode step, the Qwen3 step): :func:`kernels_run` profiles
``calls`` calls of a function and returns each kernel's launches and self device time.
Under the interpreter there are no kernels; torch's ATen operators and their CPU time
stand in, so the code path is the same and the numbers say nothing about a GPU.
:func:`runtime_calls` is the host's side of the same story: the CUDA runtime and driver
calls it makes, and the time it spends in each (a call that waits for the GPU shows here),
with how much of that time the GPU was busy. :func:`python_hotspots` breaks the host's time
down by Python function (``cProfile``), for what lies outside any CUDA call.
"""

from __future__ import annotations

import cProfile
import pstats
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile, record_function

from . import backend


@dataclass(frozen=True)
class KernelTime:
    name: str       # the profiler's key: a CUDA kernel's name (an ATen op's under the interpreter)
    launches: int   # over all the profiled calls
    us: float       # self time over all the profiled calls: device time on a GPU, CPU time otherwise


def kernels_run(fn: Callable[[], object], calls: int = 1) -> list[KernelTime]:
    """Every kernel that ``calls`` calls of ``fn`` launch, with launches and time summed by name.

    Warm ``fn`` up first (compiles, autotuning, CUDA-graph capture): the profile counts
    whatever runs inside it.
    """
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls must be a positive int, got {calls!r}")
    activities = [ProfilerActivity.CUDA] if backend.on_gpu() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if backend.on_gpu():
            torch.cuda.synchronize()
    if backend.on_gpu():
        return [KernelTime(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA]
    return [KernelTime(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()
            if e.key.startswith("aten::")]


@dataclass(frozen=True)
class RuntimeCall:
    name: str    # a CUDA runtime or driver API call: cudaGraphLaunch, cudaMemcpyAsync, cuLaunchKernelEx, ...
    count: int   # over all the profiled calls
    us: float    # host time inside it over all the profiled calls


# The record_function range that runtime_calls puts around the profiled calls.
_WINDOW = "labkit.profiling.window"


@dataclass(frozen=True)
class RuntimeProfile:
    calls: list[RuntimeCall]  # by name, largest host time first
    wall_us: float            # the host's wall time over the profiled calls of fn (under the profiler)
    device_busy_us: float     # of that wall time, how long the GPU ran a kernel, copy or memset

    @property
    def outside_us(self) -> float:
        """Host time over the profiled calls spent outside any CUDA call: Python, torch's
        dispatch, the allocators; what a profile of CUDA calls cannot break down."""
        return self.wall_us - sum(c.us for c in self.calls)


def runtime_calls(fn: Callable[[], object], calls: int = 1) -> RuntimeProfile:
    """The CUDA runtime and driver calls the host makes in ``calls`` calls of ``fn``, with their
    count and host time summed by name, largest time first: where host time goes when it talks
    to the GPU, and which calls wait for it (an event or stream synchronization, a copy from
    pageable memory, a pinned allocation); and the wall time of those calls of ``fn``, in the
    same run, with how much of it the GPU was busy (a step whose GPU idles while its host works
    is bound by the host). No calls on a machine without a GPU.

    Only the calls made while ``fn`` runs count: the profiler's own synchronization when it
    stops (a ``cudaDeviceSynchronize`` that waits for whatever ``fn`` left queued, such as an
    asynchronous engine's step in flight) is not ``fn``'s. Another thread's calls in that time
    do count, and cannot be told apart: torch.profiler gives them the thread id of ``fn``'s
    (on an H100 with torch 2.11, a second thread's ``cudaDeviceSynchronize`` calls came back
    with the profiled thread's id), so profile with no other thread talking to the GPU."""
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls must be a positive int, got {calls!r}")
    if not backend.on_gpu():
        return RuntimeProfile([], 0.0, 0.0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_WINDOW):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    events = prof.events()
    totals: dict[str, list] = {}
    for e in events_inside(events, _WINDOW):
        if e.device_type == DeviceType.CPU and e.name.startswith("cu"):
            total = totals.setdefault(e.name, [0, 0.0])
            total[0] += 1
            total[1] += e.cpu_time_total
    found = sorted((RuntimeCall(name, count, us) for name, (count, us) in totals.items()), key=lambda c: -c.us)
    window = next(e for e in events if e.name == _WINDOW and e.device_type == DeviceType.CPU)
    start, end = window.time_range.start, window.time_range.end
    return RuntimeProfile(found, end - start, busy_time(device_spans(events), start, end))


def device_spans(events) -> list[tuple[float, float]]:
    """``(begin, end)`` of each kernel, copy and memset among torch.profiler's events: the GPU's work.

    Left out are the spans the profiler draws on the GPU's timeline for ``record_function``
    ranges (``is_user_annotation``, device type CUDA like the kernels): kineto stretches each
    from the first GPU activity launched inside its range to the last, gaps included. Counted
    as work, the one around :func:`runtime_calls`' window made the GPU look busy from the
    window's first kernel to its last (an H200 record of ``serve.engine_decode`` put it busy for
    5.2 ms of a profiled 5.4 ms engine step whose kernels, profiled apart, take 2.9 ms)."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def busy_time(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """How much of ``[start, end]`` the ``(begin, finish)`` intervals cover, overlaps counted once:
    a GPU's busy time in a window, from its kernels' and copies' spans (concurrent kernels on
    two streams are one busy period, and work before or after the window does not count)."""
    if end < start:
        raise ValueError(f"the window ends before it starts: [{start}, {end}]")
    covered, reach = 0.0, start
    clipped = ((max(b, start), min(f, end)) for b, f in intervals)
    for begin, finish in sorted((b, f) for b, f in clipped if f > b):
        if finish > reach:
            covered += finish - max(begin, reach)
            reach = finish
    return covered


def events_inside(events, window: str) -> list:
    """The profiler events that start inside the (first) ``record_function(window)`` range,
    the range itself excluded: what the code inside the range did, not what ran before it or
    as the profiler stopped."""
    # (the CPU's range: a record_function range also has a span of that name on the GPU's timeline)
    marks = [e for e in events if e.name == window and e.device_type == DeviceType.CPU]
    if not marks:
        raise ValueError(f"no record_function range named {window!r} in the profile")
    start, end = marks[0].time_range.start, marks[0].time_range.end
    return [e for e in events if e is not marks[0] and start <= e.time_range.start <= end]


@dataclass(frozen=True)
class PythonHotspot:
    function: str         # "file:line(name)", the file relative to the package or library it is in
    calls: int            # over all the profiled calls of fn
    own_us: float         # time in the function's own code (cProfile's tottime), over all of them
    cumulative_us: float  # time in it and everything it called (cProfile's cumtime)


def python_hotspots(fn: Callable[[], object], calls: int = 1, top: int = 15) -> list[PythonHotspot]:
    """The ``top`` Python functions (and C functions called from Python, such as a torch op or
    a CUDA synchronization) by their own time over ``calls`` calls of ``fn``, under ``cProfile``:
    where the host's time goes between and inside the CUDA calls :func:`runtime_calls` counts.
    cProfile's own cost makes each Python call slower, so compare these between two versions of
    the same work, not with a timing taken without it."""
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls must be a positive int, got {calls!r}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}")
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(calls):
            fn()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    found = [PythonHotspot(_function_label(*key), total_calls, own * 1e6, cumulative * 1e6)
             for key, (_, total_calls, own, cumulative, _) in stats.items()]
    return sorted(found, key=lambda h: -h.own_us)[:top]


def _function_label(path: str, line: int, name: str) -> str:
    """``file:line(name)`` with the file shortened to what follows site-packages (dist-packages
    on Debian's Python), src or the standard library's folder (a built-in function has no
    file: ``~:0(<method 'item' ...>)``, as pstats prints it)."""
    path = re.split(r"(?:site|dist)-packages/|src/|/lib/python3\.\d+/", path)[-1]
    return f"{path}:{line}({name})"
