"""Which kernels a piece of work launches, and their GPU time, from ``torch.profiler``.

One helper for every chapter that asks where time goes (the softmax chapter's view of
torch's kernels, the KV-cache decode step, the Qwen3 step): :func:`kernels_run` profiles
``calls`` calls of a function and returns each kernel's launches and self device time.
Under the interpreter there are no kernels; torch's ATen operators and their CPU time
stand in, so the code path is the same and the numbers say nothing about a GPU.
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
