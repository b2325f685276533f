"""Which kernels a piece of work launches, and their GPU time, from ``torch.profiler``.

One helper for every chapter that asks where time goes (the softmax chapter's view of
torch's kernels, the KV-cache decode step, the Qwen3 step): :func:`kernels_run` profiles
``calls`` calls of a function and returns each kernel's launches and self device time.
Under the interpreter there are no kernels; torch's ATen operators and their CPU time
stand in, so the code path is the same and the numbers say nothing about a GPU.
:func:`runtime_calls` is the host's side of the same story: the CUDA runtime and driver
calls it makes, and the time it spends in each (a call that waits for the GPU shows here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

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


def runtime_calls(fn: Callable[[], object], calls: int = 1) -> list[RuntimeCall]:
    """The CUDA runtime and driver calls the host makes in ``calls`` calls of ``fn``, with their
    count and host time summed by name, largest time first: where host time goes when it talks
    to the GPU, and which calls wait for it (an event or stream synchronization, a copy from
    pageable memory, a pinned allocation). Empty on a machine without a GPU.

    The device is synchronized after the profile, not inside it, so that the wait for the
    last call's work is not counted as the work's own."""
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls must be a positive int, got {calls!r}")
    if not backend.on_gpu():
        return []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    found = [RuntimeCall(e.key, e.count, e.cpu_time_total) for e in prof.key_averages()
             if e.device_type == DeviceType.CPU and e.key.startswith("cu")]
    return sorted(found, key=lambda c: -c.us)
